"""Lookups: which leading blocks of a request the pool holds, asked in batches, never waited on.

What the rest of the scheduler side sees (the interface to keep when the internals change):
``offer`` (blocks from block 0 the pool offers a request, None for "ask again next step"),
``accept`` (vLLM allocated blocks for the offer: the ``Hit`` to load, its pins kept until
``loaded``), ``decline`` (vLLM took none of it), ``follow`` (look up the rest of a P/D
hand-off each step, for ``pd_stream.py``), ``loaded`` (the load was reported; a failed one is
never offered again), ``begin_step``/``end_step`` around a step's other work, ``forget``.

Inside: a request's first ``offer`` reads the daemon's shared-memory index (``index_reads``)
and answers in the same call, pinning nothing (the load names each block's key: one evicted
meanwhile fails alone and is recomputed). Where the index cannot answer (none mapped, a key
this engine committed that the daemon may not have taken in yet, a reset just sent), the
lookup is queued: a step's queued lookups go out at its end (``end_step``), one call per
namespace, about ``LOOKUP_BLOCKS_PER_STEP`` blocks a step, one batch in flight, answered at
the next step's start (``begin_step``; the offer is None until then), their hits pinned with
leases until loaded or declined (released without waiting at the next step).

vLLM asks about every waiting request it walks past, which can be long before it schedules
one: a burst of requests is looked up in its first step, and the later turns of a conversation
queued behind the earlier ones would carry that step's misses to their schedule, past the
stores that landed meanwhile. So an answer short of the request's prompt is dropped and asked
again when vLLM asks about it later and the pool may hold more by then (``_stale``): this
engine has since committed the first block the answer missed, or (for other engines' stores)
the answer is ``Budgets.lookup_stale_s`` old. An answer taken in this step or the last is never
stale, so a slow step cannot keep a request asking forever; a full hit and a P/D hand-off's
answers are kept.

Owns each request's lookup (``_Ask``: its state, answer, pins, what was offered), the queue,
combining per-group answers into one hit, and the leases to release; the batch in flight and
answers nobody waits for any more are ``round_trips.py``'s. Talks to the daemon only through
``SchedulerClient``'s non-blocking calls, behind ``DaemonLink``; a daemon that is down or
refuses turns into zero hits (``DaemonUnavailable`` is never raised to vLLM). What a P/D
consumer's answer means is asked of ``pd_stream.py``. Never waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, NamedTuple, Sequence

from kvpool.client.vllm.budgets import Budgets
from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.hybrid import MISSING, GroupAnswer, keep_resume_lease, resume_blocks
from kvpool.client.vllm.index_reads import IndexReads, behind_commits
from kvpool.client.vllm.pd_stream import Answer, PdStream
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.round_trips import RoundTrips
from kvpool.client.vllm.store_batches import CommittedKeys

# Lookups sent per step are bounded so that build_connector_meta does not stall vLLM's
# scheduler when hundreds of requests arrive at once: a step asks for about this many blocks,
# the other requests wait a step (a step cannot prefill more than max_num_batched_tokens
# anyway). A single request larger than the bound still goes whole. Stores are not bounded:
# a block not planned in the step it fills may never be stored if the engine stops right after.
LOOKUP_BLOCKS_PER_STEP = 512

# _Ask.state: no lookup wanted, queued for the step's batch, in the batch in flight.
IDLE, QUEUED, SENT = "idle", "queued", "sent"


class Hit(NamedTuple):
    """What vLLM accepted of an offer, for ``loads.py`` to load."""

    blocks: int                # leading blocks the pool holds (the answer)
    offered: int               # blocks offered to vLLM (a streaming hand-off: all of it)
    local_tokens: int          # vLLM's own prefix hit when it was offered
    starts: list[int]          # per group: block index of slots[g][0]
    slots: list[list[int]]     # per group: slot refs of the hit run
    # per group: block keys from starts[g] (keys[g][k]: slots[g][k]'s); () when not known
    keys: Sequence[Sequence[bytes]] = ()


@dataclass(eq=False, slots=True)
class _Ask:
    """One request's lookup: IDLE -> QUEUED -> SENT -> answered (``hit`` is not None)."""

    st: ReqState
    state: str = IDLE
    target: int = 0            # block count the lookup asked for (the hit cannot exceed it)
    rounds: int = 0
    hit: int | None = None     # blocks available from the pool, from block 0
    answered_at: float = 0.0   # when the hit came: clock time and the step that took it in
    answered_step: int = 0     # (for _stale)
    starts: list[int] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)
    keys: list[list[bytes]] = field(default_factory=list)   # per group: the keys asked
    leases: list[int] = field(default_factory=list)   # the answer's pins
    held: list[int] = field(default_factory=list)     # pins kept for the load in flight
    local_tokens: int = 0      # GPU prefix hit seen by the last offer
    stream_to: int = 0         # offered to vLLM beyond the hit (a P/D hand-off streaming)
    streaming: bool = False    # queued or sent for the rest of a hand-off
    refused: bool = False      # a load of its hit failed: never offered again


class Lookups:
    """Called from vLLM's scheduler thread only. ``committed`` holds the keys this engine's
    stores committed (``store_batches.py``): a lookup that misses one forgets it."""

    def __init__(self, groups: list[Any], block_tokens: int, client: Any, link: DaemonLink,
                 pd: PdStream, committed: CommittedKeys, budgets: Budgets) -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self.client = client
        self._link = link
        self._pd = pd
        self._committed = committed
        self._clock = budgets.clock
        self._stale_s = budgets.lookup_stale_s
        self._windowed = any(g.window_blocks is not None for g in groups)
        self._asks: dict[str, _Ask] = {}
        # Hybrid models: a hit is all groups or none (hybrid.resume_blocks).
        self._kinds = [g.kind for g in groups]
        self._stateful = "state" in self._kinds
        self.queued: list[str] = []       # request ids, in order (a few may be stale)
        self.retry: list[str] = []        # P/D consumers to look up again next step
        self.release: list[int] = []      # leases to release at the next step
        self._trips = RoundTrips(groups, client, link)
        self._polled = -1                 # the step whose answers were last taken in
        self._index = IndexReads(groups, client, link)
        # A reset was sent: the index may show what the daemon has yet to forget, so lookups
        # go by round trip (ordered after the reset) until one sent since has been answered.
        self._fenced = False

    # ---- what the other parts call --------------------------------------------------------

    def offer(self, st: ReqState, num_computed_tokens: int, step: int) -> int | None:
        """Blocks from block 0 the pool offers ``st`` (also a P/D hand-off's blocks still to
        stream), 0 for none, or None until its lookup is answered. ``num_computed_tokens``:
        vLLM's own prefix hit. Queues the lookup the first time; takes in the daemon's answers
        once per step (``step``: build_connector_meta's count)."""
        rid = st.request.request_id
        a = self._asks.get(rid)
        if a is None:
            a = self._asks[rid] = _Ask(st)
        if a.refused:
            return 0
        a.local_tokens = num_computed_tokens
        if a.hit is not None and a.hit < a.target and self._stale(a, step):
            self._reset(a, keep_leases=False)
        if a.hit is None:
            if a.state == IDLE:
                bt = self.block_tokens
                max_blocks = (st.request.num_tokens - 1) // bt
                if max_blocks <= num_computed_tokens // bt:
                    return 0            # the GPU already holds every block we could offer
                if not self._link.ok():
                    return 0
                a.target, a.rounds = max_blocks, 0
                if self._find(a, step):     # answered now (None: a hand-off not landed)
                    return None if a.hit is None else max(a.hit, a.stream_to)
                if not self._fenced and self._index.pending():
                    # Reconnecting (a daemon restart): the index answers in a step or two,
                    # where the daemon's own lookup would bring lower-tier hits up into the
                    # pool only as far as it has room, and cut the rest.
                    return None
                a.state = QUEUED
                self.queued.append(rid)
            if self._polled != step:
                # Once per step: answers that came since the last step. The step's queued
                # lookups go out together at its end (end_step).
                self._polled = step
                self._link.pump()
                self.begin_step(step)
            if a.hit is None:
                return None
        return max(a.hit, a.stream_to)

    def accept(self, st: ReqState) -> Hit | None:
        """vLLM allocated blocks for ``st``'s offer: the hit to load (None if there is no
        answer); its pins are kept until ``loaded``."""
        a = self._asks.get(st.request.request_id)
        if a is None or a.hit is None:
            return None
        hit = Hit(a.hit, max(a.hit, a.stream_to), a.local_tokens, a.starts, a.slots, a.keys)
        self._reset(a, keep_leases=True)
        return hit

    def decline(self, st: ReqState) -> int:
        """``st``'s answer is not loaded (vLLM took none of it, preempted the request, or it
        finished): its pins go. Returns the blocks the answer held (0 if none)."""
        a = self._asks.get(st.request.request_id)
        if a is None:
            return 0
        blocks = a.hit or 0
        self._reset(a, keep_leases=False)
        return blocks

    def follow(self, st: ReqState) -> None:
        """Look up the rest of ``st``'s hand-off (``PdStream.span``) in this step's batch, and
        again each step while ``PdStream.answer`` says more is to come."""
        a = self._asks[st.request.request_id]
        a.state, a.streaming = QUEUED, True
        self.queued.append(st.request.request_id)

    def loaded(self, rid: str, failed: bool) -> None:
        """``rid``'s load was reported: the pins it held go; a failed one is never offered
        again (vLLM recomputes it, and its blocks are stored again)."""
        a = self._asks.get(rid)
        if a is None:
            return
        self.release.extend(a.held)
        a.held, a.hit = [], None
        if failed:
            a.refused = True

    def begin_step(self, step: int) -> None:
        """Take in the answers that came (``step``: the build_connector_meta count)."""
        self.poll(step)

    def end_step(self) -> None:
        """The step's messages: leases to release, the step's batch of lookups (the rest of
        the hand-offs streaming, read from the index when it can be), the hits read."""
        self.send_releases()
        self.send()
        self._index.flush()

    def fence(self) -> None:
        """A reset of our namespaces was just sent (see ``_fenced``)."""
        self._fenced = True

    def has_work(self) -> bool:
        """Leases to release or hand-offs to ask about again: the engine must step again."""
        return bool(self.release or self.retry or self._trips.has_stray)

    def forget(self, rid: str) -> None:
        a = self._asks.pop(rid, None)
        if a is not None:
            self.release.extend(a.leases)
            self.release.extend(a.held)

    def tracked(self) -> Collection[str]:
        return self._asks.keys()

    # ---- inside -----------------------------------------------------------------------------

    def _reset(self, a: _Ask, keep_leases: bool) -> None:
        """The answer is used up; its leases go now unless a load holds them."""
        (a.held if keep_leases else self.release).extend(a.leases)
        a.leases = []
        a.state, a.hit, a.slots, a.starts, a.keys = IDLE, None, [], [], []
        a.stream_to = 0

    def _wanted(self, a: _Ask) -> bool:
        """False for an ask of the rest of a hand-off whose stream ended meanwhile (stalled,
        or its request finished): it goes back to IDLE and its answer is let go."""
        if a.streaming and self._pd.span(a.st.request.request_id) is None:
            a.state, a.streaming = IDLE, False
            return False
        return True

    def _stale(self, a: _Ask, step: int) -> bool:
        """Whether a partial answer may have been overtaken by stores (see the docstring)."""
        st = a.st
        if self._pd.expects(st.request.request_id) or step - a.answered_step < 2:
            return False
        if self._clock() - a.answered_at > self._stale_s:
            return True
        req, hit = st.request, a.hit
        return any(g.window_blocks is None and committed
                   and st.keys.range(req, gi, hit, hit + 1)[0] in committed
                   for gi, (g, committed) in enumerate(zip(self.groups, self._committed)))

    def send(self) -> None:
        """The step's batch: P/D consumers asking again join the queue; it goes out unless
        a batch is still in flight."""
        if self.retry:
            self.queued.extend(self.retry)
            self.retry = []
        if self.queued and self._link.ok() and not self._fenced:
            self._find_streams()
        if self.queued and not self._trips.in_flight:
            self._send_lookups()

    def send_releases(self) -> None:
        if self.release or self._trips.has_stray:
            leases = sorted(set(self.release + self._trips.take_stray()))
            self.release.clear()
            self._link.nowait(self.client.release_nowait, leases)

    def _range(self, a: _Ask, g: Any) -> tuple[int, int]:
        """The blocks [start, end) of group ``g`` that ``a``'s lookup asks about."""
        rest = self._pd.span(a.st.request.request_id) if a.streaming else None
        if rest is not None:        # the blocks of the hand-off still to come
            return rest
        if g.state:                 # a hit must end past the GPU's own
            return min(a.local_tokens // self.block_tokens, a.target), a.target
        wb = g.window_blocks
        return (0 if wb is None else max(0, a.target - wb)), a.target

    def _ranges(self, a: _Ask) -> tuple[list[int], list[list[bytes]]]:
        """Per group: the first block ``a``'s lookup asks about, and the keys it asks for."""
        starts, lists = [], []
        st = a.st
        for gi, g in enumerate(self.groups):
            start, end = self._range(a, g)
            starts.append(start)
            lists.append(st.keys.range(st.request, gi, start, end))
        return starts, lists

    def _find(self, a: _Ask, step: int) -> bool:
        """Answer ``a`` from the shared-memory index now: False if there is none (ask the
        daemon). Else its hit is set, or left None while its P/D hand-off has not landed (the
        next offer reads the index again)."""
        if self._fenced or not self._link.ok():
            return False
        while True:
            starts, lists = self._ranges(a)
            answers = self._index.answers(starts, lists)
            if answers is None or behind_commits(self.groups, self._committed, answers,
                                                 lists):
                return False
            hit = self._combine(a, answers)     # None: a window, asked again at a.target
            if hit is not None:
                break
        self._note_misses(answers, lists)
        st = a.st
        stream_to = self._pd.admit(st, hit) if self._pd.expects(st.request.request_id) else 0
        if stream_to is not None:
            self._answered(a, step, hit, answers, lists, stream_to)
        return True

    def _find_streams(self) -> None:
        """The queued asks for the rest of a hand-off, answered from the index (those it
        cannot answer stay queued for the daemon)."""
        asks, left = self._asks, []
        for rid in self.queued:
            a = asks.get(rid)
            if a is None or a.state != QUEUED or not a.streaming or not self._wanted(a):
                left.append(rid)
                continue
            starts, lists = self._ranges(a)
            answers = self._index.answers(starts, lists)
            if answers is None:
                left.append(rid)
                continue
            self._streamed(a, answers, lists)
        self.queued = left

    def _streamed(self, a: _Ask, answers: list[Answer], lists: list[list[bytes]]) -> None:
        """Load the chunks of ``a``'s hand-off that landed; ask again next step for the rest."""
        a.state = IDLE
        if self._pd.answer(a.st.request.request_id, answers, lists):
            a.state = QUEUED
            self.retry.append(a.st.request.request_id)
        else:
            a.streaming = False

    def _note_misses(self, answers: list[Answer], lists: list[list[bytes]]) -> None:
        """A key we stored that an answer missed has been evicted since: it may be stored
        again."""
        for gi, (_, hit, refs, _) in enumerate(answers):
            if not self._committed[gi]:
                continue
            if self.groups[gi].state:
                for k, r in zip(lists[gi], refs):
                    if r == MISSING:
                        self._committed.forget(gi, k)
            elif hit < len(lists[gi]):
                self._committed.forget(gi, lists[gi][hit])

    def _answered(self, a: _Ask, step: int, hit: int, answers: list[Answer],
                  lists: list[list[bytes]], stream_to: int) -> None:
        """``a``'s answer is in: ``hit`` blocks, per group ``answers`` to the ``lists`` of keys
        asked; its leases are kept for the load (those a load at ``hit`` does not use go)."""
        leases = [lease for _, _, _, ls in answers for lease in ls if lease]
        a.state = IDLE
        a.hit = hit
        a.answered_at, a.answered_step = self._clock(), step
        if self._stateful:
            leases, spare = resume_leases(self.groups, answers, hit)
            self.release.extend(spare)
        a.leases = leases
        a.starts = [start for start, _, _, _ in answers]
        a.slots = [slots for _, _, slots, _ in answers]
        a.keys = lists
        a.stream_to = stream_to
        if hit == 0:
            self.release.extend(leases)
            a.leases = []

    def _send_lookups(self) -> None:
        """One lookup per namespace for every queued request (the step's batch)."""
        if not self.queued:
            return
        if not self._link.ok():
            asks = self._asks
            self._resolve_miss([r for r in dict.fromkeys(self.queued)
                                if r in asks and asks[r].state == QUEUED])
            self.queued.clear()
            return
        if not self._link.pumped:   # (this step's pump ran before: it asked ready())
            return                  # connecting: the queued requests ask again next step
        ids, self.queued = take_batch(self.queued, self._asks, self._wanted)
        if not ids:
            return

        def span(rid: str, gi: int, g: Any) -> tuple[int, list[bytes]]:
            a = self._asks[rid]
            start, end = self._range(a, g)
            return start, a.st.keys.range(a.st.request, gi, start, end)
        if not self._trips.send(ids, span, self._fenced):
            self._resolve_miss(ids)
            return
        for rid in ids:
            self._asks[rid].state = SENT

    def _resolve_miss(self, ids: Iterable[str]) -> None:
        for rid in ids:
            a = self._asks.get(rid)
            if a is None:
                continue
            if a.streaming:
                if self._pd.span(rid) is not None:
                    # The daemon is gone or refused: the rest of the hand-off will not come.
                    self._pd.end(rid, report_missing=True)
                a.state, a.streaming = IDLE, False
                continue
            a.state, a.hit = IDLE, 0
            a.slots, a.leases, a.starts = [], [], []

    def poll(self, step: int) -> None:
        """Collect the in-flight batch if every namespace has answered; never waits. ``step``:
        the build_connector_meta count of the step taking the answers in."""
        got = self._trips.collect()
        if got is None:
            return
        if got.failed:
            self._resolve_miss(got.ids)
            return
        if self._trips.fenced:
            self._fenced = self._trips.fenced = False    # the daemon has done the reset
        per_req, per_keys = got.per_req, got.per_keys
        requeue = False
        for rid, answers in per_req.items():
            a = self._asks.get(rid)
            leases = [lease for _, _, _, ls in answers for lease in ls if lease]
            if a is None or a.state != SENT or a.st.finished or not self._wanted(a):
                self.release.extend(leases)
                continue
            st = a.st
            lists = per_keys[rid]
            self._note_misses(answers, lists)
            if a.streaming:
                a.held.extend(leases)           # held until the whole load is reported done
                self._streamed(a, answers, lists)
                continue
            hit = self._combine(a, answers)
            # (a window group may have made _combine shrink the target: the hand-off is the
            # whole prompt but its last token, whatever this round found)
            stream_to = self._pd.admit(st, hit) if self._pd.expects(rid) else 0
            if stream_to is None:
                # Nothing landed yet (or a window group: wait for all of it).
                self.release.extend(leases)
                full = (st.request.num_tokens - 1) // self.block_tokens
                a.state, a.target, a.rounds = QUEUED, full, 0
                self.retry.append(rid)
                continue
            if hit is None:                 # a window elsewhere: ask again for that target
                self.release.extend(leases)
                a.state = QUEUED
                self.queued.append(rid)
                requeue = True
                continue
            self._answered(a, step, hit, answers, lists, stream_to)
        if requeue:
            self._send_lookups()

    def _combine(self, a: _Ask, answers: list[Answer]) -> int | None:
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
                            [GroupAnswer(start, a.target, slots)
                             for start, _, slots, _ in answers],
                            a.target, retried=a.rounds > 0)
        if got.ask_again_at:
            a.target, a.rounds = got.ask_again_at, a.rounds + 1
            return None
        return got.blocks


def take_batch(queued: list[str], asks: dict[str, _Ask], wanted: Any
               ) -> tuple[list[str], list[str]]:
    """The queued requests a step's lookups ask for, about ``LOOKUP_BLOCKS_PER_STEP`` blocks of
    them, in order, and the rest (asked for at the next step). Costs the batch, not the queue:
    a burst of hundreds of requests waits there over several steps."""
    ids: list[str] = []
    taken: set[str] = set()
    budget, i = LOOKUP_BLOCKS_PER_STEP, 0
    for i, rid in enumerate(queued):
        if budget <= 0:
            break
        a = asks.get(rid)
        if a is None or a.state != QUEUED or rid in taken or not wanted(a):
            continue        # (gone, answered meanwhile, queued twice, or a stream ended)
        taken.add(rid)
        ids.append(rid)
        budget -= a.target
    else:
        i = len(queued)
    return ids, queued[i:]


def resume_leases(groups: list[Any], answers: list[Answer], hit: int
                  ) -> tuple[list[int], list[int]]:
    """The leases a load at ``hit`` needs (every run's; of a state group, its state at the
    hit's end), and the other states' (to release now)."""
    keep, spare = [], []
    for g, (start, _, _, leases) in zip(groups, answers):
        if not g.state:
            keep.extend(x for x in leases if x)
            continue
        lease, rest = keep_resume_lease(start, leases, hit)
        spare.extend(rest)
        if lease:
            keep.append(lease)
    return keep, spare
