"""The scheduler side's parts are plain Python: importing them (and the package) loads no vLLM,
so they are tested, and could be reused, without it."""

from __future__ import annotations

import subprocess
import sys

PARTS = ("backlog", "budgets", "daemon_link", "lazy_store", "lookups", "loads", "parts",
         "pd_stream", "requests", "specs", "store_batches", "store_losses", "store_planner")


def test_importing_the_parts_loads_no_vllm():
    code = ("import sys\n"
            + "".join(f"import kvpool.client.vllm.{m}\n" for m in PARTS)
            + "import kvpool.client.vllm as pkg\n"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')),"
            " 'kvpool.client.vllm.connector' in sys.modules, callable(pkg.__getattr__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip().splitlines()[-1]
    assert out == "[] False True"
