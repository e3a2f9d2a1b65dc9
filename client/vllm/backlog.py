"""The backlog: finished requests that keep their GPU blocks until their last blocks are planned.

A request vLLM finishes may still have full blocks the store planner has not planned (the step
budget deferred them, or the stock had no tickets for them). vLLM keeps its blocks while the
connector says so (``request_finished`` answers True: its delayed free), so the backlog keeps
them for at most ``Budgets.store_wait_s``, while the planner plans them first in each step
(``StorePlanner.queue_finished``). A request leaves the backlog once its blocks are all planned,
when its wait is over, or at once when the daemon is away or refuses reservations (its
unplanned blocks are then counted lost); ``end`` returns who left, and the role frees those
whose store batches have all resolved.

Owns each held request's deadline, in the order they finished. Never waits, never calls the
daemon (it asks ``SchedulerClient.reserving`` whether tickets are still coming).
"""

from __future__ import annotations

from typing import Any, Collection

from kvpool.client.vllm.budgets import Budgets
from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.store_losses import (DAEMON_UNAVAILABLE, RESERVE_REFUSED, STORE_WAIT,
                                             StoreLosses)
from kvpool.client.vllm.store_planner import StorePlanner


class Backlog:
    """Called from vLLM's scheduler thread only."""

    def __init__(self, planner: StorePlanner, client: Any, link: DaemonLink,
                 namespaces: list[bytes], losses: StoreLosses, budgets: Budgets) -> None:
        self._planner = planner
        self.client = client
        self._link = link
        self._namespaces = namespaces
        self._losses = losses
        self.store_wait_s = budgets.store_wait_s
        self._clock = budgets.clock
        # Request id -> when its wait ends, in the order they finished (which is their
        # deadline order: end() stops at the first one still in time).
        self._until: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self._until)

    def holds(self, rid: str) -> bool:
        return rid in self._until

    def keeps(self, st: ReqState) -> bool:
        """``st`` finished (and loads nothing): True if it keeps its blocks because full ones
        are not planned yet and tickets may still come; otherwise those blocks are counted
        lost."""
        rid = st.request.request_id
        unstored = self._planner.unstored(rid)
        if not unstored:
            return False
        if not self._link.ok():
            self._losses.add(DAEMON_UNAVAILABLE, unstored)
        elif not any(map(self.client.reserving, self._namespaces)):
            self._losses.add(RESERVE_REFUSED, unstored)
        else:
            # Full blocks wait for tickets from the stock: keep them until they are planned.
            self._until[rid] = self._clock() + self.store_wait_s
            self._planner.queue_finished(rid)
            return True
        return False

    def end(self, planned: list[str]) -> list[str]:
        """The requests that leave the backlog this step: those whose blocks are all planned
        (``planned``, from ``StorePlanner.plan``), those that waited ``store_wait_s``, or all
        of them while the daemon is away or refuses reservations; blocks they leave unplanned
        are counted lost. Costs what changed, not the backlog's length: it runs every step."""
        if not self._link.ok():
            leaving, reason = list(self._until), DAEMON_UNAVAILABLE
        elif not any(map(self.client.reserving, self._namespaces)):
            leaving, reason = list(self._until), RESERVE_REFUSED
        else:
            reason = STORE_WAIT
            leaving = list(planned)
            now = self._clock()
            for rid, until in self._until.items():   # the oldest first: stop at one in time
                if now < until:
                    break
                leaving.append(rid)
        out = []
        for rid in leaving:
            if self._until.pop(rid, None) is None:
                continue        # (left already)
            self._losses.add(reason, self._planner.unqueue_finished(rid))
            out.append(rid)
        self._losses.maybe_log()
        return out

    def forget(self, rid: str) -> None:
        self._until.pop(rid, None)

    def tracked(self) -> Collection[str]:
        return self._until.keys()
