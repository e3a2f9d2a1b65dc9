"""Lookups sent to the daemon: the fallback where the shared-memory index cannot answer
(``lookups.py`` decides when). One call per namespace for a step's batch of requests, one batch
in flight, collected without waiting; hits come pinned with leases, so every lease of an answer
nobody takes (a failed batch's other calls, an orphaned call answering late) is handed to the
stray list (``take_stray``). A state group's keys go one by one (``hybrid.state_key_lists``) and
come back folded into one answer per request.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.hybrid import merge_state_answer, state_key_lists
from kvpool.client.vllm.pd_stream import Answer
from kvpool.shared.errors import DaemonUnavailable, KvpoolError

logger = logging.getLogger("kvpool.vllm")


class Collected(NamedTuple):
    """A batch's answers: per request, per group (start, hit, slot refs, leases), and the keys
    each group asked; ``failed``: the batch failed (its requests get no answer)."""

    ids: list[str]
    per_req: dict[str, list[Answer]]
    per_keys: dict[str, list[list[bytes]]]
    failed: bool = False


class RoundTrips:
    """Called from vLLM's scheduler thread only."""

    def __init__(self, groups: list[Any], client: Any, link: DaemonLink) -> None:
        self.groups = groups
        self.client = client
        self._link = link
        self._release: list[int] = []     # leases of answers no request takes (take_stray)
        self._calls: list[tuple[Any, int, list[tuple[str, int]], list]] = []
        self._replies: list[Any] = []
        self._orphans: list[Any] = []     # lookups nobody waits for; their leases get released
        self.fenced = False               # the batch in flight was sent after a reset

    @property
    def in_flight(self) -> bool:
        return bool(self._calls)

    @property
    def has_stray(self) -> bool:
        return bool(self._release)

    def take_stray(self) -> list[int]:
        """The leases of answers nobody takes (a failed batch's, late orphans'), to release;
        handed out once."""
        out, self._release = self._release, []
        return out

    def send(self, ids: list[str], spans_of: Any, fenced: bool) -> bool:
        """Send one lookup per namespace for ``ids`` (``spans_of(rid, gi, g)``: the request's
        first block asked and keys, in group ``gi``); False if the daemon is unavailable (the
        link is told)."""
        calls = []
        try:
            for gi, g in enumerate(self.groups):
                lists, spans = [], []
                for rid in ids:
                    start, keys = spans_of(rid, gi, g)
                    lists.append(keys)
                    spans.append((rid, start))
                sent = [k for ks in map(state_key_lists, lists) for k in ks] if g.state \
                    else lists
                calls.append((self.client.lookup_start(g.namespace, sent, True), gi, spans,
                              lists))
        except DaemonUnavailable as e:
            self._link.failed(e)
            self._orphans.extend(call for call, _, _, _ in calls)   # their leases get released
            return False
        self._calls, self._replies, self.fenced = calls, [None] * len(calls), fenced
        return True

    def collect(self) -> Collected | None:
        """The batch in flight once every namespace has answered (or one failed); None while
        not. Never waits."""
        self._collect_orphans()
        if not self._calls:
            return None
        calls, replies = self._calls, self._replies
        failed_at = -1
        try:
            for k, (call, _, _, _) in enumerate(calls):
                failed_at = k
                if replies[k] is None:
                    # A reply is handed out once: keep it until the whole batch is in.
                    replies[k] = call.result()
        except KvpoolError as e:
            if isinstance(e, DaemonUnavailable):
                self._link.failed(e)
            else:
                logger.warning("kvpool: lookup refused: %s", e)
            for k, (call, _, _, _) in enumerate(calls):
                if replies[k] is not None:
                    self._release.extend(x for x in replies[k].leases if x)
                elif k != failed_at:
                    self._orphans.append(call)   # may still answer, with leases to release
            self._calls, self._replies = [], []
            return Collected([rid for rid, _ in calls[0][2]], {}, {}, failed=True)
        if any(r is None for r in replies):
            return None
        self._link.succeeded()
        self._calls, self._replies = [], []
        per_req: dict[str, list[Answer]] = {}
        per_keys: dict[str, list[list[bytes]]] = {}
        for (call, gi, spans, lists), reply in zip(calls, replies):
            for (rid, _), keys in zip(spans, lists):
                per_keys.setdefault(rid, []).append(keys)
            if self.groups[gi].state:
                _state_answers(per_req, spans, lists, reply)
                continue
            for k, (rid, start) in enumerate(spans):
                per_req.setdefault(rid, []).append(
                    (start, reply.hits[k], reply.slots[k], [reply.leases[k]]))
        return Collected([rid for rid, _ in calls[0][2]], per_req, per_keys)

    def _collect_orphans(self) -> None:
        if not self._orphans:
            return
        still = []
        for call in self._orphans:
            try:
                reply = call.result()
            except KvpoolError:
                continue    # answered with an error (or never): it pinned nothing
            if reply is None:
                still.append(call)
            else:
                self._release.extend(x for x in reply.leases if x)
        self._orphans = still


def _state_answers(per_req: dict[str, list[Answer]], spans: list[tuple[str, int]],
                   lists: list[list[bytes]], reply: Any) -> None:
    """A state group's per-key replies (``hybrid.state_key_lists``), folded back into one
    answer per request."""
    at = 0
    for (rid, start), keys in zip(spans, lists):
        n = len(keys)
        refs, leases = merge_state_answer(reply.hits[at:at + n], reply.slots[at:at + n],
                                          reply.leases[at:at + n])
        at += n
        per_req.setdefault(rid, []).append((start, n, refs, leases))
