"""``LazyStore``: which GPU blocks must be stored now so that lazy storing loses nothing.

Under ``store_policy = "lazy"`` the scheduler role stores a full block only when vLLM's GPU
prefix cache is about to drop it, instead of as soon as it is computed. This module owns the
one question that needs vLLM's block pool for: which of the blocks the planner remembered are
about to be evicted. It keeps, per GPU block id, the kvpool key the planner would have stored
and the vLLM block hash the block held then (a block evicted and reused gets another hash, or
none, so the pair tells "still ours" from "gone" without hooks into vLLM).

Why a walk from the head of the free queue is enough: vLLM's ``BlockPool.get_new_blocks`` pops
blocks from the head of ``free_block_queue`` and drops the prefix-cache entry of each one it
pops; freed blocks without a hash are put at the head and cached ones at the tail. So the next
``n`` allocations evict exactly the cached blocks among the first ``n`` nodes of that queue, and
an uncached free block at the head absorbs one allocation. The horizon therefore counts queue
positions, cached or not, and the walk costs O(horizon + due), never O(GPU blocks).

Blocks named due are pinned at once (``BlockPool.touch`` takes them out of the free queue) so
that neither the next step's allocations nor its compute can overwrite them while the store is
in flight; the caller releases each one with ``release`` when its store landed or was given up.

``LazyPolicy`` is the planner's side of the policy: it remembers the blocks the planner would
store, and turns the due ones into store batches of their own.

Only the scheduler thread calls them, inside vLLM's scheduler hooks; they do no I/O and talk
to the daemon only through the client's stock of tickets (``take_slots``, never waiting).
"""

from __future__ import annotations

from itertools import islice, repeat
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvpool.client.vllm.requests import ReqState
    from kvpool.client.vllm.specs import StoreSpec
    from kvpool.client.vllm.store_batches import Run, StoreBatches

# Reasons a remembered block was never stored, the keys of ``LazyStore.dropped``.
# "evicted": the block lost its prefix-cache entry before it came due: vLLM reused it (a step
# allocated more than the horizon, or freed blocks landed inside it) or dropped the entry in
# place (``evict_blocks`` after a failed load). "reset": the prefix cache was reset (new weights),
# so the remembered KV is stale anyway.
EVICTED = "evicted"
RESET = "reset"


class Due(NamedTuple):
    """A block the caller must store now: ``group`` is the planner's group slot."""

    group: int
    block_id: int
    key: bytes


class _Entry(NamedTuple):
    group: int
    key: bytes
    block_hash: Any  # vLLM's BlockHashWithGroupId (bytes); compared, never interpreted


def eviction_horizon(max_num_batched_tokens: int, max_num_seqs: int,
                     block_sizes: Sequence[int], lookahead_tokens: int = 0) -> int:
    """Most blocks one ``schedule()`` can take from the free queue, over every KV-cache group.

    A step schedules at most ``max_num_batched_tokens`` new tokens over at most
    ``max_num_seqs`` requests; rounding each request's share up to whole blocks adds at most
    one block per request, and each request also gets slots for its speculative lookahead.
    Prefix-cache hits take blocks out of the queue without evicting them. All groups draw from
    one block pool, so their needs add up.
    """
    total = 0
    for bs in block_sizes:
        per_seq = 1 + -(-lookahead_tokens // bs)
        total += -(-max_num_batched_tokens // bs) + max_num_seqs * per_seq
    return total


def horizon_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> int:
    """``eviction_horizon`` of an engine, read from its configs."""
    sc = vllm_config.scheduler_config
    return eviction_horizon(
        sc.max_num_batched_tokens, sc.max_num_seqs,
        [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups],
        int(getattr(vllm_config, "num_lookahead_tokens", 0) or 0))


class LazyStore:
    """Remembered-but-unstored GPU blocks, and which of them are about to be evicted.

    One per scheduler role; called only from vLLM's scheduler thread. ``horizon_blocks`` is the
    number of free-queue positions the next ``schedule()`` can consume (``horizon_for``): every
    remembered block within that many positions of the head is due. Each method's cost is
    proportional to the blocks it is given or returns, plus the horizon for ``due``.
    """

    def __init__(self, horizon_blocks: int) -> None:
        if horizon_blocks < 1:
            raise ValueError(f"horizon_blocks must be at least 1, got {horizon_blocks}")
        self.horizon_blocks = horizon_blocks
        # Blocks remembered and not yet handed out, by GPU block id: a block id holds one block
        # of one group at a time, since all groups share vLLM's block pool.
        self._pending: dict[int, _Entry] = {}
        # The same key may sit in two GPU blocks (two requests computed it at once).
        self._by_key: dict[bytes, set[int]] = {}
        # Blocks handed out by due/all_pending, pinned until release.
        self._in_flight: dict[int, _Entry] = {}
        self.dropped: dict[str, int] = {EVICTED: 0, RESET: 0}

    # ---- what the planner tells it -------------------------------------------------------

    def remember(self, block_pool: "BlockPool", group: int, block_ids: Sequence[int],
                 keys: Sequence[bytes]) -> list[Due]:
        """Track full computed blocks that eager would store now; store them when due instead.

        Returns the blocks it cannot track, which the caller must store now as eager would:
        a block with no prefix-cache hash (vLLM caching off, or not cached yet) has nothing that
        would tell its eviction apart from its reuse. Null blocks (sliding-window holes) hold
        nothing and are skipped. Remembering a block again is a no-op.
        """
        assert len(block_ids) == len(keys)
        untracked: list[Due] = []
        blocks = block_pool.blocks
        for bid, key in zip(block_ids, keys):
            block = blocks[bid]
            if block.is_null or bid in self._in_flight:
                continue
            h = block.block_hash
            if h is None:
                untracked.append(Due(group, bid, key))
                continue
            old = self._pending.get(bid)
            if old is not None:
                if old.block_hash == h:
                    continue
                # Its block id came back with another hash: the old block was evicted unseen.
                self._drop(bid, EVICTED)
            self._pending[bid] = _Entry(group, key, h)
            self._by_key.setdefault(key, set()).add(bid)
        return untracked

    def forget(self, keys: Iterable[bytes]) -> None:
        """Stop tracking these keys: stored another way (eager hand-off) or already in the pool."""
        for key in keys:
            for bid in self._by_key.pop(key, ()):
                del self._pending[bid]

    def note_allocated(self, block_pool: "BlockPool", block_ids: Iterable[int]) -> None:
        """Count remembered blocks that vLLM has just reused (the step's new block ids).

        A newly allocated block that still holds its remembered hash is a prefix-cache hit,
        not an eviction: it stays remembered and comes back to the free queue later.
        """
        blocks = block_pool.blocks
        for bid in block_ids:
            entry = self._pending.get(bid)
            if entry is not None and blocks[bid].block_hash != entry.block_hash:
                self._drop(bid, EVICTED)

    # ---- what it tells the planner -------------------------------------------------------

    def due(self, block_pool: "BlockPool") -> list[Due]:
        """Remembered blocks that the next ``schedule()`` could evict, pinned, head first.

        Call once per step after vLLM allocated the step's blocks (``build_connector_meta``);
        every block returned must later be given to ``release``. The walk covers
        ``horizon_blocks`` positions that stay in the queue: the blocks it pins leave the
        queue, and the next step's allocations reach that much further.
        """
        if not self._pending:
            return []
        get = self._pending.get
        out: list[Due] = []
        taken = []
        seen_keys: set[bytes] = set()
        nodes = block_pool.free_block_queue.iter_blocks_after(None)
        # Each round walks as many more positions as the previous round pinned (pinned blocks
        # leave the queue). islice bounds a round without a per-node counter: most nodes are
        # blocks nobody remembered, and this cut the walk of 768 positions from
        # 137-155 to 71-110 us p50 on a loaded 2-core host.
        want = self.horizon_blocks
        while want:
            num_taken = 0
            for node in islice(nodes, want):
                entry = get(node.block_id)
                if entry is None:
                    continue
                if node.block_hash != entry.block_hash:
                    self._drop(node.block_id, EVICTED)
                elif entry.key in seen_keys:
                    # A second copy of a key stored from another block now: not needed.
                    self._unpend(node.block_id)
                else:
                    seen_keys.add(entry.key)
                    taken.append(node)
                    out.append(Due(entry.group, node.block_id, entry.key))
                    num_taken += 1
            want = num_taken
        self._pin(block_pool, taken)
        return out

    def all_pending(self, block_pool: "BlockPool") -> list[Due]:
        """Every remembered block still holding its data, pinned: the engine went idle or is
        shutting down, so nothing later would store them. Counts the ones already gone.

        O(remembered blocks); call it on an idle step, not every step.
        """
        blocks = block_pool.blocks
        out: list[Due] = []
        taken = []
        seen_keys: set[bytes] = set()
        for bid, entry in list(self._pending.items()):
            block = blocks[bid]
            if block.block_hash != entry.block_hash:
                self._drop(bid, EVICTED)
            elif entry.key in seen_keys:
                self._unpend(bid)
            else:
                seen_keys.add(entry.key)
                taken.append(block)
                out.append(Due(entry.group, bid, entry.key))
        self._pin(block_pool, taken)
        return out

    def release(self, block_pool: "BlockPool", block_ids: Iterable[int]) -> None:
        """Unpin blocks handed out by ``due``/``all_pending`` once their store landed or was
        given up (the caller counts its own reasons: pool full, daemon away).

        They go back to the tail of vLLM's free queue with their prefix-cache entry intact, so
        the GPU keeps serving hits on them; since they are stored, they are not remembered.
        """
        blocks = []
        for bid in block_ids:
            del self._in_flight[bid]
            blocks.append(block_pool.blocks[bid])
        block_pool.free_blocks(blocks)

    def at_risk(self, block_pool: "BlockPool") -> bool:
        """True when blocks freed now would land inside the eviction horizon.

        Blocks freed between two ``due`` calls (requests finishing in
        ``update_from_output``, preemption inside ``schedule()``) join the queue at position
        ``num_free_blocks`` or later, and the next ``schedule()`` may evict them before ``due``
        sees them when that position is within the horizon. While this holds, the caller stores
        eagerly: it keeps a finishing request's blocks (delay free) and plans its blocks now,
        and plans running requests' new full blocks now.
        """
        return block_pool.get_num_free_blocks() < self.horizon_blocks

    def reset(self) -> None:
        """The prefix cache was reset: remembered blocks hold stale KV; pinned ones stay pinned
        until released (vLLM refuses the reset while they are)."""
        self.dropped[RESET] += len(self._pending)
        self._pending.clear()
        self._by_key.clear()

    @property
    def num_pending(self) -> int:
        """Blocks remembered and not yet handed out."""
        return len(self._pending)

    @property
    def num_in_flight(self) -> int:
        """Blocks handed out and not yet released."""
        return len(self._in_flight)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def _pin(self, block_pool: "BlockPool", blocks: list) -> None:
        # touch() takes a free block out of the queue (ref_cnt 0 -> 1) and adds a reference to
        # one in use; either way vLLM can neither evict nor hand it out until free_blocks().
        block_pool.touch(blocks)
        for block in blocks:
            bid = block.block_id
            entry = self._in_flight[bid] = self._pending[bid]
            # Other blocks holding the same key (two requests computed it) are not needed
            # now: left pending they would be stored again, or counted evicted when reused.
            for other in list(self._by_key[entry.key]):
                self._unpend(other)

    def _drop(self, bid: int, reason: str) -> None:
        self._unpend(bid)
        self.dropped[reason] += 1

    def _unpend(self, bid: int) -> None:
        entry = self._pending.pop(bid)
        bids = self._by_key[entry.key]
        bids.discard(bid)
        if not bids:
            del self._by_key[entry.key]


class LazyPolicy:
    """The lazy store policy's side of planning: blocks the planner would store are remembered
    in ``store`` instead, and stored in batches of their own when due. Owns what storing a
    remembered block needs (the request and block index each remembered GPU block holds, for
    its batch and KV event: overwritten when the block id is remembered again, so bounded by
    the GPU's blocks) and, per lazy batch, the GPU blocks it pins until it resolves. Called by
    ``StorePlanner`` on vLLM's scheduler thread only."""

    def __init__(self, store: LazyStore, groups: list[Any], client: Any,
                 batches: "StoreBatches") -> None:
        self.store = store
        self._groups = groups
        self.client = client
        self._batches = batches
        self._owner: dict[int, tuple["ReqState", int]] = {}
        self._pins: dict[int, list[int]] = {}       # lazy batch id -> GPU blocks it pins

    def release_done(self, block_pool: "BlockPool | None") -> None:
        """Unpin the GPU blocks of lazy batches every rank has reported (stored or failed)."""
        if not self._pins or block_pool is None:
            return
        live = self._batches.by_id
        done = [b for b in self._pins if b not in live]
        if done:
            self.store.release(block_pool, [blk for b in done for blk in self._pins.pop(b)])

    def remember(self, block_pool: "BlockPool", wanted: list[list["Run"]]
                 ) -> list[list["Run"]]:
        """``wanted`` (per group, the runs a step plans) without the runs of requests that are
        not P/D hand-offs, whose blocks are remembered instead; blocks it cannot track (no
        prefix-cache hash) stay planned."""
        owner = self._owner
        out = []
        for gi, runs in enumerate(wanted):
            kept: list["Run"] = []
            for st, index, keys, bids in runs:
                if st.producer:
                    kept.append((st, index, keys, bids))
                    continue
                owner.update(zip(bids, zip(repeat(st), index)))
                untracked = self.store.remember(block_pool, gi, bids, keys)
                if untracked:
                    now = {d.block_id for d in untracked}
                    pick = [j for j, b in enumerate(bids) if b in now]
                    kept.append((st, [index[j] for j in pick], [keys[j] for j in pick],
                                 [bids[j] for j in pick]))
            out.append(kept)
        return out

    def store_due(self, block_pool: "BlockPool", due: list[Due]) -> list["StoreSpec"]:
        """Batches for remembered blocks ``due`` (pinned by ``LazyStore``), one per group.
        Blocks the stock has no tickets for go back to being remembered (unpinned, still
        cached)."""
        per_group: list[list[Due]] = [[] for _ in self._groups]
        for d in due:
            per_group[d.group].append(d)
        specs: list["StoreSpec"] = []
        store = self.store
        for gi, blocks in enumerate(per_group):
            if not blocks:
                continue
            tickets, granted_by = self.client.take_slots(self._groups[gi].namespace,
                                                         len(blocks))
            short = blocks[len(tickets):]
            if short:
                bids = [d.block_id for d in short]
                store.release(block_pool, bids)
                store.remember(block_pool, gi, bids, [d.key for d in short])
                blocks = blocks[:len(tickets)]
            if not blocks:
                continue
            runs: list["Run"] = []
            for d in blocks:
                st, index = self._owner[d.block_id]
                runs.append((st, (index,), [d.key], [d.block_id]))
            spec = self._batches.add(gi, runs, tickets, granted_by)
            self._pins[spec.batch] = [d.block_id for d in blocks]
            specs.append(spec)
        return specs
