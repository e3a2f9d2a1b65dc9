"""Store planning: which full blocks go to the pool this step, each given a reserved slot.

The life of one store (described here once; the other parts point to it):

1. ``SchedulerRole.build_connector_meta`` calls ``StorePlanner.plan`` with the step's
   ``SchedulerOutput``. Requests vLLM handed new blocks this step join the planner's queue;
   finished requests that still have full blocks to store (``tickets.Backlog.todo``) go first.
2. The planner cuts each request's newly full blocks into runs (``_plan_request``): keys in
   flight (``Tickets.keys_in_flight``), planned earlier this step, or remembered as committed
   (``Tickets.committed``) are skipped, so a key is stored once.
3. It takes writable slots for the runs from the client's stock of reservations
   (``SchedulerClient.take_slots``; the client refills the stock in the background, never in a
   step). Runs the stock cannot cover are cut (``_cut_runs``): planned again next step while a
   refill is coming (an empty grant only says this client's tickets are at their cap), else
   counted lost (``reserve_refused``: the daemon answered with an error).
4. ``Tickets.add`` records one ticket per group and step and returns its ``StoreSpec`` (slots,
   GPU block ids, keys, the grant), which goes to every worker in the step's ``StepMeta``.
5. Each worker (``worker.py``) submits a keyed store of its shard; the daemon binds each
   reserved slot to its key when the store arrives (dropping a duplicate of a key it holds),
   copies once the engine's compute stream reached the step, and commits a slot when every
   rank's shard has landed.
6. Each worker acks the ticket in ``WorkerAcks``; ``Tickets.acked`` resolves it once every rank
   has: committed keys are remembered (and become KV events), a failed rank aborts the slots
   and counts the blocks lost (``store_failed``), and a finished request with no ticket left is
   freed through ``tickets.Backlog``.

A request vLLM preempts loses its GPU blocks inside ``schedule()``, before the connector hears
of it, and resumes from token 0: its full blocks not yet planned (the planning queue lags on a
busy step) are planned in the step of the preemption (``plan``'s ``preempted``), whatever the
budget, found by their vLLM block hashes in the prefix cache they stay in until reused; those
vLLM already handed to another request in that step are counted lost (``preempted``).

The store policy (``store_policy``): ``eager`` stores a full block as soon as it is computed,
as above. ``lazy`` runs steps 1-2 the same way but, for requests that are not P/D hand-offs,
step 3 becomes "remember": ``lazy_store.LazyStore`` keeps (GPU block, key), and the block is
stored only when vLLM's prefix cache is about to evict it (``LazyStore.due``: it is within the
next step's reach from the head of vLLM's free queue, and pinned until its store lands), when
the engine has nothing to compute (an idle step: every remembered block), or at once when the
free queue is shorter than that reach (blocks freed then could be evicted before the next
step sees them). ``store_min_prefix_tokens``: requests shorter than that store nothing (P/D
hand-offs excepted).

Owns the planning queue and its budgets (a step never spends more than about
``STORE_PLAN_BUDGET_S`` planning, ``STORE_PRESSURE_BUDGET_S`` when vLLM is short of free
blocks; the rest waits, in order), the pieces a long prefill is cut
into, and the question of when a request's full blocks go (``blocks_to_gather``, the store
policy). Never waits for the daemon and never does per-block Python work on the hot path: the
work per block is C-level list, set and dict operations over each request's run of new blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain, compress, repeat
from typing import Any, Sequence

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.lazy_store import Due, LazyStore
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import StoreSpec
from kvpool.client.vllm.store_losses import PREEMPTED, RESERVE_REFUSED, StoreLosses
from kvpool.client.vllm.tickets import Backlog, Run, Tickets

_NOTHING: dict[bytes, None] = {}
# Store planning per step is bounded: a burst of prefills fills hundreds of blocks in one
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
# Under memory pressure (vLLM's free blocks fewer than one schedule() can take), the next
# schedule() may preempt a running request and hand its blocks to another before its store is
# planned: the step plans the queue for up to this long instead (the engine is about to
# recompute anyway; a block stored now is one it need not recompute).
STORE_PRESSURE_BUDGET_S = 1e-3


@dataclass(eq=False)
class _StepPlan:
    """What planning one step's stores reads and fills."""

    n_sched: dict[str, int]            # SchedulerOutput.num_scheduled_tokens
    spec_tokens: dict[str, list[int]]  # SchedulerOutput.scheduled_spec_decode_tokens
    tables: list[dict[str, list[Any]]] | None   # see _block_tables
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


class StorePlanner:
    """See the module docstring. Called from vLLM's scheduler thread only, once per step
    (``plan``); ``kv_cache_manager`` is vLLM's, bound after construction."""

    def __init__(self, groups: list[Any], block_tokens: int, client: Any, link: DaemonLink,
                 reqs: dict[str, ReqState], tickets: Tickets, backlog: Backlog,
                 losses: StoreLosses, lazy: LazyStore | None = None,
                 min_prefix_tokens: int = 0, horizon_blocks: int = 0) -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self.client = client
        self._link = link
        self._reqs = reqs
        self._tickets = tickets
        self._backlog = backlog
        self._losses = losses
        self._namespaces = [g.namespace for g in groups]
        self.kv_cache_manager: Any = None
        # Blocks a running request's stores gather before they go (see STORE_RUN_TOKENS);
        # each new request starts with this (a P/D producer with 1). With a state group, 1:
        # vLLM lets go of a decode's state block a step after it fills (it stays cached only
        # until reused), and such models' blocks are large (256 tokens and up).
        self.store_run = max(1, -(-STORE_RUN_TOKENS // block_tokens)) \
            if block_tokens and not any(g.state for g in groups) else 1
        # Requests with blocks to plan, oldest first (deferred by the step budget, or waiting
        # for slots): request id -> when it first waited.
        self.queue: OrderedDict[str, float] = OrderedDict()
        # store_policy "lazy" (None: eager), and what it needs to store a remembered block: per
        # GPU block id, the request and block index it holds (for the ticket and its KV event;
        # overwritten when the block id is remembered again, so bounded by the GPU's blocks),
        # and per lazy ticket, the GPU blocks it pins until it resolves.
        self.lazy = lazy
        self._lazy_owner: dict[int, tuple[ReqState, int]] = {}
        self._lazy_tickets: dict[int, list[int]] = {}
        self.min_prefix_tokens = min_prefix_tokens
        # Free blocks below which a step is under memory pressure (STORE_PRESSURE_BUDGET_S);
        # 0: never.
        self.pressure_blocks = horizon_blocks

    # ---- the store policy ------------------------------------------------------------------

    def blocks_to_gather(self, st: ReqState) -> int:
        """The store policy's one question: how many new full blocks ``st`` gathers before
        they are planned. Eager: a decoding request's run (see STORE_RUN_TOKENS); 1 (every
        full block goes the step it fills) for a prefill, prompt blocks left by a piece, or a
        finished request. Another policy replaces this method; nothing else decides when a
        request's blocks go."""
        req = st.request
        if st.finished or req.num_computed_tokens < req.num_prompt_tokens \
                or st.lo < req.num_prompt_tokens // self.block_tokens:
            return 1
        return st.store_run

    def below_min_prefix(self, st: ReqState) -> bool:
        """``st`` is too short to be stored at all (``store_min_prefix_tokens``; never a P/D
        hand-off). Judged on its tokens so far: a short prompt that grows past the threshold
        stores from its first block."""
        return not st.producer and st.request.num_tokens < self.min_prefix_tokens

    # ---- one step ----------------------------------------------------------------------------

    def plan(self, so: Any, step_started: float,
             preempted: Sequence[ReqState] = ()) -> list[StoreSpec]:
        """Newly full blocks of every scheduled request (and of finished ones waiting for
        slots), minus keys in flight or known to be in the pool, each given a reserved slot
        from the client's stock. Never waits: blocks the stock cannot cover yet are planned
        again next step (or skipped when the pool has no room).

        Only requests that vLLM handed new blocks this step are looked at (new and resumed
        ones, prefill chunks, and a decode at the step after its block filled: vLLM allocates
        the next block then, and the filled one's tokens are all known by then, also under
        async scheduling); a request that finishes with a full block not yet stored is taken
        in by the backlog (``request_finished``). They join a queue, which a step works
        through for ``STORE_PLAN_BUDGET_S`` (see there), after the backlog's, and at most
        until ``STORE_STEP_BUDGET_S`` after ``step_started`` (perf_counter). ``preempted``:
        requests vLLM preempted in this step's ``schedule()``, their cursors not yet reset;
        their unplanned full blocks go first, whatever the budget (see the module's docstring)."""
        if self._lazy_tickets:
            self._release_lazy()
        if self.kv_cache_manager is None or not self._link.ok():
            return []
        if self.lazy is not None:
            return self._plan_lazy(so, step_started, preempted)
        return self._plan_eager(so, step_started, preempted=preempted)

    def _plan_eager(self, so: Any, step_started: float,
                    remember: LazyStore | None = None,
                    preempted: Sequence[ReqState] = ()) -> list[StoreSpec]:
        """``plan`` for the queue and the backlog; with ``remember``, the runs of requests that
        are not P/D hand-offs are remembered there instead of stored (the lazy policy)."""
        queue = self.queue
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
            if filled > 0 and (filled >= st.store_run or self.blocks_to_gather(st) == 1):
                queue[rid] = now
        todo = self._backlog.todo
        if not queue and not todo and not preempted:
            return []
        if not preempted and not any(map(self.client.stock, self._namespaces)) \
                and any(map(self.client.reserving, self._namespaces)):
            # No slot in hand, a refill on its way: the queue waits for the next step,
            # without doing the work per request now.
            self.client.take_slots(self.groups[0].namespace, 0)     # (asks, if not yet)
            return []
        step = _StepPlan(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens,
                         self._block_tables(), [[] for _ in self.groups],
                         [set() for _ in self.groups],
                         frozenset(st.request.request_id for st in preempted))
        for st in preempted:
            self._plan_preempted(st, step)
        if self.pressure_blocks and \
                self.kv_cache_manager.block_pool.get_num_free_blocks() < self.pressure_blocks:
            stop_at = time.perf_counter() + STORE_PRESSURE_BUDGET_S
        else:
            stop_at = min(time.perf_counter() + STORE_PLAN_BUDGET_S,
                          step_started + STORE_STEP_BUDGET_S)
        # Finished requests hold GPU blocks for these stores: they go first. Those the budget
        # leaves wait in the backlog (bounded by store_wait_s, see Backlog.end).
        finished = self._plan_from(todo, step, stop_at, True)
        self._plan_from(queue, step, stop_at, not finished)
        # The rest wait for the next step, in order; those at the front that have waited too
        # long get a second, bounded budget (at least a late piece).
        overdue = now - STORE_DEFER_MAX_S
        if queue and next(iter(queue.values())) <= overdue:
            self._plan_from(queue, step, time.perf_counter() + STORE_OVERDUE_BUDGET_S, True,
                            waited_since=overdue, piece=STORE_LATE_PIECE_BLOCKS)
        if remember is not None:
            self._remember(remember, step)
        specs: list[StoreSpec] = []
        for gi, g in enumerate(self.groups):
            runs = step.wanted[gi]
            if not runs:
                continue
            total = sum(len(keys) for _, _, keys, _ in runs)
            refs, grant = self.client.take_slots(g.namespace, total)
            if len(refs) < total:
                runs = self._cut_runs(gi, g.namespace, runs, len(refs), now, step.preempted)
            if not runs:
                continue
            specs.append(self._tickets.add(gi, runs, refs, grant))
        for st in finished:
            if st.request.request_id in todo:
                continue            # cut short by the stock: planned again next step
            self._backlog.planned.append(st.request.request_id)
        return specs

    # ---- the lazy policy -------------------------------------------------------------------

    def _plan_lazy(self, so: Any, step_started: float,
                   preempted: Sequence[ReqState] = ()) -> list[StoreSpec]:
        """A lazy step: new full blocks are remembered (stored at once while the free queue is
        shorter than the eviction horizon); remembered blocks about to be evicted, or all of
        them on a step with nothing to compute, are stored."""
        lazy = self.lazy
        assert lazy is not None
        pool = self.kv_cache_manager.block_pool
        if lazy.num_pending:
            lazy.note_allocated(pool, handed_blocks(so))
        specs = self._plan_eager(so, step_started,
                                 None if lazy.at_risk(pool) else lazy, preempted)
        if not lazy.num_pending:
            return specs
        idle = not so.total_num_scheduled_tokens
        due = lazy.all_pending(pool) if idle else lazy.due(pool)
        if due:
            specs += self._store_due(pool, due)
        return specs

    def _remember(self, lazy: LazyStore, step: _StepPlan) -> None:
        """Take the runs of requests that are not P/D hand-offs out of ``step.wanted`` and
        remember their blocks; blocks it cannot track (no prefix-cache hash) stay planned."""
        pool = self.kv_cache_manager.block_pool
        owner = self._lazy_owner
        for gi, runs in enumerate(step.wanted):
            kept: list[Run] = []
            for st, index, keys, bids in runs:
                if st.producer:
                    kept.append((st, index, keys, bids))
                    continue
                owner.update(zip(bids, zip(repeat(st), index)))
                untracked = lazy.remember(pool, gi, bids, keys)
                if untracked:
                    now = {d.block_id for d in untracked}
                    pick = [j for j, b in enumerate(bids) if b in now]
                    kept.append((st, [index[j] for j in pick], [keys[j] for j in pick],
                                 [bids[j] for j in pick]))
            step.wanted[gi] = kept

    def _store_due(self, pool: Any, due: list[Due]) -> list[StoreSpec]:
        """Tickets for remembered blocks ``due`` (pinned by the lazy part), one per group.
        Blocks the stock cannot cover go back to being remembered (unpinned, still cached)."""
        per_group: list[list[Due]] = [[] for _ in self.groups]
        for d in due:
            per_group[d.group].append(d)
        specs: list[StoreSpec] = []
        lazy = self.lazy
        for gi, blocks in enumerate(per_group):
            if not blocks:
                continue
            refs, grant = self.client.take_slots(self.groups[gi].namespace, len(blocks))
            short = blocks[len(refs):]
            if short:
                bids = [d.block_id for d in short]
                lazy.release(pool, bids)
                lazy.remember(pool, gi, bids, [d.key for d in short])
                blocks = blocks[:len(refs)]
            if not blocks:
                continue
            runs: list[Run] = []
            for d in blocks:
                st, index = self._lazy_owner[d.block_id]
                runs.append((st, (index,), [d.key], [d.block_id]))
            spec = self._tickets.add(gi, runs, refs, grant)
            self._lazy_tickets[spec.ticket] = [d.block_id for d in blocks]
            specs.append(spec)
        return specs

    def _release_lazy(self) -> None:
        """Unpin the GPU blocks of lazy tickets every rank has reported (stored or failed)."""
        live = self._tickets.by_id
        done = [tid for tid in self._lazy_tickets if tid not in live]
        if done and self.kv_cache_manager is not None:
            pool = self.kv_cache_manager.block_pool
            self.lazy.release(pool, [b for tid in done for b in self._lazy_tickets.pop(tid)])

    def _plan_from(self, fifo: OrderedDict, step: _StepPlan, stop_at: float,
                   one_at_least: bool, waited_since: float | None = None,
                   piece: int | None = None) -> list[ReqState]:
        """Plan the requests at the front of ``fifo`` (taking them out) until ``stop_at``, a
        piece (``STORE_PIECE_BLOCKS``) at a time, the first whatever the time if
        ``one_at_least``; a request with blocks left after its piece stays at the front.
        With ``waited_since``, only requests queued by then; ``piece`` overrides the piece
        size. Returns those planned, still known."""
        planned: list[ReqState] = []
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

    def _plan_request(self, st: ReqState, step: _StepPlan, piece: int | None = None) -> bool:
        """Add ``st``'s newly full blocks to ``step.wanted`` (if they make a run of
        ``blocks_to_gather``), at most ``piece`` of them (all if None); True if more are left
        to plan."""
        if not st.keys.cacheable or st.loading or self.below_min_prefix(st):
            return False
        req = st.request
        rid = req.request_id
        done = req.num_computed_tokens + step.n_sched.get(rid, 0)
        spec_tokens = step.spec_tokens
        if spec_tokens and rid in spec_tokens:
            done -= len(spec_tokens[rid])
        n_full = min(done, req.num_tokens) // self.block_tokens
        if n_full < st.lo + self.blocks_to_gather(st):
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
            if g.state:
                bids = self._state_blocks(req, tables, g.index, lo, n_full)
                hi = lo + len(bids)
            elif tables is not None:
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
            inflight, taken = self._tickets.keys_in_flight[gi], step.seen[gi]
            known = self._known(gi, st)
            if 0 in bids or not inflight.keys().isdisjoint(keys) \
                    or not taken.isdisjoint(keys) or not known.keys().isdisjoint(keys):
                keep = self._to_store(gi, st, step, keys, bids)
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

    def _plan_preempted(self, st: ReqState, step: _StepPlan) -> None:
        """Add the full blocks of ``st``, preempted in this step, that were never planned to
        ``step.wanted``. vLLM freed its blocks (``req_to_blocks`` no longer has them) and set
        its computed tokens to 0; a full block it computed stays in vLLM's prefix cache, under
        its block hash, until it is handed out again, so the hash finds it. A block found
        there is computed, or computed by this step's forward, which the store's copy waits
        for. Blocks missing there that the request had computed were reused by this step's
        allocations: counted lost."""
        if not st.keys.cacheable or st.loading or self.below_min_prefix(st):
            return
        req = st.request
        hashes = req.block_hashes
        n = len(hashes)
        if n != req.num_tokens // self.block_tokens:
            # vLLM hashed at another block size (a hybrid model's groups): the blocks cannot
            # be matched to hashes one to one here; the request resumes from what was stored.
            return
        pool = self.kv_cache_manager.block_pool
        # A decoding request had computed every token but the last sampled one; a request cut
        # off mid-prefill, what its last block found shows.
        computed = (req.num_tokens - 1) // self.block_tokens if req.num_output_tokens else 0
        lost = 0
        for gi, g in enumerate(self.groups):
            lo = st.cursor[gi]
            if n <= lo:
                continue
            # 0 where the hash is no longer cached (as a null block: nothing to store)
            bids = [b[0].block_id if b else 0
                    for b in map(pool.get_cached_block, hashes[lo:n], repeat([g.index]))]
            if not g.state:     # (a state group keeps some boundaries only: nulls are not lost)
                found_to = next((len(bids) - i for i, b in enumerate(reversed(bids)) if b), 0)
                lost = max(lost, bids[:max(found_to, computed - lo)].count(0))
            st.cursor[gi] = n
            keys = st.keys.range(req, gi, lo, n)
            keep = self._to_store(gi, st, step, keys, bids)
            if not keep:
                continue
            keys = [keys[j] for j in keep]
            step.seen[gi].update(keys)
            step.wanted[gi].append((st, [lo + j for j in keep], keys, [bids[j] for j in keep]))
        st.lo = min(st.cursor)
        self._losses.add(PREEMPTED, lost)

    def _state_blocks(self, req: Any, tables: list[dict[str, list[Any]]] | None, group: int,
                      lo: int, hi: int) -> list[int]:
        """The GPU blocks holding the states of ``req``'s blocks ``[lo, hi)`` in vLLM state
        group ``group`` (0 where vLLM kept none): the request's table where it still holds
        one, else the block vLLM's prefix cache holds under that block's hash. In align mode
        vLLM frees a state block once the next state is computed (``remove_skipped_blocks``),
        often before a decode's store is planned; it stays in the prefix cache until handed out
        again (a store reading it then is flushed first: ``Tickets.reading``). vLLM 0.32 hashes
        a block a step after it fills, 0.33 in the step: either way a non-null table entry or a
        hash hit holds the state its prefix ends with."""
        if tables is not None:
            row = tables[group].get(req.request_id) or ()
            ids = [b.block_id for b in row[lo:hi]]
        else:
            ids = self.kv_cache_manager.get_block_ids(req.request_id)[group][lo:hi]
        ids += [0] * (hi - lo - len(ids))
        hashes = req.block_hashes
        if 0 not in ids or len(hashes) != req.num_tokens // self.block_tokens:
            return ids      # (hashed at another granularity: nothing to match)
        pool = self.kv_cache_manager.block_pool
        for j, b in enumerate(ids):
            if not b:
                hit = pool.get_cached_block(hashes[lo + j], [group])
                ids[j] = hit[0].block_id if hit else 0
        return ids

    def _known(self, gi: int, st: ReqState) -> dict[bytes, None]:
        """Keys of group ``gi`` that ``st`` need not store again: those known to be in the
        pool (a P/D hand-off stores every block: the decode side must find each one)."""
        return self._tickets.committed[gi] if not st.producer else _NOTHING

    def _to_store(self, gi: int, st: ReqState, step: _StepPlan, keys: list[bytes],
                  bids: list[int]) -> list[int]:
        """Indexes into ``keys``/``bids`` of the blocks to plan: a real block (not 0) whose key
        is neither in flight, nor planned this step, nor known to be in the pool."""
        inflight, taken, known = self._tickets.keys_in_flight[gi], step.seen[gi], \
            self._known(gi, st)
        return [j for j, (k, b) in enumerate(zip(keys, bids))
                if b and k not in inflight and k not in taken and k not in known]

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

    def _cut_runs(self, gi: int, namespace: bytes, runs: list[Run], n: int,
                  now: float, preempted: frozenset[str] = frozenset()) -> list[Run]:
        """The stock covers only ``n`` blocks: keep the runs' first ``n``; the others are
        planned again next step while slots are coming, else (reservations refused) skipped."""
        coming = self.client.reserving(namespace)
        out = []
        for st, index, keys, bids in runs:
            if n >= len(keys):
                out.append((st, index, keys, bids))
                n -= len(keys)
                continue
            if st.request.request_id in preempted:
                # Its blocks are free in vLLM: they cannot wait for the next step's slots.
                self._losses.add(PREEMPTED, len(keys) - n)
            elif coming:
                st.cursor[gi] = min(st.cursor[gi], index[n])
                st.lo = min(st.cursor)
                if st.finished:
                    self._backlog.todo[st.request.request_id] = None
                else:
                    self.queue.setdefault(st.request.request_id, now)
            else:
                self._losses.add(RESERVE_REFUSED, len(keys) - n)
            if n:
                out.append((st, index[:n], keys[:n], bids[:n]))
                n = 0
        return out
