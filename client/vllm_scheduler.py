"""The connector's scheduler role: decides what to load and store, never moves bytes.

Runs inside vLLM's scheduler (engine core) process, on its one thread. Owns per-request state
(block keys, lookup results and their leases, store cursors, store tickets) and talks to the
daemon only through ``SchedulerClient``, and never waits for it: no method vLLM calls here makes
a round trip. The lookups a step queues go out together at its end (``build_connector_meta``),
at most one batch in flight, and answers are taken in once at the start of the next step (a
request whose lookup is out answers ``None``: "ask again next step"); stores take writable slots from the client's stock of
reservations, which it refills in the background, and name each slot's key in the store itself
(the daemon binds it, and drops duplicates, when the store arrives); releases, aborts and resets
are sent without waiting, their answers taken in by the next poll. The connection itself is
made without waiting. A daemon that is missing or slow turns into zero hits and skipped stores
(``DaemonUnavailable`` is caught here, never raised to vLLM).

Stores are planned for requests vLLM handed new blocks that step (a decode's block is stored
the step after it filled, when vLLM allocates the next one), one ticket per group and step.
Stores of keys this engine knows are in the pool (it stored them, and no lookup has missed them
since) are not planned again; a request that finishes with full blocks not yet stored because
the stock ran short keeps its blocks (vLLM's delayed free) until slots come, bounded by
``timeout_ms`` and by the daemon being reachable.

Lifecycle of a request, as vLLM drives it:
``get_num_new_matched_tokens`` (queue a lookup, answer ``None`` until it lands, then the hit)
→ ``update_state_after_alloc`` (turn the hit into load specs, or release the lease)
→ ``build_connector_meta`` each step (eager stores of newly full blocks)
→ ``update_connector_output`` (load done: release the lease; store tickets acked by every rank)
→ ``request_finished`` (keep the blocks while tickets are in flight; free them via ``free_now``).

P/D consumers stream: a decode request told how many blocks the prefill hands over
(``kvpool_tokens``) takes all of them from vLLM as soon as its first lookup finds one, loads
what is committed, and then looks up the rest once per step, loading each chunk as the
prefill's stores commit it (``LoadSpec.final`` tells the workers when the last chunk went out).
A hand-off that stops making progress for ``pd_wait_s`` (or a daemon that goes away) ends the
stream: the blocks that never came are reported as load errors and vLLM recomputes from the
first of them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from collections import deque
from itertools import chain, compress, islice, repeat
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from kvpool.client.vllm_keys import GroupInfo, RequestKeys
from kvpool.client.vllm.store_losses import (DAEMON_UNAVAILABLE, NO_ROOM, STORE_FAILED,
                                             STORE_WAIT, StoreLosses)
from kvpool.client.vllm_meta import LoadSpec, StepMeta, StoreSpec, WorkerAcks
from kvpool.shared.errors import DaemonUnavailable, KvpoolError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpool.vllm")

# Keys remembered as committed: to report BlockRemoved on reset, and to plan no store of a key
# the pool holds (a GPU prefix hit, a recomputed preempted request). Bounded so a long-lived
# engine does not grow without limit; the daemon is the source of truth for presence (it
# dedups what this misses) and a lookup that misses a remembered key forgets it.
_MAX_REMEMBERED_KEYS = 1 << 20
_NOTHING: dict[bytes, None] = {}
# Lookups sent per step are bounded so that build_connector_meta does not stall vLLM's
# scheduler when hundreds of requests arrive at once: a step asks for about this many blocks,
# the other requests wait a step (a step cannot prefill more than max_num_batched_tokens
# anyway). A single request larger than the bound still goes whole. Stores are not bounded:
# a block not planned in the step it fills may never be stored if the engine stops right after.
LOOKUP_BLOCKS_PER_STEP = 512
# Store planning per step is bounded too: a burst of prefills fills hundreds of blocks in one
# step, and planning them all at once would add a millisecond to that step. A step plans
# requests, in the order their blocks filled, until it has spent this much time on them (at
# least one request); the others wait for the next step, their blocks still allocated to them
# (a request that finishes meanwhile keeps them, in the backlog, until they are planned). While
# the queue's front has waited STORE_DEFER_MAX_S, a step spends STORE_OVERDUE_BUDGET_S more on
# it, in late pieces (at least one): an overload gets more planning per step, but bounded, so
# it lags instead of slowing the engine (it used to plan every overdue request whole: steps of
# several ms on a slow host). Finished requests' blocks are bounded by store_wait_s either way.
STORE_PLAN_BUDGET_S = 100e-6
STORE_DEFER_MAX_S = 0.5
STORE_OVERDUE_BUDGET_S = 50e-6
# A long prompt's prefill chunk fills hundreds of blocks in one step (8192 tokens: 512 blocks
# of 16): a request is planned in pieces of at most this many blocks, so the budget is checked
# between pieces and the rest of its blocks wait at the front of the queue.
STORE_PIECE_BLOCKS = 32
# A step whose budget is spent before planning starts still plans one piece, so the queue
# always moves, but a small one: this many blocks (~25 us).
STORE_LATE_PIECE_BLOCKS = 8
# The planning budget ends early in a step whose other work (lookup answers taken in, the
# next lookup batch and the step's other messages sent, all before planning) already took
# time: it ends this long after build_connector_meta started, whichever is first.
STORE_STEP_BUDGET_S = 150e-6
# A decoding request's new blocks are planned once they add up to this many tokens: a decode
# fills one block every block_size steps, so with 16-token blocks a ticket takes 8 of them
# instead of 1, which cuts the per-request work of decode steps (hashing stays per block).
# Prompt blocks are planned as their prefill chunk fills them. Finished requests (the
# backlog) and P/D producers plan whatever they have.
STORE_RUN_TOKENS = 128


@dataclass(eq=False)
class _Run:
    """The blocks of one request in a ticket."""

    req: "_Req"
    indices: Sequence[int]     # block positions in the request (a range when contiguous)
    keys: list[bytes]


@dataclass(eq=False)
class _Ticket:
    """One store: the blocks of one group planned in one step, for every request (the workers
    copy them in one job per group and step anyway, so finer tickets would buy nothing)."""

    group: int
    runs: list[_Run]
    keys: list[bytes]
    slots: list[int]
    block_ids: list[int]
    done: int = 0              # ranks that reported it
    failed: int = 0            # ranks that reported a failure
    stale: bool = False        # a cache reset happened since: never counts as committed


@dataclass(eq=False)
class _StepPlan:
    """What planning one step's stores reads and fills."""

    n_sched: dict[str, int]            # SchedulerOutput.num_scheduled_tokens
    spec_tokens: dict[str, list[int]]  # SchedulerOutput.scheduled_spec_decode_tokens
    tables: list[dict[str, list[Any]]] | None   # see _block_tables
    wanted: list[list[tuple["_Req", Sequence[int], list[bytes], list[int]]]]  # per group
    seen: list[set[bytes]]             # per group: keys planned this step


@dataclass(eq=False)
class _Req:
    request: "Request"
    keys: RequestKeys
    # lookup: IDLE → QUEUED → SENT → hit is not None (a result, with leases until consumed)
    state: str = "idle"
    target: int = 0            # block count the lookup asked for (the hit cannot exceed it)
    rounds: int = 0
    hit: int | None = None     # blocks available from the pool, from block 0
    hit_start: list[int] = field(default_factory=list)  # per group: block index of slots[g][0]
    slots: list[list[int]] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    local_tokens: int = 0      # GPU prefix hit seen by the last get_num_new_matched_tokens
    loading: bool = False
    load_blocks: list[int] = field(default_factory=list)
    load_keys: list[bytes] = field(default_factory=list)
    cursor: list[int] = field(default_factory=list)     # per group: next block to store
    lo: int = 0                # min(cursor): a request with no block past it has none to store
    pooled: int = 0            # leading blocks this request loaded from the pool (held there)
    tickets: set[int] = field(default_factory=set)
    finishing: bool = False    # request_finished returned True: free via free_now
    finished: bool = False
    # P/D: a producer stores every block (also those it loaded) and hands the prompt over; a
    # consumer waits (bounded) for the producer's blocks to land before taking its hit.
    producer: bool = False
    store_run: int = 1         # blocks a running request's store waits to gather (1: producer)
    load_failed: bool = False  # a load from the pool failed: recompute, never offer it again
    expect_blocks: int = 0
    wait_until: float = 0.0    # a hand-off making no progress until then is given up on
    # P/D streaming: blocks [stream_next, stream_end) are allocated, not yet in the pool.
    stream_to: int = 0         # offered to vLLM beyond the hit (until the allocation)
    stream_next: int = 0
    stream_end: int = 0        # 0: not streaming
    stream_ids: list[list[int]] = field(default_factory=list)   # per group: GPU block ids
    backlog_until: float = 0.0  # finished, blocks kept for stores waiting on slots until then


class SchedulerRole:
    """See the module docstring. Public methods mirror ``KVConnectorBase_V1``'s scheduler side
    and are called only from vLLM's scheduler thread."""

    def __init__(self, groups: list[GroupInfo], world_size: int, client: Any,
                 backoff_s: float = 0.2, backoff_max_s: float = 5.0, *,
                 kv_producer: bool = False, engine_id: str = "", tp_size: int = 1,
                 pd_wait_s: float = 3.0, pd_stream: bool = True,
                 store_wait_s: float = 2.0, events_enabled: bool = True) -> None:
        self.groups = groups
        # A finished request waits this long at most for slots to store its last blocks.
        self.store_wait_s = store_wait_s
        # Finished requests keeping their blocks for their stores, in the order they finished
        # (which is their backlog_until order); those with blocks still to plan, in that order;
        # and those whose blocks all got planned since the last step (they leave the backlog).
        self._backlog: dict[str, None] = {}
        self._backlog_todo: OrderedDict[str, None] = OrderedDict()
        self._backlog_planned: list[str] = []
        # Full blocks given up without being stored, by reason.
        self.losses = StoreLosses()
        # Requests with blocks to plan, oldest first (deferred by the step budget, or waiting
        # for slots): request id -> when it first waited.
        self._replan: OrderedDict[str, float] = OrderedDict()
        self._steps = 0                   # build_connector_meta calls so far
        self._step_started = 0.0          # perf_counter at the current step's start
        self._pumped = False              # the last _pump found the daemon connected
        self._windowed = any(g.window_blocks is not None for g in groups)
        self._polled = -1                 # the step whose answers were last taken in
        self.world_size = world_size
        self.kv_producer = kv_producer
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.pd_wait_s = pd_wait_s
        self._retry: list[str] = []     # P/D consumers to look up again next step
        self._streams: set[str] = set()  # P/D consumers loading chunks as they land
        # Streaming needs every group to hold blocks [0, n) of the prompt: a sliding-window
        # group looks up (and keeps) only the window ending at the hit, which moves as chunks
        # land. Models with one wait for the whole hand-off and load it at once instead.
        # A stalled stream reports its missing blocks as load errors, which vLLM's "fail"
        # load-failure policy turns into a failed request: pd_stream=False keeps the wait.
        self._can_stream = pd_stream and all(g.window_blocks is None for g in groups)
        self.client = client
        sizes = {g.block_tokens for g in groups}
        # One token→block grid for every group: vLLM's hybrid allocator gives attention groups
        # one block size; anything else is served by recompute rather than guessed at.
        self.enabled = bool(groups) and len(sizes) == 1
        if not self.enabled:
            logger.warning("kvpool: KV-cache groups %s cannot be pooled; connector idle",
                           [g.identity for g in groups])
        self.block_tokens = next(iter(sizes)) if sizes else 0
        self._store_run = max(1, -(-STORE_RUN_TOKENS // self.block_tokens)) \
            if self.block_tokens else 1
        self.kv_cache_manager: KVCacheManager | None = None
        self._namespaces = [g.namespace for g in groups]
        self._reqs: dict[str, _Req] = {}
        self._queued: list[str] = []
        self._inflight_calls: list[tuple[Any, int, list[tuple[str, int]]]] = []
        self._inflight_replies: list[Any] = []
        self._batch_results: dict[str, list[tuple[int, int, list[int], int]]] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 1
        # Per group: key -> ticket storing it. Per GPU block: the ticket that last read it
        # (entries of resolved tickets stay, and are ignored: the map is bounded by the number
        # of GPU blocks, and nothing is deleted per block on the hot path).
        self._inflight: list[dict[bytes, int]] = [{} for _ in groups]
        self._block_ticket: dict[int, int] = {}
        self._step_loads: list[LoadSpec] = []
        self._flush: set[int] = set()
        self._free_ready: list[str] = []
        self._release: list[int] = []
        self._abort_slots: list[int] = []
        self._events: list[Any] = []
        # KV events are built only if vLLM publishes them, and only when it asks for them
        # (take_events), from the tickets that committed.
        self.events_enabled = events_enabled
        self._stored: list[_Ticket] = []
        # Group-0 keys of loads in flight -> the request loading them. One loader per key (the
        # others wait for it, see get_num_new_matched_tokens), so marks are set and cleared
        # per request with C-level dict operations.
        self._loading_keys: dict[bytes, str] = {}
        self._orphans: list[Any] = []    # lookups nobody waits for; their leases get released
        self._committed: list[dict[bytes, None]] = [{} for _ in groups]
        self._backoff_s, self._backoff_max_s = backoff_s, backoff_max_s
        self._retry_at = 0.0
        self._fail_backoff = backoff_s
        if self.enabled:
            # Connect and start stocking slots now (start-up, not a step: this may wait up to
            # timeout_ms once), so the first steps find them.
            for g in groups:
                self.client.keep_stock(g.namespace)
            connect = getattr(self.client, "connect", None)
            if connect is not None and not connect():
                self._daemon_failed(DaemonUnavailable("kvpoold not reachable at start"))
            self._pump()

    # ---- daemon access with a circuit breaker ----------------------------------------------

    def _daemon_ok(self) -> bool:
        return time.monotonic() >= self._retry_at

    def _daemon_failed(self, err: Exception) -> None:
        if time.monotonic() >= self._retry_at:
            logger.warning("kvpool daemon unavailable (%s); serving without the pool, retrying "
                           "in %.1f s", err, self._fail_backoff)
        self._retry_at = time.monotonic() + self._fail_backoff
        self._fail_backoff = min(self._fail_backoff * 2, self._backoff_max_s)

    def _daemon_succeeded(self) -> None:
        self._fail_backoff = self._backoff_s

    def _pump(self) -> bool:
        """Connect (without waiting) and take in whatever the daemon has answered; False while
        the daemon cannot be used (down, backing off, or the connection still being made)."""
        self._pumped = False
        if not self._daemon_ok():
            return False
        try:
            if not self.client.ready():
                return False
            self.client.poll(just_ready=True)
        except DaemonUnavailable as e:
            self._daemon_failed(e)
            return False
        except KvpoolError as e:     # the daemon refused our Hello (another protocol version)
            self._daemon_failed(e)
            return False
        self._pumped = True
        return True

    def _nowait(self, fn, *args) -> bool:
        """Send a request nobody waits for; False if it could not be sent. Leases and slots
        of a connection that is gone are released by the daemon with it, so losing these
        is harmless."""
        try:
            fn(*args)
        except DaemonUnavailable as e:
            logger.debug("kvpool: %s not sent: %s", getattr(fn, "__name__", fn), e)
            return False
        return True

    # ---- lookups -------------------------------------------------------------------------

    def _state(self, request: "Request") -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _Req(request, RequestKeys(request, self.groups),
                      cursor=[0] * len(self.groups))
            self._reqs[request.request_id] = st
            params = request.kv_transfer_params or {}
            st.producer = self.kv_producer or bool(params.get("do_remote_decode"))
            # A P/D hand-off stores every block as soon as it fills: the decode side streams.
            st.store_run = 1 if st.producer else self._store_run
            if params.get("do_remote_prefill") and params.get("kvpool_tokens"):
                # Whatever TP size the prefill ran (kvpool_tp): its ranks stored every head.
                st.expect_blocks = int(params["kvpool_tokens"]) // self.block_tokens
                st.wait_until = time.monotonic() + self.pd_wait_s
        return st

    def on_new_request(self, request: "Request") -> None:
        """A request entered the scheduler: hash its prompt's block keys now (as vLLM hashes
        its own blocks when a request is created), not inside a scheduling step."""
        if not self.enabled:
            return
        st = self._state(request)
        if st.keys.cacheable:
            n = (request.num_tokens - 1) // self.block_tokens
            for gi, g in enumerate(self.groups):
                if g.window_blocks is None:
                    st.keys.keys(request, gi, n)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.enabled:
            return 0, False
        st = self._state(request)
        if not st.keys.cacheable or request.skip_reading_prefix_cache or st.load_failed:
            return 0, False
        st.local_tokens = num_computed_tokens
        if st.hit is None:
            if st.state == "idle":
                max_blocks = (request.num_tokens - 1) // self.block_tokens
                if max_blocks <= num_computed_tokens // self.block_tokens:
                    return 0, False     # the GPU already holds every block we could offer
                if not self._daemon_ok():
                    return 0, False
                st.state, st.target, st.rounds = "queued", max_blocks, 0
                self._queued.append(request.request_id)
            if self._polled != self._steps:
                # Once per step: answers that came since the last step. The step's queued
                # lookups go out together at its end (build_connector_meta).
                self._polled = self._steps
                self._pump()
                self._poll_lookups()
            if st.hit is None:
                return None, False
        end = max(st.hit, st.stream_to)
        ext = end * self.block_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        if self._loading_keys:
            # Another request is loading some of these blocks: wait for it and take them from
            # the GPU prefix cache then, instead of loading them twice.
            first = num_computed_tokens // self.block_tokens
            if not self._loading_keys.keys().isdisjoint(st.keys.range(request, 0, first, end)):
                return None, False
        return ext, True

    def _window_start(self, g: GroupInfo, end: int) -> int:
        wb = g.window_blocks
        return 0 if wb is None else max(0, end - wb)

    def _send_lookups(self) -> None:
        """One lookup per namespace for every queued request (the step's batch)."""
        if not self._queued:
            return
        if not self._daemon_ok():
            self._resolve_miss([r for r in dict.fromkeys(self._queued)
                                if r in self._reqs and self._reqs[r].state == "queued"])
            self._queued.clear()
            return
        if not self._pumped:    # (this step's _pump ran before: it asked ready())
            return              # connecting: the queued requests ask again next step
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
                    elif g.window_blocks is None:
                        start, end = 0, st.target
                    else:
                        start, end = self._window_start(g, st.target), st.target
                    lists.append(st.keys.range(st.request, gi, start, end))
                    spans.append((rid, start))
                calls.append((self.client.lookup_start(g.namespace, lists, True), gi, spans,
                              lists))
        except DaemonUnavailable as e:
            self._daemon_failed(e)
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
        queued, reqs = self._queued, self._reqs
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
        self._queued = queued[i:]
        return ids

    def _resolve_miss(self, ids: Iterable[str]) -> None:
        for rid in ids:
            st = self._reqs.get(rid)
            if st is None:
                continue
            if st.stream_end:
                # The daemon is gone or refused: the rest of the hand-off will not come.
                self._end_stream(st, report_missing=True)
                continue
            st.state, st.hit = "idle", 0
            st.slots, st.leases, st.hit_start = [], [], []

    def _poll_lookups(self) -> None:
        """Collect the in-flight batch if every namespace has answered; never waits."""
        if self._orphans:
            still = []
            for call in self._orphans:
                try:
                    reply = call.result()
                except DaemonUnavailable:
                    continue
                if reply is None:
                    still.append(call)
                else:
                    self._release.extend(x for x in reply.leases if x)
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
                self._daemon_failed(e)
            else:
                logger.warning("kvpool: lookup refused: %s", e)
            for k, (call, _, _, _) in enumerate(calls):
                if replies[k] is not None:
                    self._release.extend(x for x in replies[k].leases if x)
                elif k != failed_at:
                    self._orphans.append(call)   # may still answer, with leases to release
            ids = [rid for rid, _ in calls[0][2]]
            self._inflight_calls, self._inflight_replies = [], []
            self._resolve_miss(ids)
            return
        if any(r is None for r in replies):
            return
        self._daemon_succeeded()
        self._inflight_calls, self._inflight_replies = [], []
        per_req: dict[str, list[tuple[int, int, list[int], int]]] = {}
        for (call, gi, spans, lists), reply in zip(calls, replies):
            known = self._committed[gi]
            for k, (rid, start) in enumerate(spans):
                hit = reply.hits[k]
                per_req.setdefault(rid, []).append(
                    (start, hit, reply.slots[k], reply.leases[k]))
                if known and hit < len(lists[k]):
                    # The first miss is news: a key we stored has been evicted since; it may
                    # be stored again.
                    known.pop(lists[k][hit], None)
        requeue = False
        for rid, answers in per_req.items():
            st = self._reqs.get(rid)
            leases = [lease for _, _, _, lease in answers if lease]
            if st is None or st.state != "sent" or st.finished:
                self._release.extend(leases)
                continue
            if st.stream_end:
                self._stream_answer(st, answers, leases)
                continue
            hit = self._combine(st, answers)
            # (a window group may have made _combine shrink the target: the hand-off is the
            # whole prompt but its last token, whatever this round found)
            full = (st.request.num_tokens - 1) // self.block_tokens
            want = min(st.expect_blocks, full) if st.expect_blocks else 0
            if want and (hit is None or hit < want) and time.monotonic() < st.wait_until:
                if hit and self._can_stream:
                    # The producer's stores are landing: take the whole hand-off now, load
                    # what is here, and the rest chunk by chunk as it commits.
                    st.stream_to = want
                    st.wait_until = time.monotonic() + self.pd_wait_s
                else:
                    # Nothing landed yet (or a window group: wait for all of it).
                    self._release.extend(leases)
                    st.state, st.target, st.rounds = "queued", full, 0
                    self._retry.append(rid)
                    continue
            if hit is None:                 # a window elsewhere: ask again for that target
                self._release.extend(leases)
                st.state = "queued"
                self._queued.append(rid)
                requeue = True
                continue
            st.state = "idle"
            st.hit = hit
            st.leases = leases
            st.hit_start = [start for start, _, _, _ in answers]
            st.slots = [slots for _, _, slots, _ in answers]
            if hit == 0:
                self._release.extend(leases)
                st.leases = []
        if requeue:
            self._send_lookups()

    def _combine(self, st: _Req, answers: list[tuple[int, int, list[int], int]]) -> int | None:
        """The hit in blocks from per-group answers, or None to look up a shorter target.

        Full-attention groups need every block from 0; a sliding-window group needs only the
        window ending at the hit. Windows were asked for ending at ``target``: when the full
        groups hit less, the window moves, and one more round asks for the window there.
        """
        if not self._windowed:
            return min(a[1] for a in answers)
        full = [a[1] for g, a in zip(self.groups, answers) if g.window_blocks is None]
        hit = min(full) if full else st.target
        if hit == 0:
            return 0
        for g, (start, n, _, _) in zip(self.groups, answers):
            if g.window_blocks is None:
                continue
            if hit != st.target:
                if st.rounds:
                    return 0
                st.target, st.rounds = hit, st.rounds + 1
                return None
            if n < st.target - start:
                return 0
        return hit

    # ---- allocation → loads --------------------------------------------------------------

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.loading:
            return
        bt = self.block_tokens
        if num_external_tokens == 0 or st.hit is None:
            # Blocks the pool already holds need no store (those a load brought in, when vLLM
            # schedules the request after it); the GPU-cached ones past them do.
            self._set_cursor(st, 0 if st.producer else max(st.hit or 0, st.pooled))
            self._consume_lookup(st, keep_leases=False)
            return
        local_blocks = st.local_tokens // bt
        end = (st.local_tokens + num_external_tokens) // bt
        assert end <= max(st.hit, st.stream_to), "vLLM accepted more external tokens than offered"
        hit = min(end, st.hit)          # blocks in the pool now; the rest of a hand-off streams
        table = blocks.get_block_ids()
        loads = []
        unloadable = False
        for gi, g in enumerate(self.groups):
            ids = table[g.index]
            slots, bids = [], []
            for i in range(local_blocks, hit):
                if i >= len(ids) or ids[i] == 0:     # a null block: outside the window
                    continue
                k = i - st.hit_start[gi]
                if not 0 <= k < len(st.slots[gi]):
                    # vLLM keeps more of the window than was looked up: never leave a block
                    # it counts as computed unwritten; fail the load and let it recompute.
                    unloadable = True
                    continue
                slots.append(st.slots[gi][k])
                bids.append(ids[i])
            if slots:
                loads.append(LoadSpec(request.request_id, gi, slots, bids))
        if unloadable:
            loads = [LoadSpec(request.request_id, 0, [], [b for spec in loads
                                                          for b in spec.block_ids],
                              failed=True)]
        st.loading = True
        st.pooled = 0 if unloadable else hit
        st.load_blocks = [b for spec in loads for b in spec.block_ids]
        st.load_keys = st.keys.range(request, 0, local_blocks, end)
        self._loading_keys.update(dict.fromkeys(st.load_keys, request.request_id))
        self._step_loads.extend(loads)
        self._consume_lookup(st, keep_leases=True)
        first = max(hit, local_blocks)
        if end > first:
            # A P/D hand-off still landing: these specs are its first chunk, not its last.
            for spec in loads:
                spec.final = False
            st.stream_ids = [list(table[g.index][:end]) for g in self.groups]
            st.stream_next, st.stream_end = first, end
            for ids in st.stream_ids:
                st.load_blocks.extend(ids[first:end])
            self._streams.add(request.request_id)
            # vLLM may have taken a while to find room for it: the wait starts now.
            st.wait_until = time.monotonic() + self.pd_wait_s
            st.state = "queued"         # asked for in this step's batch
            self._queued.append(request.request_id)
        elif not loads:
            # Nothing to copy (all needed blocks were local); the workers still report the
            # request as received so vLLM leaves WAITING_FOR_REMOTE_KVS.
            self._step_loads.append(LoadSpec(request.request_id, 0, [], []))
        self._set_cursor(st, 0 if st.producer else end)

    def _consume_lookup(self, st: _Req, keep_leases: bool) -> None:
        """The lookup result is used up; its leases go now unless a load holds them."""
        if not keep_leases:
            self._release.extend(st.leases)
            st.leases = []
        st.state, st.hit, st.slots, st.hit_start = "idle", None, [], []
        st.stream_to = 0

    # ---- P/D streaming -------------------------------------------------------------------

    def _stream_answer(self, st: _Req, answers: list[tuple[int, int, list[int], int]],
                       leases: list[int]) -> None:
        """Load what has committed since the last round; ask again next step for the rest."""
        rid = st.request.request_id
        st.leases.extend(leases)        # held until the whole load is reported done
        st.state = "idle"
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
                self._streams.discard(rid)
                st.stream_end, st.stream_ids = 0, []
                return
        st.state = "queued"
        self._retry.append(rid)

    def _end_stream(self, st: _Req, report_missing: bool) -> None:
        """No more chunks: the workers report the request once its loads in flight are done.
        Blocks that never came are load errors (vLLM recomputes from the first of them)
        unless the request is gone anyway."""
        rid = st.request.request_id
        self._streams.discard(rid)
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

    # ---- per step: stores, flushes, releases ---------------------------------------------

    def build_connector_meta(self, so: "SchedulerOutput") -> StepMeta:
        meta = StepMeta()
        if not self.enabled:
            return meta
        self._step_started = time.perf_counter()
        self._pump()
        self._poll_lookups()
        if self._streams:
            now = time.monotonic()
            for st in [self._reqs[r] for r in self._streams]:
                if now >= st.wait_until:
                    self._end_stream(st, report_missing=True)
        # Stores still reading blocks that are handed to a request this step must finish
        # first (preempted requests' blocks; sliding-window blocks freed and reused).
        flush = self._flush
        self._flush = set()
        if self._tickets:
            handed = self._handed_blocks(so)
            if handed:
                tickets, last = self._tickets, self._block_ticket
                for b in last.keys() & handed:
                    if last[b] in tickets:
                        flush.add(last[b])
        for rid in so.preempted_req_ids or ():
            st = self._reqs.get(rid)
            if st is not None:
                flush.update(st.tickets)
                self._consume_lookup(st, keep_leases=False)
                self._set_cursor(st, 0)
        meta.flush_tickets = sorted(flush)
        # The step's messages go before store planning, whose budget runs from the step's
        # start: planning gets what they left of it, so a step that sends a lookup batch
        # does not also plan for the full budget.
        if self._abort_slots:
            slots, self._abort_slots = self._abort_slots, []
            self._nowait(self.client.abort_nowait, slots)
        if self._release:
            leases, self._release = sorted(set(self._release)), []
            self._nowait(self.client.release_nowait, leases)
        if self._retry:
            self._queued.extend(self._retry)
            self._retry = []
        if self._queued and not self._inflight_calls:
            self._send_lookups()
        meta.stores = self._plan_stores(so)
        meta.free_now, self._free_ready = self._free_ready, []
        if self._backlog:
            self._end_backlog()
        # Last: polling, deadlines and a failed send above may all have added load specs.
        meta.loads, self._step_loads = self._step_loads, []
        self._steps += 1
        return meta

    @staticmethod
    def _handed_blocks(so: "SchedulerOutput") -> list[int]:
        """GPU blocks given to requests this step (vLLM 0.32/0.33 ``SchedulerOutput``)."""
        out: list[int] = []
        for r in so.scheduled_new_reqs:
            for ids in r.block_ids:
                out += ids
        # (most running requests get no new block in a step: None, skipped at C level)
        for groups in filter(None, so.scheduled_cached_reqs.new_block_ids):
            for ids in groups:
                out += ids
        return out

    @staticmethod
    def _set_cursor(st: _Req, block: int) -> None:
        st.cursor = [block] * len(st.cursor)
        st.lo = block

    def _plan_stores(self, so: "SchedulerOutput") -> list[StoreSpec]:
        """Newly full blocks of every scheduled request (and of finished ones waiting for
        slots), minus keys in flight or known to be in the pool, each given a reserved slot
        from the client's stock. Never waits: blocks the stock cannot cover yet are planned
        again next step (or skipped when the pool has no room).

        Only requests that vLLM handed new blocks this step are looked at (new and resumed
        ones, prefill chunks, and a decode at the step after its block filled: vLLM allocates
        the next block then, and the filled one's tokens are all known by then, also under
        async scheduling); a request that finishes with a full block not yet stored is taken
        in by the backlog (``request_finished``). They join a queue, which a step works
        through for ``STORE_PLAN_BUDGET_S`` (see there), after the backlog's.
        The work per block is done by C-level list, set and dict operations over each
        request's run of new blocks."""
        if self.kv_cache_manager is None or not self._daemon_ok():
            return []
        queue = self._replan
        now = time.monotonic()
        cached = so.scheduled_cached_reqs
        get, n_sched_of, bt = self._reqs.get, so.num_scheduled_tokens, self.block_tokens
        # Only those with a run of blocks to store join (most decodes that got a new block
        # have not gathered one yet); a rough test, _plan_request decides.
        for rid in chain((r.req_id for r in so.scheduled_new_reqs),
                         compress(cached.req_ids, cached.new_block_ids)):
            if rid in queue:
                continue
            st = get(rid)
            if st is None:
                continue
            filled = (st.request.num_computed_tokens + n_sched_of.get(rid, 0)) // bt - st.lo
            if filled > 0 and (filled >= st.store_run or self._run_blocks(st) == 1):
                queue[rid] = now
        if not queue and not self._backlog_todo:
            return []
        if not any(map(self.client.stock, self._namespaces)) \
                and any(map(self.client.reserving, self._namespaces)):
            # No slot in hand, a refill on its way: the queue waits for the next step,
            # without doing the work per request now.
            self.client.take_slots(self.groups[0].namespace, 0)     # (asks, if not yet)
            return []
        # per group: (request, block indices, keys, GPU block ids) runs to store
        step = _StepPlan(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens,
                         self._block_tables(), [[] for _ in self.groups],
                         [set() for _ in self.groups])
        stop_at = min(time.perf_counter() + STORE_PLAN_BUDGET_S,
                      self._step_started + STORE_STEP_BUDGET_S)
        # Finished requests hold GPU blocks for these stores: they go first. Those the budget
        # leaves wait in the backlog (bounded by store_wait_s, see _end_backlog).
        todo = self._backlog_todo
        finished = self._plan_from(todo, step, stop_at, True)
        self._plan_from(queue, step, stop_at, not finished)
        # The rest wait for the next step, in order; those at the front that have waited too
        # long get a second, bounded budget (at least a late piece).
        overdue = now - STORE_DEFER_MAX_S
        if queue and next(iter(queue.values())) <= overdue:
            self._plan_from(queue, step, time.perf_counter() + STORE_OVERDUE_BUDGET_S, True,
                            waited_since=overdue, piece=STORE_LATE_PIECE_BLOCKS)
        specs: list[StoreSpec] = []
        for gi, g in enumerate(self.groups):
            runs = step.wanted[gi]
            if not runs:
                continue
            total = sum(len(keys) for _, _, keys, _ in runs)
            refs, grant = self.client.take_slots(g.namespace, total)
            if len(refs) < total:
                runs = self._cut_runs(gi, g.namespace, runs, len(refs), now)
            if not runs:
                continue
            tid = self._next_ticket
            self._next_ticket += 1
            all_keys: list[bytes] = []
            all_bids: list[int] = []
            parts = []
            for st, index, keys, bids in runs:
                all_keys += keys
                all_bids += bids
                parts.append(_Run(st, index, keys))
                st.tickets.add(tid)
            refs = refs[:len(all_keys)]
            self._tickets[tid] = _Ticket(gi, parts, all_keys, refs, all_bids)
            self._inflight[gi].update(dict.fromkeys(all_keys, tid))
            self._block_ticket.update(dict.fromkeys(all_bids, tid))
            specs.append(StoreSpec(tid, gi, refs, all_bids, all_keys, grant))
        for st in finished:
            if st.request.request_id in todo:
                continue            # cut short by the stock: planned again next step
            self._backlog_planned.append(st.request.request_id)
        return specs

    def _plan_from(self, fifo: OrderedDict, step: "_StepPlan", stop_at: float,
                   one_at_least: bool, waited_since: float | None = None,
                   piece: int | None = None) -> list[_Req]:
        """Plan the requests at the front of ``fifo`` (taking them out) until ``stop_at``, a
        piece (``STORE_PIECE_BLOCKS``) at a time, the first whatever the time if
        ``one_at_least``; a request with blocks left after its piece stays at the front.
        With ``waited_since``, only requests queued by then; ``piece`` overrides the piece
        size. Returns those planned, still known."""
        planned: list[_Req] = []
        while fifo:
            if waited_since is not None and next(iter(fifo.values())) > waited_since:
                break
            late = time.perf_counter() > stop_at
            if late and not one_at_least:
                break
            one_at_least = False
            rid, since = fifo.popitem(last=False)
            st = self._reqs.get(rid)
            if st is not None:
                if self._plan_request(st, step, piece or (STORE_LATE_PIECE_BLOCKS if late
                                                          else STORE_PIECE_BLOCKS)):
                    fifo[rid] = since
                    fifo.move_to_end(rid, last=False)
                if not planned or planned[-1] is not st:
                    planned.append(st)
        return planned

    def _run_blocks(self, st: _Req) -> int:
        """New full blocks ``st`` gathers before they are planned: a decoding request's run
        (see STORE_RUN_TOKENS); 1 for a prefill, prompt blocks left by a piece, or a finished
        request."""
        req = st.request
        if st.finished or req.num_computed_tokens < req.num_prompt_tokens \
                or st.lo < req.num_prompt_tokens // self.block_tokens:
            return 1
        return st.store_run

    def _plan_request(self, st: _Req, step: "_StepPlan", piece: int | None = None) -> bool:
        """Add ``st``'s newly full blocks to ``step.wanted`` (if they make a run of
        ``STORE_RUN_TOKENS``, or the request has finished), at most ``piece`` of them (all if
        None); True if more are left to plan."""
        if not st.keys.cacheable or st.loading:
            return False
        req = st.request
        rid = req.request_id
        done = req.num_computed_tokens + step.n_sched.get(rid, 0)
        spec_tokens = step.spec_tokens
        if spec_tokens and rid in spec_tokens:
            done -= len(spec_tokens[rid])
        n_full = min(done, req.num_tokens) // self.block_tokens
        if n_full < st.lo + self._run_blocks(st):
            return False
        more = piece is not None and n_full > st.lo + piece
        if more:
            n_full = st.lo + piece
        tables = step.tables
        for gi, g in enumerate(self.groups):
            lo = st.cursor[gi]
            if n_full <= lo:
                continue
            st.cursor[gi] = n_full
            if tables is not None:
                blocks = tables[g.index].get(rid) or ()
                hi = min(n_full, len(blocks))
                bids = [b.block_id for b in blocks[lo:hi]]
            else:
                ids = self.kv_cache_manager.get_block_ids(rid)[g.index]
                hi = min(n_full, len(ids))
                bids = ids[lo:hi]
            if hi <= lo:
                continue
            keys = st.keys.range(req, gi, lo, hi)
            inflight, taken = self._inflight[gi], step.seen[gi]
            # A P/D hand-off stores every block: the decode side must find each one.
            known = self._committed[gi] if not st.producer else _NOTHING
            if 0 in bids or not inflight.keys().isdisjoint(keys) \
                    or not taken.isdisjoint(keys) or not known.keys().isdisjoint(keys):
                keep = [j for j, (k, b) in enumerate(zip(keys, bids))
                        if b and k not in inflight and k not in taken and k not in known]
                if not keep:
                    continue
                index: Sequence[int] = [lo + j for j in keep]
                keys = [keys[j] for j in keep]
                bids = [bids[j] for j in keep]
            else:
                index = range(lo, hi)
            taken.update(keys)
            step.wanted[gi].append((st, index, keys, bids))
        st.lo = min(st.cursor)
        return more

    def _block_tables(self) -> list[dict[str, list[Any]]] | None:
        """Per vLLM KV-cache group, the request -> blocks map of its manager, so a run of new
        blocks costs its length rather than the request's whole table
        (``KVCacheManager.get_block_ids`` lists every block of every group); None where the
        manager is shaped otherwise (then that public call is used)."""
        try:
            managers = self.kv_cache_manager.coordinator.single_type_managers
            maps = [m.req_to_blocks for m in managers]
        except AttributeError:
            return None
        return maps

    def _cut_runs(self, gi: int, namespace: bytes, runs: list, n: int, now: float) -> list:
        """The stock covers only ``n`` blocks: keep the runs' first ``n``; the others are
        planned again next step while slots are coming, else (no room in the pool) skipped."""
        coming = self.client.reserving(namespace)
        out = []
        for st, index, keys, bids in runs:
            if n >= len(keys):
                out.append((st, index, keys, bids))
                n -= len(keys)
                continue
            if coming:
                st.cursor[gi] = min(st.cursor[gi], index[n])
                st.lo = min(st.cursor)
                if st.finished:
                    self._backlog_todo[st.request.request_id] = None
                else:
                    self._replan.setdefault(st.request.request_id, now)
            else:
                self.losses.add(NO_ROOM, len(keys) - n)
            if n:
                out.append((st, index[:n], keys[:n], bids[:n]))
                n = 0
        return out

    def _full_blocks(self, st: _Req) -> int:
        """Blocks of ``st`` whose tokens are all computed."""
        req = st.request
        return min(req.num_computed_tokens, req.num_tokens) // self.block_tokens

    def _has_unstored_blocks(self, st: _Req) -> bool:
        return min(st.cursor) < self._full_blocks(st)

    def _end_backlog(self) -> None:
        """Finished requests whose blocks are all planned (or that waited long enough, or
        whose daemon is gone) let vLLM free their blocks once their stores have landed.
        Costs what changed, not the backlog's length: it runs every step."""
        if not self._daemon_ok():
            leaving, reason = list(self._backlog), DAEMON_UNAVAILABLE
        elif not any(map(self.client.reserving, self._namespaces)):
            leaving, reason = list(self._backlog), NO_ROOM
        else:
            reason = STORE_WAIT
            leaving, self._backlog_planned = self._backlog_planned, []
            now = time.monotonic()
            for rid in self._backlog:         # the oldest first: stop at one still in time
                st = self._reqs.get(rid)
                if st is not None and now < st.backlog_until:
                    break
                leaving.append(rid)
        for rid in leaving:
            if rid not in self._backlog:
                continue        # (left already)
            del self._backlog[rid]
            self._backlog_todo.pop(rid, None)
            st = self._reqs.get(rid)
            if st is not None and st.keys.cacheable and self._has_unstored_blocks(st):
                self.losses.add(reason, self._full_blocks(st) - st.lo)
            if st is not None and not st.tickets:
                self._free_ready.append(rid)
                self._forget(rid)
        self.losses.maybe_log()

    @property
    def unstored_total(self) -> int:
        return self.losses.total

    # ---- completions ---------------------------------------------------------------------

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        acks = out.kv_connector_worker_meta
        if isinstance(acks, WorkerAcks):
            for tid, n in acks.done.items():
                t = self._tickets.get(tid)
                if t is None:
                    continue
                t.done += n
                t.failed += acks.failed.get(tid, 0)
                if t.done >= self.world_size:
                    self._resolve_ticket(tid, t)
        failed = set(out.failed_recving or ())
        invalid = out.invalid_block_ids or set()
        for rid in out.finished_recving or ():
            st = self._reqs.get(rid)
            if st is None or not st.loading:
                continue
            st.loading = False
            deque(map(self._loading_keys.pop, st.load_keys, repeat(None)), maxlen=0)
            st.load_keys = []
            self._release.extend(st.leases)
            st.leases, st.hit = [], None
            if rid in failed or (invalid and not invalid.isdisjoint(st.load_blocks)):
                self._set_cursor(st, 0)   # recomputed blocks get stored again
                st.pooled = 0
                st.load_failed = True
            st.load_blocks = []
            if st.finished:
                self._forget(rid)

    def _resolve_ticket(self, tid: int, t: _Ticket) -> None:
        del self._tickets[tid]
        if not t.stale:     # (a reset emptied the in-flight map; others may use it since)
            deque(map(self._inflight[t.group].pop, t.keys, repeat(None)), maxlen=0)
        if t.failed:
            self._abort_slots.extend(t.slots)
            if not t.stale:
                self.losses.add(STORE_FAILED, len(t.keys))
        elif not t.stale:
            remembered = self._committed[t.group]
            remembered.update(dict.fromkeys(t.keys))
            excess = len(remembered) - _MAX_REMEMBERED_KEYS
            if excess > 0:      # the oldest first (a dict keeps insertion order)
                for key in list(islice(remembered, excess)):
                    del remembered[key]
            if self.events_enabled:
                self._stored.append(t)
        for run in t.runs:
            st = run.req
            st.tickets.discard(tid)
            if st.finishing and not st.tickets:
                rid = st.request.request_id
                if rid not in self._backlog and self._reqs.get(rid) is st:
                    self._free_ready.append(rid)
                    self._forget(rid)

    def _committed_event(self, t: _Ticket, run: _Run) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored

        st = run.req
        if not run.indices:
            return
        g = self.groups[t.group]
        bt = self.block_tokens
        first = run.indices[0]
        chain = st.keys.range(st.request, t.group, max(first - 1, 0), run.indices[-1] + 1)
        base = max(first - 1, 0)
        for i, key in zip(run.indices, run.keys):
            parent = chain[i - 1 - base] if i else None
            lora = st.request.lora_request
            self._events.append(BlockStored(
                block_hashes=[key], parent_block_hash=parent,
                token_ids=list(st.request.all_token_ids[i * bt:(i + 1) * bt]), block_size=bt,
                lora_id=None, medium=MEDIUM_CPU,
                lora_name=getattr(lora, "lora_name", None) if lora else None,
                group_idx=g.index))

    # ---- finish, reset, events ----------------------------------------------------------

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            return False, None
        params = self._handoff_params(st) if st.producer else None
        st.finished = True
        if st.loading:
            # vLLM keeps the blocks of a request aborted mid-load until the workers report
            # the load; the lease goes when that report arrives.
            if st.stream_end:
                self._end_stream(st, report_missing=False)
            return False, params
        # A lookup reply that lands later finds the request gone and releases its leases.
        self._consume_lookup(st, keep_leases=False)
        if self._has_unstored_blocks(st) and st.keys.cacheable:
            if not self._daemon_ok():
                self.losses.add(DAEMON_UNAVAILABLE, self._full_blocks(st) - st.lo)
            elif not any(map(self.client.reserving, self._namespaces)):
                self.losses.add(NO_ROOM, self._full_blocks(st) - st.lo)
            else:
                # Full blocks wait for slots from the stock: keep them until they are stored.
                st.backlog_until = time.monotonic() + self.store_wait_s
                self._backlog[request.request_id] = None
                self._backlog_todo[request.request_id] = None
                st.finishing = True
                return True, params
        if st.tickets:
            st.finishing = True
            return True, params
        self._forget(request.request_id)
        return False, params

    def _handoff_params(self, st: _Req) -> dict[str, Any]:
        """What a decode instance needs to take this prompt from the pool; shaped like the
        parameters vLLM's disaggregated-serving proxies pass from prefill to decode."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_block_ids": None,
                "remote_host": None, "remote_port": None,
                "kvpool_tokens": self._full_blocks(st) * self.block_tokens,
                "kvpool_tp": self.tp_size}

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        return bool(self._tickets or self._free_ready or self._release or self._abort_slots
                    or self._retry or self._streams or self._backlog)

    def reset_cache(self) -> bool:
        """Forget every block of this engine's namespaces in the pool, without waiting for the
        daemon's answer (later lookups on this connection see the reset); False if it could
        not be sent (vLLM then reports the reset as failed).

        Stores planned before the reset must never show up after it (a reset often follows a
        weight update): their slots are given back first, on the same connection, so a store
        that reaches the daemon later finds its slot gone and commits nothing.
        """
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved

        ok = self._pump()
        if ok:
            stale = [ref for t in self._tickets.values() for ref in t.slots]
            if stale:
                ok = self._nowait(self.client.abort_nowait, stale)
            for g in self.groups:
                ok = ok and self._nowait(self.client.reset_nowait, g.namespace)
        self._build_events()          # stored before the reset, reported before its removal
        for t in self._tickets.values():
            t.stale = True
        for inflight in self._inflight:
            inflight.clear()
        for st in self._reqs.values():
            if not st.loading:
                self._consume_lookup(st, keep_leases=False)
            self._set_cursor(st, 0)
        for gi, remembered in enumerate(self._committed):
            if remembered:
                self._events.append(BlockRemoved(block_hashes=list(remembered),
                                                 medium=MEDIUM_CPU,
                                                 group_idx=self.groups[gi].index))
                remembered.clear()
        return ok

    def _build_events(self) -> None:
        stored, self._stored = self._stored, []
        for t in stored:
            for run in t.runs:
                self._committed_event(t, run)

    def take_events(self) -> Iterable[Any]:
        if self._stored:
            self._build_events()
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        if self._release:
            self._nowait(self.client.release_nowait, sorted(set(self._release)))
            self._release = []
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
