"""Full blocks the connector did not store, counted by reason and reported once per interval.

kvpool promises that a block one request computed is there for the next one; when a block is
not stored anyway, an operator must be able to see how many and why without a debug log. This
part owns those counts: the scheduler role adds to them where it gives a block up, vLLM's stat
logger reads the interval's counts (``KVConnectorStats`` on the scheduler side), and a warning
names them at most once per ``interval_s``. No I/O besides logging; called from vLLM's scheduler
thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger("kvpool.vllm")

# Why a full block was not stored (the label of kvpool_unstored_blocks in vLLM's stats).
RESERVE_REFUSED = "reserve_refused"  # kvpoold answered a reservation with an error
STORE_WAIT = "store_wait"            # a finished request waited store_wait_s for tickets/planning
DAEMON_UNAVAILABLE = "daemon_unavailable"   # the daemon was down or backing off
STORE_FAILED = "store_failed"        # a worker reported the store job failed
PREEMPTED = "preempted"              # vLLM reused a preempted request's block before its store
WINDOW_FREED = "window_freed"        # ... or a block that left a sliding window, before its store
REASONS = (RESERVE_REFUSED, STORE_WAIT, DAEMON_UNAVAILABLE, STORE_FAILED, PREEMPTED,
           WINDOW_FREED)

_WHY = {RESERVE_REFUSED: "kvpoold refused the scheduler's reservations (the error is logged at "
                         "debug)",
        STORE_WAIT: "a finished request waited store_wait_s for tickets or planning time",
        DAEMON_UNAVAILABLE: "kvpoold was unreachable",
        STORE_FAILED: "a worker's store job failed",
        PREEMPTED: "vLLM gave a preempted request's block to another request before its store "
                   "was planned",
        WINDOW_FREED: "vLLM gave a block that had left a sliding window to another request "
                      "before its store was planned"}


class StoreLosses:
    """Counts of unstored full blocks by reason: in all (``totals``), since vLLM last asked
    (``take_interval``), and since the last warning."""

    def __init__(self, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self.totals: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._interval: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._logged_at = float("-inf")

    def add(self, reason: str, blocks: int) -> None:
        """``blocks`` full blocks will never be stored, for ``reason`` (one of ``REASONS``)."""
        if blocks <= 0:
            return
        if reason not in self.totals:
            raise ValueError(f"unknown reason for an unstored block: {reason!r}")
        self.totals[reason] += blocks
        self._interval[reason] = self._interval.get(reason, 0) + blocks
        self._unlogged[reason] = self._unlogged.get(reason, 0) + blocks
        self.maybe_log()

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def take_interval(self) -> dict[str, int]:
        """The counts added since the last call (what vLLM's stat logger reports per
        interval); empty if none."""
        out, self._interval = self._interval, {}
        return out

    def maybe_log(self, final: bool = False) -> None:
        """Warn with the counts since the last warning, at most once per ``interval_s``: under
        a long overload blocks are given up every step, and one line per step would drown the
        engine's log. ``final`` (the engine shuts down): whatever is left, now."""
        if not self._unlogged:
            return
        now = self._clock()
        if now < self._logged_at + self.interval_s and not final:
            return
        parts = ", ".join(f"{n} because {_WHY[r]} ({r})" for r, n in self._unlogged.items())
        logger.warning("kvpool: full blocks not stored in the pool since the last report: %s; "
                       "those prefixes will miss", parts)
        self._unlogged = {}
        self._logged_at = now
