"""Every wall-clock budget of the connector's scheduler side, and the clock they are read on.

Two kinds, all in seconds here:

- per-step CPU budgets: how long ``build_connector_meta`` may spend planning stores in one step
  (``plan_s``, ``step_s``, ``overdue_s``, ``pressure_s``), and how long the planning queue's
  front may wait before a step spends ``overdue_s`` on it (``overdue_after_s``);
- waits: how long a finished request keeps its GPU blocks for its last stores
  (``store_wait_s``), how old a partial lookup answer may get before it is asked again
  (``lookup_stale_s``), how long a P/D hand-off may make no progress (``pd_wait_s``), the
  daemon link's back-off after a failure (``backoff_s`` doubling to ``backoff_max_s``), and how
  often unstored blocks are summed up in the log (``report_interval_s``).

Why each has its value, and its bounds, are told once, at its ``ClientConfig`` field
(``shared/config.py``), which is also how an operator sets it (``kv_connector_extra_config``
key or ``KVPOOL_<NAME>`` variable). The parts take one ``Budgets`` at construction and read
time only through its ``clock`` (default ``time.monotonic``), so a test drives time by
passing its own. Plain data: no vLLM import, no daemon calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kvpool.shared.config import ClientConfig


@dataclass(frozen=True, slots=True)
class Budgets:
    plan_s: float              # store_plan_budget_us
    step_s: float              # store_step_budget_us
    overdue_after_s: float     # store_overdue_after_s
    overdue_s: float           # store_overdue_budget_us
    pressure_s: float          # store_pressure_budget_us
    store_wait_s: float        # store_wait_s
    lookup_stale_s: float      # lookup_stale_s
    pd_wait_s: float           # pd_wait_s
    backoff_s: float           # reconnect_backoff_ms
    backoff_max_s: float       # reconnect_backoff_max_ms
    report_interval_s: float   # unstored_report_s
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def from_config(cls, config: ClientConfig | None = None,
                    clock: Callable[[], float] = time.monotonic) -> "Budgets":
        """The budgets ``config`` sets (its defaults when None), read on ``clock``."""
        c = config if config is not None else ClientConfig()
        return cls(plan_s=c.store_plan_budget_us / 1e6, step_s=c.store_step_budget_us / 1e6,
                   overdue_after_s=c.store_overdue_after_s,
                   overdue_s=c.store_overdue_budget_us / 1e6,
                   pressure_s=c.store_pressure_budget_us / 1e6, store_wait_s=c.store_wait_s,
                   lookup_stale_s=c.lookup_stale_s, pd_wait_s=c.pd_wait_s,
                   backoff_s=c.reconnect_backoff_ms / 1000,
                   backoff_max_s=c.reconnect_backoff_max_ms / 1000,
                   report_interval_s=c.unstored_report_s, clock=clock)
