"""P/D consumers: waiting for a prefill's hand-off and loading it chunk by chunk as it lands.

A decode request told how many blocks the prefill hands over (``kvpool_tokens`` in its
``kv_transfer_params``, set by ``SchedulerRole._handoff_params`` on the prefill side) takes all
of them from vLLM as soon as its first lookup finds one, loads what is committed, and then is
looked up again once per step for the rest, loading each chunk as the prefill's stores commit
it (``LoadSpec.final`` tells the workers when the last chunk went out). A hand-off that stops
making progress for ``Budgets.pd_wait_s`` (or a daemon that goes away) ends the stream: the
blocks that never came are reported as load errors and vLLM recomputes from the first of them.

Owns each consumer's hand-off (how many blocks, until when it waits, which of its blocks are
still to come and their GPU block ids) and the decisions above; ``lookups.py`` looks the rest
up and asks here what an answer means. The load specs it makes wait in its own list until the
step's metadata takes them (``take_specs``). Never calls the daemon and never waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Collection

from kvpool.client.vllm.budgets import Budgets
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import LoadSpec

logger = logging.getLogger("kvpool.vllm")

# One group's answer for one request: (first block asked, hit, slot refs, lease).
Answer = tuple[int, int, list[int], list[int]]


@dataclass(eq=False, slots=True)
class _HandOff:
    st: ReqState
    expect_blocks: int         # blocks the prefill hands over
    wait_until: float          # a hand-off making no progress until then is given up on
    next: int = 0              # blocks [next, end) are allocated, not yet in the pool
    end: int = 0               # 0: not streaming
    ids: list[list[int]] = field(default_factory=list)   # per group: GPU block ids


class PdStream:
    """Called from vLLM's scheduler thread only, by the scheduler's other parts."""

    def __init__(self, groups: list[Any], block_tokens: int, budgets: Budgets,
                 pd_stream: bool = True) -> None:
        self._groups = groups
        self.block_tokens = block_tokens
        self.pd_wait_s = budgets.pd_wait_s
        self._clock = budgets.clock
        self._handoffs: dict[str, _HandOff] = {}
        self.streams: set[str] = set()   # P/D consumers loading chunks as they land
        self._specs: list[LoadSpec] = []
        # Streaming needs every group to hold blocks [0, n) of the prompt: a sliding-window
        # group looks up (and keeps) only the window ending at the hit, which moves as chunks
        # land, and a state group only the state at the hit's end. Models with either wait for
        # the whole hand-off and load it at once instead.
        # A stalled stream reports its missing blocks as load errors, which vLLM's "fail"
        # load-failure policy turns into a failed request: pd_stream=False keeps the wait.
        self.can_stream = pd_stream and all(g.kind == "full" for g in groups)

    def expect(self, st: ReqState, blocks: int) -> None:
        """``st`` is the decode side of a hand-off of ``blocks`` blocks; it waits for them
        (``pd_wait_s`` from now at most without progress)."""
        self._handoffs[st.rid] = _HandOff(st, blocks, self._clock() + self.pd_wait_s)

    def expects(self, rid: str) -> bool:
        """``rid`` waits for a hand-off (its lookup answers say how much has landed)."""
        return rid in self._handoffs

    def span(self, rid: str) -> tuple[int, int] | None:
        """Blocks of ``rid``'s hand-off still to come while it streams, else None."""
        h = self._handoffs.get(rid)
        return (h.next, h.end) if h is not None and h.end else None

    def admit(self, st: ReqState, hit: int | None) -> int | None:
        """A consumer's lookup answered ``hit`` (None: ask again for another target). None if
        it should drop the answer and look up again next step, because its hand-off has not
        landed yet (or has a window group: it waits for all of it); else the blocks to offer
        vLLM beyond the hit: the whole hand-off when part of it landed and it can stream, 0
        otherwise."""
        h = self._handoffs[st.rid]
        full = (st.request.num_tokens - 1) // self.block_tokens
        want = min(h.expect_blocks, full) if h.expect_blocks else 0
        if want and (hit is None or hit < want) and self._clock() < h.wait_until:
            if hit and self.can_stream:
                # The producer's stores are landing: take the whole hand-off now, load what
                # is here, and the rest chunk by chunk as it commits.
                h.wait_until = self._clock() + self.pd_wait_s
                return want
            return None
        return 0

    def start(self, st: ReqState, table: Any, first: int, end: int) -> None:
        """vLLM allocated blocks [0, ``end``) for a hand-off whose blocks from ``first`` on are
        not in the pool yet (the load's first specs went out non-final); the caller has its
        next lookup asked."""
        h = self._handoffs[st.rid]
        h.ids = [list(table[g.index][:end]) for g in self._groups]
        h.next, h.end = first, end
        self.streams.add(st.rid)
        # vLLM may have taken a while to find room for it: the wait starts now.
        h.wait_until = self._clock() + self.pd_wait_s

    def answer(self, rid: str, answers: list[Answer], keys: list[list[bytes]]) -> bool:
        """Load what has committed since the last round (``keys``: per group, the keys the
        answers are for); True if the rest is still to come (look it up again next step)."""
        h = self._handoffs[rid]
        new = min(n for _, n, _, _ in answers)
        if new:
            a, b = h.next, h.next + new
            last = b >= h.end
            for gi, (_, _, slots, _) in enumerate(answers):
                self._specs.append(LoadSpec(rid, gi, slots[:new], h.ids[gi][a:b], final=last,
                                            keys=list(keys[gi][:new])))
            h.next = b
            h.wait_until = self._clock() + self.pd_wait_s
            if last:
                self.streams.discard(rid)
                h.end, h.ids = 0, []
                return False
        return True

    def end(self, rid: str, report_missing: bool) -> None:
        """No more chunks: the workers report the request once its loads in flight are done.
        Blocks that never came are load errors (vLLM recomputes from the first of them)
        unless the request is gone anyway. A lookup of the rest still in flight finds the
        stream ended and lets its answer go."""
        h = self._handoffs[rid]
        self.streams.discard(rid)
        a, b = h.next, h.end
        if report_missing and a < b:
            logger.warning("kvpool: request %s: blocks %d..%d of its P/D hand-off did not "
                           "arrive; recomputing them", rid, a, b - 1)
            for gi, ids in enumerate(h.ids):
                self._specs.append(LoadSpec(rid, gi, [], ids[a:b], failed=True))
        else:
            self._specs.append(LoadSpec(rid, 0, [], []))
        h.end, h.ids = 0, []

    def expire(self) -> None:
        """End the streams that made no progress for ``pd_wait_s`` (once per step)."""
        now = self._clock()
        for rid in [r for r in self.streams if now >= self._handoffs[r].wait_until]:
            self.end(rid, report_missing=True)

    def take_specs(self) -> list[LoadSpec]:
        """The load specs made since the last call (chunks that landed, ended streams)."""
        out, self._specs = self._specs, []
        return out

    @property
    def has_specs(self) -> bool:
        return bool(self._specs)

    def forget(self, rid: str) -> None:
        self._handoffs.pop(rid, None)
        self.streams.discard(rid)

    def tracked(self) -> Collection[str]:
        return self._handoffs.keys()
