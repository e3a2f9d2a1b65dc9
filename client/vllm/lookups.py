"""Lookups: which leading blocks of a request the pool holds, asked in batches, never waited on.

A request's first ``get_num_new_matched_tokens`` queues a lookup of its prompt's block keys. The
lookups a step queues go out together at its end (``send``, from ``build_connector_meta``): one
call per namespace for every queued request, about ``LOOKUP_BLOCKS_PER_STEP`` blocks a step, at
most one batch in flight. Answers are taken in once at the start of the next step (``poll``);
until its answer is in, a request's lookup answers ``None`` ("ask again next step"). A hit pins
its slots with leases until it is loaded or given up (``consume``); leases nobody needs go to
``release``, sent without waiting at the next step.

vLLM asks about every waiting request it walks past, which can be long before it schedules
one: a burst of requests is looked up in its first step, and the later turns of a conversation
queued behind the earlier ones would carry that step's misses to their schedule, past the
stores that landed meanwhile. So an answer short of the request's prompt is dropped and asked
again when vLLM asks about it later and the pool may hold more by then (``_stale``): this engine
has since committed the first block the answer missed, or (for other engines' stores) the answer
is ``LOOKUP_STALE_S`` old. An answer taken in this step or the last is never stale, so a slow
step cannot keep a request asking forever; a full hit and a P/D hand-off's answers are kept.

Owns the queue, the batch in flight, answers nobody waits for any more (their leases get
released), combining per-group answers into one hit, and the leases to release. Talks to the
daemon only through ``SchedulerClient``'s non-blocking calls, behind ``DaemonLink``; a daemon
that is down or refuses turns into zero hits (``DaemonUnavailable`` is never raised to vLLM).
What a P/D consumer's answer means is asked of ``pd_stream.py``. Never waits.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.hybrid import (GroupAnswer, keep_resume_lease, merge_state_answer,
                                       resume_blocks, state_key_lists)
from kvpool.client.vllm.pd_stream import PdStream
from kvpool.client.vllm.requests import ReqState
from kvpool.shared.errors import DaemonUnavailable, KvpoolError

logger = logging.getLogger("kvpool.vllm")

# Lookups sent per step are bounded so that build_connector_meta does not stall vLLM's
# scheduler when hundreds of requests arrive at once: a step asks for about this many blocks,
# the other requests wait a step (a step cannot prefill more than max_num_batched_tokens
# anyway). A single request larger than the bound still goes whole. Stores are not bounded:
# a block not planned in the step it fills may never be stored if the engine stops right after.
LOOKUP_BLOCKS_PER_STEP = 512
# An answer short of the whole prompt, taken in two or more steps before, is asked again when
# vLLM asks about its request this long after it came (see the module's docstring): long next
# to a step (5-50 ms on a GPU), short next to a queue that outlasts the stores beside it.
LOOKUP_STALE_S = 0.25

# One group's answer for one request: (first block asked, hit, slots, leases). A state group's
# (hybrid.py) has a slot ref or MISSING per block asked, and a lease or 0 per block.
Answer = tuple[int, int, list[int], list[int]]


class Lookups:
    """Called from vLLM's scheduler thread only. ``committed`` is the tickets' per-group map
    of keys known to be in the pool (``tickets.py``): a lookup that misses one forgets it."""

    def __init__(self, groups: list[Any], block_tokens: int, client: Any, link: DaemonLink,
                 reqs: dict[str, ReqState], pd: PdStream,
                 committed: list[dict[bytes, None]]) -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self.client = client
        self._link = link
        self._reqs = reqs
        self._pd = pd
        self._committed = committed
        self._windowed = any(g.window_blocks is not None for g in groups)
        # Hybrid models: a hit is all groups or none (hybrid.resume_blocks).
        self._kinds = [g.kind for g in groups]
        self._stateful = "state" in self._kinds
        self.queued: list[str] = []       # request ids, in order (a few may be stale)
        self.retry: list[str] = []        # P/D consumers to look up again next step
        self.release: list[int] = []      # leases to release at the next step
        self._inflight_calls: list[tuple[Any, int, list[tuple[str, int]], list]] = []
        self._inflight_replies: list[Any] = []
        self._orphans: list[Any] = []     # lookups nobody waits for; their leases get released
        self._polled = -1                 # the step whose answers were last taken in

    def match(self, st: ReqState, num_computed_tokens: int, step: int) -> int | None:
        """Blocks from block 0 the pool offers ``st`` (also a P/D hand-off's blocks still to
        stream), 0 for none, or None until its lookup is answered. Queues the lookup the first
        time; takes in the daemon's answers once per step (``step``: build_connector_meta's
        count)."""
        if st.hit is not None and st.hit < st.target and self._stale(st, step):
            self.consume(st, keep_leases=False)
        if st.hit is None:
            if st.state == "idle":
                bt = self.block_tokens
                max_blocks = (st.request.num_tokens - 1) // bt
                if max_blocks <= num_computed_tokens // bt:
                    return 0            # the GPU already holds every block we could offer
                if not self._link.ok():
                    return 0
                st.state, st.target, st.rounds = "queued", max_blocks, 0
                self.queued.append(st.request.request_id)
            if self._polled != step:
                # Once per step: answers that came since the last step. The step's queued
                # lookups go out together at its end (send).
                self._polled = step
                self._link.pump()
                self.poll(step)
            if st.hit is None:
                return None
        return max(st.hit, st.stream_to)

    def _stale(self, st: ReqState, step: int) -> bool:
        """Whether a partial answer may have been overtaken by stores (see the docstring)."""
        if st.stream_end or st.expect_blocks or step - st.answered_step < 2:
            return False
        if time.monotonic() - st.answered_at > LOOKUP_STALE_S:
            return True
        req, hit = st.request, st.hit
        return any(g.window_blocks is None and committed
                   and st.keys.range(req, gi, hit, hit + 1)[0] in committed
                   for gi, (g, committed) in enumerate(zip(self.groups, self._committed)))

    def ask(self, st: ReqState) -> None:
        """Look ``st`` up in this step's batch (its target and stream are already set)."""
        st.state = "queued"
        self.queued.append(st.request.request_id)

    def consume(self, st: ReqState, keep_leases: bool) -> None:
        """The lookup result is used up; its leases go now unless a load holds them."""
        if not keep_leases:
            self.release.extend(st.leases)
            st.leases = []
        st.state, st.hit, st.slots, st.hit_start = "idle", None, [], []
        st.stream_to = 0

    def send(self) -> None:
        """The step's batch: P/D consumers asking again join the queue; it goes out unless
        a batch is still in flight."""
        if self.retry:
            self.queued.extend(self.retry)
            self.retry = []
        if self.queued and not self._inflight_calls:
            self._send_lookups()

    def send_releases(self) -> None:
        if self.release:
            leases, self.release = sorted(set(self.release)), []
            self._link.nowait(self.client.release_nowait, leases)

    def _window_start(self, g: Any, end: int) -> int:
        wb = g.window_blocks
        return 0 if wb is None else max(0, end - wb)

    def _send_lookups(self) -> None:
        """One lookup per namespace for every queued request (the step's batch)."""
        if not self.queued:
            return
        if not self._link.ok():
            self._resolve_miss([r for r in dict.fromkeys(self.queued)
                                if r in self._reqs and self._reqs[r].state == "queued"])
            self.queued.clear()
            return
        if not self._link.pumped:   # (this step's pump ran before: it asked ready())
            return                  # connecting: the queued requests ask again next step
        ids = self._take_queued()
        if not ids:
            return
        calls = []
        try:
            for gi, g in enumerate(self.groups):
                lists, spans = [], []
                for rid in ids:
                    st = self._reqs[rid]
                    if st.stream_end:       # the blocks of the hand-off still to come
                        start, end = st.stream_next, st.stream_end
                    elif g.state:           # a hit must end past the GPU's own
                        start, end = min(st.local_tokens // self.block_tokens, st.target), \
                            st.target
                    elif g.window_blocks is None:
                        start, end = 0, st.target
                    else:
                        start, end = self._window_start(g, st.target), st.target
                    lists.append(st.keys.range(st.request, gi, start, end))
                    spans.append((rid, start))
                sent = [k for ks in map(state_key_lists, lists) for k in ks] if g.state \
                    else lists
                calls.append((self.client.lookup_start(g.namespace, sent, True), gi, spans,
                              lists))
        except DaemonUnavailable as e:
            self._link.failed(e)
            self._orphans.extend(call for call, _, _, _ in calls)   # their leases get released
            self._resolve_miss(ids)
            return
        for rid in ids:
            self._reqs[rid].state = "sent"
        self._inflight_calls = calls
        self._inflight_replies = [None] * len(calls)

    def _take_queued(self) -> list[str]:
        """The queued requests this step's lookups ask for, about ``LOOKUP_BLOCKS_PER_STEP``
        blocks of them, in order; the rest stay queued for the next step. Costs the batch, not
        the queue: a burst of hundreds of requests waits there over several steps."""
        queued, reqs = self.queued, self._reqs
        ids: list[str] = []
        taken: set[str] = set()
        budget, i = LOOKUP_BLOCKS_PER_STEP, 0
        for i, rid in enumerate(queued):
            if budget <= 0:
                break
            st = reqs.get(rid)
            if st is None or st.state != "queued" or rid in taken:
                continue        # (gone, answered meanwhile, or queued twice)
            taken.add(rid)
            ids.append(rid)
            budget -= st.target
        else:
            i = len(queued)
        self.queued = queued[i:]
        return ids

    def _resolve_miss(self, ids: Iterable[str]) -> None:
        for rid in ids:
            st = self._reqs.get(rid)
            if st is None:
                continue
            if st.stream_end:
                # The daemon is gone or refused: the rest of the hand-off will not come.
                self._pd.end(st, report_missing=True)
                continue
            st.state, st.hit = "idle", 0
            st.slots, st.leases, st.hit_start = [], [], []

    def poll(self, step: int) -> None:
        """Collect the in-flight batch if every namespace has answered; never waits. ``step``:
        the build_connector_meta count of the step taking the answers in."""
        if self._orphans:
            still = []
            for call in self._orphans:
                try:
                    reply = call.result()
                except KvpoolError:
                    continue    # answered with an error (or never): it pinned nothing
                if reply is None:
                    still.append(call)
                else:
                    self.release.extend(x for x in reply.leases if x)
            self._orphans = still
        if not self._inflight_calls:
            return
        calls = self._inflight_calls
        replies = self._inflight_replies
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
                    self.release.extend(x for x in replies[k].leases if x)
                elif k != failed_at:
                    self._orphans.append(call)   # may still answer, with leases to release
            ids = [rid for rid, _ in calls[0][2]]
            self._inflight_calls, self._inflight_replies = [], []
            self._resolve_miss(ids)
            return
        if any(r is None for r in replies):
            return
        self._link.succeeded()
        self._inflight_calls, self._inflight_replies = [], []
        per_req: dict[str, list[Answer]] = {}
        for (call, gi, spans, lists), reply in zip(calls, replies):
            if self.groups[gi].state:
                self._state_answers(per_req, spans, lists, reply)
                continue
            known = self._committed[gi]
            for k, (rid, start) in enumerate(spans):
                hit = reply.hits[k]
                per_req.setdefault(rid, []).append(
                    (start, hit, reply.slots[k], [reply.leases[k]]))
                if known and hit < len(lists[k]):
                    # The first miss is news: a key we stored has been evicted since; it may
                    # be stored again.
                    known.pop(lists[k][hit], None)
        requeue = False
        for rid, answers in per_req.items():
            st = self._reqs.get(rid)
            leases = [lease for _, _, _, ls in answers for lease in ls if lease]
            if st is None or st.state != "sent" or st.finished:
                self.release.extend(leases)
                continue
            if st.stream_end:
                st.leases.extend(leases)        # held until the whole load is reported done
                st.state = "idle"
                if self._pd.answer(st, answers):
                    st.state = "queued"
                    self.retry.append(rid)
                continue
            hit = self._combine(st, answers)
            # (a window group may have made _combine shrink the target: the hand-off is the
            # whole prompt but its last token, whatever this round found)
            if st.expect_blocks and self._pd.keeps_waiting(st, hit):
                # Nothing landed yet (or a window group: wait for all of it).
                self.release.extend(leases)
                full = (st.request.num_tokens - 1) // self.block_tokens
                st.state, st.target, st.rounds = "queued", full, 0
                self.retry.append(rid)
                continue
            if hit is None:                 # a window elsewhere: ask again for that target
                self.release.extend(leases)
                st.state = "queued"
                self.queued.append(rid)
                requeue = True
                continue
            st.state = "idle"
            st.hit = hit
            st.answered_at, st.answered_step = time.monotonic(), step
            if self._stateful:
                leases = self._resume_leases(answers, hit)
            st.leases = leases
            st.hit_start = [start for start, _, _, _ in answers]
            st.slots = [slots for _, _, slots, _ in answers]
            if hit == 0:
                self.release.extend(leases)
                st.leases = []
        if requeue:
            self._send_lookups()

    def _combine(self, st: ReqState, answers: list[Answer]) -> int | None:
        """The hit in blocks from per-group answers, or None to look up a shorter target.

        A model with one kind of group: the shortest run. Otherwise all groups or none
        (``hybrid.resume_blocks``): full-attention groups need every block from 0, a
        sliding-window group the window ending at the hit, a state group the state at its end.
        Windows were asked for ending at ``target``: when the others allow less, one more round
        asks for the window there.
        """
        if not self._windowed and not self._stateful:
            return min(a[1] for a in answers)
        got = resume_blocks(self._kinds, [g.window_blocks for g in self.groups],
                            [GroupAnswer(start, st.target, slots)
                             for start, _, slots, _ in answers],
                            st.target, retried=st.rounds > 0)
        if got.ask_again_at:
            st.target, st.rounds = got.ask_again_at, st.rounds + 1
            return None
        return got.blocks

    def _state_answers(self, per_req: dict[str, list[Answer]], spans: list[tuple[str, int]],
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

    def _resume_leases(self, answers: list[Answer], hit: int) -> list[int]:
        """The leases a load at ``hit`` needs (every run's; of a state group, its state at the
        hit's end): the other states found are released now."""
        keep = []
        for g, (start, _, _, leases) in zip(self.groups, answers):
            if not g.state:
                keep.extend(x for x in leases if x)
                continue
            lease, spare = keep_resume_lease(start, leases, hit)
            self.release.extend(spare)
            if lease:
                keep.append(lease)
        return keep
