"""The vLLM (0.33) KV connector, ``KVPoolConnector``, and the parts of its scheduler side.

vLLM loads the connector by module path and class name::

    "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.client.vllm"

(it imports this package, then reads ``KVPoolConnector`` from it). The facade lives in
``connector.py``; its names are exported here lazily, through the module ``__getattr__``, so
that importing a part (``kvpool.client.vllm.store_planner``, ``.store_batches``, ...) does not
import vLLM: the parts are plain Python, tested without it. This file must never import vLLM,
nor any part, at import time.
"""

from __future__ import annotations

from typing import Any

# Names read from ``kvpool.client.vllm`` by vLLM's loader, tests and docs: all in connector.py.
_CONNECTOR_NAMES = ("KVPoolConnector", "KvpoolStats", "CONNECTOR_KEYS", "SCHEDULER_METHODS")

__all__ = list(_CONNECTOR_NAMES)


def __getattr__(name: str) -> Any:
    if name in _CONNECTOR_NAMES:
        from kvpool.client.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
