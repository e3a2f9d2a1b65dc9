"""The scheduler side's use of the daemon connection, behind a circuit breaker.

Owns whether the daemon may be used now (``ok``), the back-off after a failure, taking in what
the daemon has answered (``pump``) and sending requests nobody waits for (``nowait``). Every
other part asks ``ok()`` before using the daemon and reports ``DaemonUnavailable`` here
(``failed``), so a daemon that is missing or slow costs one failed call per back-off period,
not one per request. Never waits: ``pump`` takes in answers already there; the connection is
made in the background by ``SchedulerClient``. Never raises ``DaemonUnavailable`` to vLLM.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvpool.client.vllm.budgets import Budgets
from kvpool.shared.errors import DaemonUnavailable, KvpoolError

logger = logging.getLogger("kvpool.vllm")


class DaemonLink:
    """Called from vLLM's scheduler thread only."""

    def __init__(self, client: Any, budgets: Budgets) -> None:
        self.client = client
        self.pumped = False               # the last pump found the daemon connected
        self._clock = budgets.clock
        self._backoff_s, self._backoff_max_s = budgets.backoff_s, budgets.backoff_max_s
        self._retry_at = float("-inf")
        self._fail_backoff = budgets.backoff_s

    def ok(self) -> bool:
        """False while backing off after a failure: use no daemon call then."""
        return self._clock() >= self._retry_at

    def failed(self, err: Exception) -> None:
        """The daemon failed a call: back off (doubling up to ``backoff_max_s``); one warning
        per outage, not one per call."""
        now = self._clock()
        if now >= self._retry_at:
            logger.warning("kvpool daemon unavailable (%s); serving without the pool, retrying "
                           "in %.1f s", err, self._fail_backoff)
        self._retry_at = now + self._fail_backoff
        self._fail_backoff = min(self._fail_backoff * 2, self._backoff_max_s)

    def succeeded(self) -> None:
        self._fail_backoff = self._backoff_s

    def pump(self) -> bool:
        """Connect (without waiting) and take in whatever the daemon has answered; False while
        the daemon cannot be used (down, backing off, or the connection still being made)."""
        self.pumped = False
        if not self.ok():
            return False
        try:
            if not self.client.ready():
                return False
            self.client.poll(just_ready=True)
        except DaemonUnavailable as e:
            self.failed(e)
            return False
        except KvpoolError as e:     # the daemon refused our Hello (another protocol version)
            self.failed(e)
            return False
        self.pumped = True
        return True

    @staticmethod
    def nowait(fn: Callable[..., Any], *args: Any) -> bool:
        """Send a request nobody waits for; False if it could not be sent. Leases and slots
        of a connection that is gone are released by the daemon with it, so losing these
        is harmless."""
        try:
            fn(*args)
        except DaemonUnavailable as e:
            logger.debug("kvpool: %s not sent: %s", getattr(fn, "__name__", fn), e)
            return False
        return True
