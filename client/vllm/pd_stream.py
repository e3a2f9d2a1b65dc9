"""P/D consumers: waiting for a prefill's hand-off and loading it chunk by chunk as it lands.

A decode request told how many blocks the prefill hands over (``kvpool_tokens`` in its
``kv_transfer_params``, set by ``SchedulerRole._handoff_params`` on the prefill side) takes all
of them from vLLM as soon as its first lookup finds one, loads what is committed, and then is
looked up again once per step for the rest, loading each chunk as the prefill's stores commit
it (``LoadSpec.final`` tells the workers when the last chunk went out). A hand-off that stops
making progress for ``pd_wait_s`` (or a daemon that goes away) ends the stream: the blocks that
never came are reported as load errors and vLLM recomputes from the first of them.

Owns the streams in progress and the decisions above; ``lookups.py`` sends the lookups and asks
here what an answer means, and the step's load specs go to the list the scheduler hands over in
its metadata. Never calls the daemon and never waits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import LoadSpec

logger = logging.getLogger("kvpool.vllm")


class PdStream:
    """Called from vLLM's scheduler thread only, by the scheduler's other parts."""

    def __init__(self, groups: list[Any], block_tokens: int, reqs: dict[str, ReqState],
                 step_loads: list[LoadSpec], pd_wait_s: float = 3.0,
                 pd_stream: bool = True) -> None:
        self._groups = groups
        self.block_tokens = block_tokens
        self.pd_wait_s = pd_wait_s
        self._reqs = reqs
        self._step_loads = step_loads
        self.streams: set[str] = set()   # P/D consumers loading chunks as they land
        # Streaming needs every group to hold blocks [0, n) of the prompt: a sliding-window
        # group looks up (and keeps) only the window ending at the hit, which moves as chunks
        # land, and a state group only the state at the hit's end. Models with either wait for
        # the whole hand-off and load it at once instead.
        # A stalled stream reports its missing blocks as load errors, which vLLM's "fail"
        # load-failure policy turns into a failed request: pd_stream=False keeps the wait.
        self.can_stream = pd_stream and all(g.kind == "full" for g in groups)

    def keeps_waiting(self, st: ReqState, hit: int | None) -> bool:
        """A consumer's lookup answered ``hit`` (None: ask again for another target): True if
        it should drop the answer and look up again next step, because its hand-off has not
        landed yet (or has a window group: it waits for all of it). When part of it landed
        and it can stream, it takes the whole hand-off now (``stream_to``)."""
        full = (st.request.num_tokens - 1) // self.block_tokens
        want = min(st.expect_blocks, full) if st.expect_blocks else 0
        if want and (hit is None or hit < want) and time.monotonic() < st.wait_until:
            if hit and self.can_stream:
                # The producer's stores are landing: take the whole hand-off now, load what
                # is here, and the rest chunk by chunk as it commits.
                st.stream_to = want
                st.wait_until = time.monotonic() + self.pd_wait_s
                return False
            return True
        return False

    def start(self, st: ReqState, table: Any, first: int, end: int,
              loads: list[LoadSpec]) -> None:
        """vLLM allocated blocks [0, ``end``) for a hand-off whose blocks from ``first`` on are
        not in the pool yet: ``loads`` (this step's, already queued) are its first chunk; the
        caller queues its next lookup."""
        for spec in loads:
            spec.final = False
        st.stream_ids = [list(table[g.index][:end]) for g in self._groups]
        st.stream_next, st.stream_end = first, end
        for ids in st.stream_ids:
            st.load_blocks.extend(ids[first:end])
        self.streams.add(st.request.request_id)
        # vLLM may have taken a while to find room for it: the wait starts now.
        st.wait_until = time.monotonic() + self.pd_wait_s

    def answer(self, st: ReqState, answers: list[tuple[int, int, list[int], list[int]]]
               ) -> bool:
        """Load what has committed since the last round; True if the rest is still to come
        (look it up again next step)."""
        rid = st.request.request_id
        new = min(n for _, n, _, _ in answers)
        if new:
            a, b = st.stream_next, st.stream_next + new
            last = b >= st.stream_end
            for gi, (_, _, slots, _) in enumerate(answers):
                self._step_loads.append(LoadSpec(rid, gi, slots[:new], st.stream_ids[gi][a:b],
                                                 final=last))
            st.stream_next = b
            st.wait_until = time.monotonic() + self.pd_wait_s
            if last:
                self.streams.discard(rid)
                st.stream_end, st.stream_ids = 0, []
                return False
        return True

    def end(self, st: ReqState, report_missing: bool) -> None:
        """No more chunks: the workers report the request once its loads in flight are done.
        Blocks that never came are load errors (vLLM recomputes from the first of them)
        unless the request is gone anyway."""
        rid = st.request.request_id
        self.streams.discard(rid)
        st.state = "idle"               # a lookup still in flight gets its leases released
        a, b = st.stream_next, st.stream_end
        if report_missing and a < b:
            logger.warning("kvpool: request %s: blocks %d..%d of its P/D hand-off did not "
                           "arrive; recomputing them", rid, a, b - 1)
            for gi, ids in enumerate(st.stream_ids):
                self._step_loads.append(LoadSpec(rid, gi, [], ids[a:b], failed=True))
        else:
            self._step_loads.append(LoadSpec(rid, 0, [], []))
        st.stream_end, st.stream_ids = 0, []

    def expire(self) -> None:
        """End the streams that made no progress for ``pd_wait_s`` (once per step)."""
        now = time.monotonic()
        for st in [self._reqs[r] for r in self.streams]:
            if now >= st.wait_until:
                self.end(st, report_missing=True)
