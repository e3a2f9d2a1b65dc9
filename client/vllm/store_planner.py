"""Store planning: which full blocks go to the pool this step, each given a ticket.

The life of one store (described here once; the other parts point to it):

1. ``SchedulerRole.build_connector_meta`` calls ``StorePlanner.plan`` with the step's
   ``SchedulerOutput``. Requests vLLM handed new blocks this step join the planner's queue;
   finished requests that still have full blocks to store (kept by ``backlog.py``) go first.
2. The planner cuts each request's newly full blocks into runs (``_plan_request``): keys in
   flight (``StoreBatches.keys_in_flight``), planned earlier this step, or remembered as
   committed (``StoreBatches.committed``) are skipped, so a key is stored once.
3. It takes a ticket for each block from the client's stock (``SchedulerClient.take_slots``:
   tickets the daemon granted ahead of need, bound to no key or slot yet; the client asks for
   more in the background, never in a step). Runs the stock cannot cover are cut
   (``_cut_runs``): planned again next step while more tickets are coming (an empty grant only
   says this client holds as many as it may), else counted lost (``reserve_refused``: the
   daemon answered the reservation with an error).
4. ``StoreBatches.add`` records one store batch per group and step and returns its
   ``StoreSpec`` (tickets, GPU block ids, keys, the daemon life that granted the tickets),
   which goes to every worker in the step's ``StepMeta``.
5. Each worker (``worker.py``) submits a keyed store of its shard; the daemon gives each
   ticket a slot for its key when the first rank's store arrives (dropping a duplicate of a key
   it holds), copies once the engine's compute stream reached the step, and commits a slot
   when every rank's shard has landed.
6. Each worker acks the batch in ``WorkerAcks``; ``StoreBatches.acked`` resolves it once every
   rank has: committed keys are remembered (and become KV events), a failed rank aborts the
   tickets and counts the blocks lost (``store_failed``), and returns the requests with no
   batch left: a finished one is freed (``StepMeta.free_now``) unless the backlog still holds
   it.

A request vLLM preempts loses its GPU blocks inside ``schedule()``, before the connector hears
of it, and resumes from token 0: its full blocks not yet planned (the planning queue lags on a
busy step) are planned in the step of the preemption (``plan``'s ``preempted``), whatever the
budget, found by their vLLM block hashes in the prefix cache they stay in until reused; those
vLLM already handed to another request in that step are counted lost (``preempted``). The
same goes for a sliding-window group's blocks that vLLM freed as they left the window while
their store waited (``_refind_window_blocks``; lost ones count as ``window_freed``).

The store policy (``store_policy``): ``eager`` stores a full block as soon as it is computed,
as above. ``lazy`` runs steps 1-2 the same way but, for requests that are not P/D hand-offs,
step 3 becomes "remember" (``lazy_store.LazyPolicy``): ``LazyStore`` keeps (GPU block, key),
and the block is
stored only when vLLM's prefix cache is about to evict it (``LazyStore.due``: it is within the
next step's reach from the head of vLLM's free queue, and pinned until its store lands), when
the engine has nothing to compute (an idle step: every remembered block), or at once when the
free queue is shorter than that reach (blocks freed then could be evicted before the next
step sees them). ``store_min_prefix_tokens``: requests shorter than that store nothing (P/D
hand-offs excepted).

Owns each request's store cursor (``StoreCursor``: the next block to store per group; only
this module writes it, the role moves it through ``restart``), the planning queues of running
and of finished requests and how the budgets are spent on them (``budgets.py``: a step never
spends more than about ``Budgets.plan_s`` planning, ``Budgets.pressure_s`` when vLLM is short of
free blocks; the rest waits, in order), the pieces a long prefill is cut into, and the question
of when a request's full blocks go (``blocks_to_gather``, the store policy). Never waits for the
daemon and never does per-block Python work on the hot path: the work per block is C-level
list, set and dict operations over each request's run of new blocks.
"""


from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain, compress, repeat
from typing import TYPE_CHECKING, Any, Collection, Sequence

from kvpool.client.vllm.budgets import Budgets
from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.hybrid import state_block_ids
from kvpool.client.vllm.lazy_store import LazyPolicy
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import StoreSpec
from kvpool.client.vllm.store_batches import Run, StoreBatches
from kvpool.client.vllm.store_losses import (PREEMPTED, RESERVE_REFUSED, WINDOW_FREED,
                                              StoreLosses)

if TYPE_CHECKING:
    from kvpool.client.vllm.loads import Loads

_NOTHING: dict[bytes, None] = {}
# Store planning per step is bounded (Budgets.plan_s): a step plans requests, in the order
# their blocks filled, until the budget is spent (at least one piece of one request); the
# others wait for the next step, their blocks still allocated to them (a request that finishes
# meanwhile keeps them, in the backlog, until they are planned or Budgets.store_wait_s passed).
# While the queue's front has waited Budgets.overdue_after_s, a step spends Budgets.overdue_s
# more on it, in late pieces (at least one).
# A long prompt's prefill chunk fills hundreds of blocks in one step (8192 tokens: 512 blocks
# of 16): a request is planned in pieces of at most this many blocks, so the budget is checked
# between pieces and the rest of its blocks wait at the front of the queue.
STORE_PIECE_BLOCKS = 32
# A step whose budget is spent before planning starts still plans one piece, so the queue
# always moves, but a small one: this many blocks (~25 us).
STORE_LATE_PIECE_BLOCKS = 8
# A decoding request's new blocks are planned once they add up to this many tokens: a decode
# fills one block every block_size steps, so with 16-token blocks a batch takes 8 of them
# instead of 1, which cuts the per-request work of decode steps (hashing stays per block).
# Prompt blocks are planned as their prefill chunk fills them. Finished requests (the
# backlog) and P/D producers plan whatever they have.
STORE_RUN_TOKENS = 128


@dataclass(eq=False, slots=True)
class StoreCursor:
    """Where one request's stores stand. Written only by ``StorePlanner``."""

    st: ReqState
    cursor: list[int]          # per group: next block to store (those before need no store)
    lo: int = 0                # min(cursor): a request with no block past it has none to store
    run: int = 1               # blocks a running request's store waits to gather (1: producer)
    pooled: int = 0            # leading blocks it loaded from the pool (held there)


@dataclass(eq=False)
class _StepPlan:
    """What planning one step's stores reads and fills."""

    n_sched: dict[str, int]            # SchedulerOutput.num_scheduled_tokens
    spec_tokens: dict[str, list[int]]  # SchedulerOutput.scheduled_spec_decode_tokens
    manager: Any                       # vLLM's KVCacheManager
    tables: list[dict[str, list[Any]]] | None   # see block_tables
    wanted: list[list[Run]]            # per group: runs to store
    seen: list[set[bytes]]             # per group: keys planned this step
    preempted: frozenset[str] = frozenset()     # ids of requests preempted this step


def handed_blocks(so: Any) -> list[int]:
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


def block_tables(manager: Any) -> list[dict[str, list[Any]]] | None:
    """Per vLLM KV-cache group, the request -> blocks map of its manager, so a run of new
    blocks costs its length rather than the request's whole table
    (``KVCacheManager.get_block_ids`` lists every block of every group); None where the
    manager is shaped otherwise (then that public call is used)."""
    try:
        return [m.req_to_blocks for m in manager.coordinator.single_type_managers]
    except AttributeError:
        return None


class StorePlanner:
    """See the module docstring. Called from vLLM's scheduler thread only: once per step
    (``plan``), and by the role when a request's cursor moves."""

    def __init__(self, groups: list[Any], block_tokens: int, client: Any, link: DaemonLink,
                 batches: StoreBatches, losses: StoreLosses, budgets: Budgets, loads: "Loads",
                 lazy: LazyPolicy | None = None, min_prefix_tokens: int = 0,
                 horizon_blocks: int = 0) -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self.client = client
        self._link = link
        self._batches = batches
        self._losses = losses
        self._budgets = budgets
        self._clock = budgets.clock
        self._loads = loads
        self._namespaces = [g.namespace for g in groups]
        # Blocks a running request's stores gather before they go (see STORE_RUN_TOKENS);
        # each new request starts with this (a P/D producer with 1). With a state group, 1:
        # vLLM lets go of a decode's state block a step after it fills (it stays cached only
        # until reused), and such models' blocks are large (256 tokens and up).
        self.store_run = max(1, -(-STORE_RUN_TOKENS // block_tokens)) \
            if block_tokens and not any(g.state for g in groups) else 1
        self._cursors: dict[str, StoreCursor] = {}
        # Requests with blocks to plan, oldest first (deferred by the step budget, or waiting
        # for tickets): request id -> when it first waited. Finished ones the backlog keeps
        # (todo) go first, in the order they finished.
        self.queue: OrderedDict[str, float] = OrderedDict()
        self.todo: OrderedDict[str, None] = OrderedDict()
        self.lazy = lazy          # store_policy "lazy" (None: eager)
        self.min_prefix_tokens = min_prefix_tokens
        # Free blocks below which a step is under memory pressure (Budgets.pressure_s);
        # 0: never.
        self.pressure_blocks = horizon_blocks

    # ---- a request's cursor ------------------------------------------------------------------

    def track(self, st: ReqState) -> None:
        """``st`` is new: it stores from block 0 (a P/D hand-off every block as it fills)."""
        self._cursors[st.request.request_id] = StoreCursor(
            st, [0] * len(self.groups), run=1 if st.producer else self.store_run)

    def cursor(self, rid: str) -> StoreCursor | None:
        """``rid``'s cursor (read it, never write it)."""
        return self._cursors.get(rid)

    def restart(self, rid: str, block: int, pooled: int | None = None) -> None:
        """Store ``rid``'s blocks from ``block`` on in every group (those before need no
        store); ``pooled``: the leading blocks its load brought in from the pool."""
        c = self._cursors.get(rid)
        if c is None:
            return
        c.cursor = [block] * len(c.cursor)
        c.lo = block
        if pooled is not None:
            c.pooled = pooled

    def pooled(self, rid: str) -> int:
        c = self._cursors.get(rid)
        return c.pooled if c is not None else 0

    def unstored(self, rid: str) -> int:
        """Full blocks of ``rid`` not planned yet (0 for a request that cannot be pooled)."""
        c = self._cursors.get(rid)
        if c is None or not c.st.keys.cacheable:
            return 0
        return max(0, c.st.full_blocks(self.block_tokens) - c.lo)

    def queue_finished(self, rid: str) -> None:
        """``rid`` finished with blocks to plan: plan them first from now on."""
        self.todo[rid] = None

    def unqueue_finished(self, rid: str) -> int:
        """``rid``'s blocks still unplanned will not be (its wait is over): how many."""
        self.todo.pop(rid, None)
        return self.unstored(rid)

    def forget(self, rid: str) -> None:
        self._cursors.pop(rid, None)
        self.queue.pop(rid, None)
        self.todo.pop(rid, None)

    def tracked(self) -> Collection[str]:
        return self._cursors.keys() | self.queue.keys() | self.todo.keys()

    # ---- the store policy ------------------------------------------------------------------

    def blocks_to_gather(self, rid: str) -> int:
        """The store policy's one question: how many new full blocks ``rid`` gathers before
        they are planned. Eager: a decoding request's run (see STORE_RUN_TOKENS); 1 (every
        full block goes the step it fills) for a prefill, prompt blocks left by a piece, or a
        finished request. Another policy replaces this method; nothing else decides when a
        request's blocks go."""
        return self._gather(self._cursors[rid])

    def _gather(self, c: StoreCursor) -> int:
        req = c.st.request
        if c.st.finished or req.num_computed_tokens < req.num_prompt_tokens \
                or c.lo < req.num_prompt_tokens // self.block_tokens:
            return 1
        return c.run

    def below_min_prefix(self, st: ReqState) -> bool:
        """``st`` is too short to be stored at all (``store_min_prefix_tokens``; never a P/D
        hand-off). Judged on its tokens so far: a short prompt that grows past the threshold
        stores from its first block."""
        return not st.producer and st.request.num_tokens < self.min_prefix_tokens

    # ---- one step ----------------------------------------------------------------------------

    def plan(self, so: Any, step_started: float, preempted: Sequence[ReqState],
             manager: Any) -> tuple[list[StoreSpec], list[str]]:
        """Newly full blocks of every scheduled request (and of finished ones waiting for
        tickets), minus keys in flight or known to be in the pool, each given a ticket from
        the client's stock. Never waits: blocks the stock cannot cover yet are planned
        again next step (or skipped when the pool has no room). Returns the specs for the
        step's metadata and the finished requests whose blocks are all planned now.

        Only requests that vLLM handed new blocks this step are looked at (new and resumed
        ones, prefill chunks, and a decode at the step after its block filled: vLLM allocates
        the next block then, and the filled one's tokens are all known by then, also under
        async scheduling); a request that finishes with a full block not yet stored is taken
        in by the backlog (``request_finished``). They join a queue, which a step works
        through for ``Budgets.plan_s``, after the finished ones', and at most until
        ``Budgets.step_s`` after ``step_started`` (on the budgets' clock). ``preempted``:
        requests vLLM preempted in this step's ``schedule()``, their cursors not yet reset;
        their unplanned full blocks go first, whatever the budget (see the module's
        docstring). ``manager``: vLLM's KV-cache manager (None until vLLM bound it)."""
        lazy = self.lazy
        if lazy is not None:
            lazy.release_done(manager.block_pool if manager is not None else None)
        if manager is None or not self._link.ok():
            return [], []
        if lazy is not None:
            return self._plan_lazy(lazy, so, step_started, preempted, manager)
        return self._plan_eager(so, step_started, manager, None, preempted)

    def _plan_lazy(self, lazy: LazyPolicy, so: Any, step_started: float,
                   preempted: Sequence[ReqState], manager: Any
                   ) -> tuple[list[StoreSpec], list[str]]:
        """A lazy step: new full blocks are remembered (stored at once while the free queue is
        shorter than the eviction horizon); remembered blocks about to be evicted, or all of
        them on a step with nothing to compute, are stored."""
        store = lazy.store
        pool = manager.block_pool
        if store.num_pending:
            store.note_allocated(pool, handed_blocks(so))
        specs, planned = self._plan_eager(so, step_started, manager,
                                          None if store.at_risk(pool) else lazy, preempted)
        if not store.num_pending:
            return specs, planned
        idle = not so.total_num_scheduled_tokens
        due = store.all_pending(pool) if idle else store.due(pool)
        if due:
            specs += lazy.store_due(pool, due)
        return specs, planned

    def _plan_eager(self, so: Any, step_started: float, manager: Any,
                    remember: LazyPolicy | None, preempted: Sequence[ReqState]
                    ) -> tuple[list[StoreSpec], list[str]]:
        """``plan`` for the queues; with ``remember``, the runs of requests that are not P/D
        hand-offs are remembered there instead of stored (the lazy policy)."""
        queue, todo = self.queue, self.todo
        clock, budgets = self._clock, self._budgets
        now = clock()
        cached = so.scheduled_cached_reqs
        get, n_sched_of, bt = self._cursors.get, so.num_scheduled_tokens, self.block_tokens
        # Only those with a run of blocks to store join (most decodes that got a new block
        # have not gathered one yet); a rough test, _plan_request decides.
        for rid in chain((r.req_id for r in so.scheduled_new_reqs),
                         compress(cached.req_ids, cached.new_block_ids)):
            if rid in queue:
                continue
            c = get(rid)
            if c is None:
                continue
            filled = (c.st.request.num_computed_tokens + n_sched_of.get(rid, 0)) // bt - c.lo
            if filled > 0 and (filled >= c.run or self._gather(c) == 1):
                queue[rid] = now
        if not queue and not todo and not preempted:
            return [], []
        if not preempted and not any(map(self.client.stock, self._namespaces)) \
                and any(map(self.client.reserving, self._namespaces)):
            # No ticket in hand, more on their way: the queue waits for the next step,
            # without doing the work per request now.
            self.client.take_slots(self.groups[0].namespace, 0)     # (asks, if not yet)
            return [], []
        step = _StepPlan(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens, manager,
                         block_tables(manager), [[] for _ in self.groups],
                         [set() for _ in self.groups],
                         frozenset(st.request.request_id for st in preempted))
        for st in preempted:
            c = get(st.request.request_id)
            if c is not None:
                self._plan_preempted(c, step)
        if self.pressure_blocks and \
                manager.block_pool.get_num_free_blocks() < self.pressure_blocks:
            stop_at = clock() + budgets.pressure_s
        else:
            stop_at = min(clock() + budgets.plan_s, step_started + budgets.step_s)
        # Finished requests hold GPU blocks for these stores: they go first. Those the budget
        # leaves wait in the backlog (bounded by store_wait_s, see Backlog.end).
        finished = self._plan_from(todo, step, stop_at, True)
        self._plan_from(queue, step, stop_at, not finished)
        # The rest wait for the next step, in order; those at the front that have waited too
        # long get a second, bounded budget (at least a late piece).
        overdue = now - budgets.overdue_after_s
        if queue and next(iter(queue.values())) <= overdue:
            self._plan_from(queue, step, clock() + budgets.overdue_s, True,
                            waited_since=overdue, piece=STORE_LATE_PIECE_BLOCKS)
        if remember is not None:
            step.wanted = remember.remember(manager.block_pool, step.wanted)
        specs: list[StoreSpec] = []
        for gi, g in enumerate(self.groups):
            runs = step.wanted[gi]
            if not runs:
                continue
            total = sum(len(keys) for _, _, keys, _ in runs)
            tickets, granted_by = self.client.take_slots(g.namespace, total)
            if len(tickets) < total:
                runs = self._cut_runs(gi, g.namespace, runs, len(tickets), now, step.preempted)
            if not runs:
                continue
            specs.append(self._batches.add(gi, runs, tickets, granted_by))
        # (one cut short by the stock is back in todo: planned again next step)
        planned = [c.st.request.request_id for c in finished
                   if c.st.request.request_id not in todo]
        return specs, planned

    def _plan_from(self, fifo: OrderedDict, step: _StepPlan, stop_at: float,
                   one_at_least: bool, waited_since: float | None = None,
                   piece: int | None = None) -> list[StoreCursor]:
        """Plan the requests at the front of ``fifo`` (taking them out) until ``stop_at`` (on
        the budgets' clock; reaching it counts as spent), a piece (``STORE_PIECE_BLOCKS``) at a
        time, the first whatever the time if ``one_at_least``; a request with blocks left after
        its piece stays at the front. With ``waited_since``, only requests queued by then;
        ``piece`` overrides the piece size. Returns those planned, still known."""
        planned: list[StoreCursor] = []
        get = self._cursors.get
        while fifo:
            if waited_since is not None and next(iter(fifo.values())) > waited_since:
                break
            late = self._clock() >= stop_at
            if late and not one_at_least:
                break
            one_at_least = False
            rid, since = fifo.popitem(last=False)
            c = get(rid)
            if c is not None:
                if self._plan_request(c, step, piece or (STORE_LATE_PIECE_BLOCKS if late
                                                         else STORE_PIECE_BLOCKS)):
                    fifo[rid] = since
                    fifo.move_to_end(rid, last=False)
                if not planned or planned[-1] is not c:
                    planned.append(c)
        return planned

    def _plan_request(self, c: StoreCursor, step: _StepPlan, piece: int | None = None) -> bool:
        """Add the request's newly full blocks to ``step.wanted`` (if they make a run of
        ``blocks_to_gather``), at most ``piece`` of them (all if None); True if more are left
        to plan."""
        st = c.st
        req = st.request
        rid = req.request_id
        if not st.keys.cacheable or self._loads.busy(rid) or self.below_min_prefix(st):
            return False
        done = req.num_computed_tokens + step.n_sched.get(rid, 0)
        spec_tokens = step.spec_tokens
        if spec_tokens and rid in spec_tokens:
            done -= len(spec_tokens[rid])
        n_full = min(done, req.num_tokens) // self.block_tokens
        if n_full < c.lo + self._gather(c):
            return False
        more = piece is not None and n_full > c.lo + piece
        if more:
            n_full = c.lo + piece
        tables, cursor = step.tables, c.cursor
        for gi, g in enumerate(self.groups):
            lo = cursor[gi]
            if n_full <= lo:
                continue
            cursor[gi] = n_full
            if g.state:
                bids = state_block_ids(req, step.manager, step.tables, g.index, lo, n_full,
                                       self.block_tokens)
                hi = lo + len(bids)
            elif tables is not None:
                blocks = tables[g.index].get(rid) or ()
                hi = min(n_full, len(blocks))
                bids = [b.block_id for b in blocks[lo:hi]]
            else:
                ids = step.manager.get_block_ids(rid)[g.index]
                hi = min(n_full, len(ids))
                bids = ids[lo:hi]
            if hi <= lo:
                continue
            if g.window_blocks is not None and 0 in bids:
                bids = self._refind_window_blocks(st, step.manager, g.index, lo, bids)
            keys = st.keys.range(req, gi, lo, hi)
            inflight, taken = self._batches.keys_in_flight[gi], step.seen[gi]
            known = self._known(gi, st)
            if 0 in bids or not inflight.keys().isdisjoint(keys) \
                    or not taken.isdisjoint(keys) or not known.keys().isdisjoint(keys):
                keep = new_blocks(keys, bids, inflight, taken, known)
                if not keep:
                    continue
                index: Sequence[int] = [lo + j for j in keep]
                keys = [keys[j] for j in keep]
                bids = [bids[j] for j in keep]
            else:
                index = range(lo, hi)
            taken.update(keys)
            step.wanted[gi].append((st, index, keys, bids))
        c.lo = min(cursor)
        return more

    def _plan_preempted(self, c: StoreCursor, step: _StepPlan) -> None:
        """Add the full blocks of a request preempted in this step that were never planned to
        ``step.wanted``. vLLM freed its blocks (``req_to_blocks`` no longer has them) and set
        its computed tokens to 0; a full block it computed stays in vLLM's prefix cache, under
        its block hash, until it is handed out again, so the hash finds it. A block found
        there is computed, or computed by this step's forward, which the store's copy waits
        for. Blocks missing there that the request had computed were reused by this step's
        allocations: counted lost."""
        st = c.st
        req = st.request
        if not st.keys.cacheable or self._loads.busy(req.request_id) \
                or self.below_min_prefix(st):
            return
        hashes = req.block_hashes
        n = len(hashes)
        if n != req.num_tokens // self.block_tokens:
            # vLLM hashed at another block size (a hybrid model's groups): the blocks cannot
            # be matched to hashes one to one here; the request resumes from what was stored.
            return
        pool = step.manager.block_pool
        # A decoding request had computed every token but the last sampled one; a request cut
        # off mid-prefill, what its last block found shows.
        computed = (req.num_tokens - 1) // self.block_tokens if req.num_output_tokens else 0
        lost = 0
        for gi, g in enumerate(self.groups):
            lo = c.cursor[gi]
            if n <= lo:
                continue
            # 0 where the hash is no longer cached (as a null block: nothing to store)
            bids = cached_block_ids(pool, hashes[lo:n], g.index)
            if not g.state:     # (a state group keeps some boundaries only: nulls are not lost)
                found_to = next((len(bids) - i for i, b in enumerate(reversed(bids)) if b), 0)
                lost = max(lost, bids[:max(found_to, computed - lo)].count(0))
            c.cursor[gi] = n
            keys = st.keys.range(req, gi, lo, n)
            keep = new_blocks(keys, bids, self._batches.keys_in_flight[gi], step.seen[gi],
                              self._known(gi, st))
            if not keep:
                continue
            keys = [keys[j] for j in keep]
            step.seen[gi].update(keys)
            step.wanted[gi].append((st, [lo + j for j in keep], keys, [bids[j] for j in keep]))
        c.lo = min(c.cursor)
        self._losses.add(PREEMPTED, lost)

    def _refind_window_blocks(self, st: ReqState, manager: Any, group: int, lo: int,
                              bids: list[int]) -> list[int]:
        """``bids`` (blocks ``lo``... of a sliding-window group) with the null ones the request
        computed itself found again. Their store waited (tickets, the planning budget) and
        vLLM freed them meanwhile, as they left the window; a freed block stays in vLLM's
        prefix cache under its block hash until handed out again (a store still reading one
        then is finished first: ``StoreBatches.reading``). Those handed out already are
        counted lost (``window_freed``). Nulls before ``computed_from`` were never this
        request's (its prefix hits keep only the window). Only here is there a loop per
        block: null blocks past ``computed_from`` appear only when a store waited."""
        req = st.request
        hashes = req.block_hashes
        first = max(lo, st.computed_from)
        todo = [j for j in range(first - lo, len(bids)) if not bids[j]]
        if not todo:
            return bids
        if len(hashes) != req.num_tokens // self.block_tokens:
            # vLLM hashes at another block size (a model with a state group): no match by
            # position here, so none is found
            self._losses.add(WINDOW_FREED, len(todo))
            return bids
        found = cached_block_ids(manager.block_pool, [hashes[lo + j] for j in todo], group)
        out = list(bids)
        for j, b in zip(todo, found):
            out[j] = b
        self._losses.add(WINDOW_FREED, found.count(0))
        return out

    def _known(self, gi: int, st: ReqState) -> dict[bytes, None]:
        """Keys of group ``gi`` that ``st`` need not store again: those known to be in the
        pool (a P/D hand-off stores every block: the decode side must find each one)."""
        return self._batches.committed[gi] if not st.producer else _NOTHING

    def _cut_runs(self, gi: int, namespace: bytes, runs: list[Run], n: int,
                  now: float, preempted: frozenset[str] = frozenset()) -> list[Run]:
        """The stock covers only ``n`` blocks: keep the runs' first ``n``; the others are
        planned again next step while tickets are coming, else (reservations refused)
        skipped."""
        coming = self.client.reserving(namespace)
        out = []
        for st, index, keys, bids in runs:
            if n >= len(keys):
                out.append((st, index, keys, bids))
                n -= len(keys)
                continue
            rid = st.request.request_id
            c = self._cursors.get(rid)
            if rid in preempted:
                # Its blocks are free in vLLM: they cannot wait for the next step's tickets.
                self._losses.add(PREEMPTED, len(keys) - n)
            elif coming and c is not None:
                c.cursor[gi] = min(c.cursor[gi], index[n])
                c.lo = min(c.cursor)
                if st.finished:
                    self.todo[rid] = None
                else:
                    self.queue.setdefault(rid, now)
            elif not coming:
                self._losses.add(RESERVE_REFUSED, len(keys) - n)
            if n:
                out.append((st, index[:n], keys[:n], bids[:n]))
                n = 0
        return out


def cached_block_ids(block_pool: Any, hashes: Sequence[Any], group: int) -> list[int]:
    """The GPU block vLLM's prefix cache holds for each of ``hashes`` in KV cache group
    ``group``, 0 (the null block) where it holds none: a block freed but not handed out again
    yet keeps its hash there."""
    return [b[0].block_id if b else 0
            for b in map(block_pool.get_cached_block, hashes, repeat([group]))]


def new_blocks(keys: list[bytes], bids: list[int], inflight: dict[bytes, Any],
               taken: Any, known: dict[bytes, None]) -> list[int]:
    """Indexes into ``keys``/``bids`` of the blocks to plan: a real block (not 0) whose key is
    neither in flight, nor planned this step, nor known to be in the pool."""
    return [j for j, (k, b) in enumerate(zip(keys, bids))
            if b and k not in inflight and k not in taken and k not in known]
