"""The slot table (daemon/slot_table.py) through the index on real (small) shm pools: the work
victim choice does per slot allocated, the batch and one-by-one binds ending in one state, and
the queues' order through loads and hits."""

import msgspec
import pytest

from kvpool.daemon.index import Index
from kvpool.daemon.pool import FREE, Pool
from tests.daemon.indexkit import (BIG, NOT_STORED, NS_A, NS_BIG, NS_SMALL, NS_TP2, OWNER,
                                   SMALL, TP2, drive_random_stores, keys, make_index,
                                   records_match_slots, store, store_state)


def _examined(ix) -> int:
    """Queue entries every victim query has looked at so far (all sizes, all quotas)."""
    return (sum(c.lru.examined for c in ix.extents.classes.values())
            + sum(q.examined for q in ix.namespaces.lru.values()))


def test_victim_choice_examines_a_few_slots_per_slot_allocated_with_half_the_pool_pinned(
        pool_config):
    """Two slot sizes share a full pool and half of each size's blocks are pinned (leases, as
    loads in flight hold them). Stores of both sizes, one block at a time and in batches, must
    look at O(1) queue entries per slot they allocate: the queue never holds a pinned slot. The
    queue that was replaced walked past every pinned slot for every allocation (86% of the
    daemon's main thread during stores on an H100, issue 36)."""
    pool = Pool.open(msgspec.structs.replace(pool_config, pool_size="48MiB"))
    try:
        ix = make_index(pool)
        per_extent_big = pool.slots_per_extent(BIG.slot_bytes)
        half = pool.geometry.num_extents // 2
        big = keys(half * per_extent_big, b"big")
        for i in range(0, len(big), 8):
            store(ix, NS_BIG, big[i:i + 8])
        small = keys((pool.geometry.num_extents - half) * pool.slots_per_extent(SMALL.slot_bytes),
                     b"small")
        for i in range(0, len(small), 256):
            store(ix, NS_SMALL, small[i:i + 256])
        assert not ix.extents.free_extents and not any(c.free for c in ix.extents.classes.values())
        ix.lookup(NS_BIG, [[k] for k in big[::2]], True, OWNER, 0)       # half of each pinned
        ix.lookup(NS_SMALL, [[k] for k in small[::2]], True, OWNER, 0)
        pinned = ix.pinned_count()
        assert pinned >= (len(big) + len(small)) // 2 - 1

        allocated, before = 0, _examined(ix)
        for i in range(200):                                  # one block at a time
            for ns, tag in ((NS_SMALL, b"s1"), (NS_BIG, b"b1")):
                assert store(ix, ns, keys(1, tag + b"%d" % i))[0] != NOT_STORED
                allocated += 1
        per_slot_singles = (_examined(ix) - before) / allocated
        allocated, before = 0, _examined(ix)
        for i in range(8):                                    # batches
            assert NOT_STORED not in store(ix, NS_SMALL, keys(512, b"s2%d" % i))
            assert NOT_STORED not in store(ix, NS_BIG, keys(4, b"b2%d" % i))
            allocated += 516
        per_slot_batches = (_examined(ix) - before) / allocated
        print(f"examined per slot: singles {per_slot_singles:.2f}, batches {per_slot_batches:.3f}")
        assert ix.pinned_count() == pinned, "a pinned block was evicted"
        assert per_slot_singles <= 3.0, f"{per_slot_singles:.1f} queue entries per single block"
        assert per_slot_batches <= 1.1, f"{per_slot_batches:.2f} queue entries per block"
        records_match_slots(ix)
    finally:
        pool.close(unlink=True)


# ---- deferred and immediate claims end in the same state -----------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_same_stores_claimed_at_once_or_deferred_leave_the_same_state(pool_config, seed):
    """The store path defers a first rank's claims until its copy has gone out where nothing
    can come out void, and claims at once otherwise (daemon/stores.py); forced to claim at
    once, the same stores must leave every slot, key, queue, count and record exactly as the
    deferring path does."""
    states = []
    for batch in (True, False):
        cfg = msgspec.structs.replace(pool_config, pool_name=f"{pool_config.pool_name}-{batch}")
        pool = Pool.open(cfg)
        try:
            base = int(pool._rec_generation[0])
            ix = Index(pool, lease_ttl_s=10, write_timeout_s=60, defer_claims=batch)
            for ns, layout in ((NS_SMALL, SMALL), (NS_BIG, BIG), (NS_TP2, TP2)):
                ix.register_namespace(ns, layout)
            drive_random_stores(ix, seed)
            records_match_slots(ix)
            states.append(store_state(ix, base))
        finally:
            pool.close(unlink=True)
    batch, single = states
    for part, a, b in zip(("tables", "lru", "free", "bound", "counts", "records"), batch, single):
        assert a == b, f"the {part} differ between deferred and immediate claims"


@pytest.mark.parametrize("seed", [1, 2])
def test_every_slot_a_claim_takes_holds_nothing_the_claim_does_not_write(pool_config, seed):
    """``SlotTable.claim`` writes only what a claim changes: it relies on a FREE slot holding
    no pins, reads, landed or in-flight units, no doom or void flag and no ticket, however it
    was freed (evicted, dropped while pinned, a failed store, an expired one). Stores that
    succeed, fail, wait for a second rank and expire, with leases taken and given back, check
    that of every slot handed to a claim."""
    pool = Pool.open(msgspec.structs.replace(pool_config, pool_size="8MiB"))
    try:
        ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
        for ns, layout in ((NS_SMALL, SMALL), (NS_BIG, BIG), (NS_TP2, TP2)):
            ix.register_namespace(ns, layout)
        claim, claimed = ix.table.claim, []

        def checked(slots, *a, **kw):
            for s in slots:
                left = (s.state, s.pins, s.reads, s.landed, s.writing, s.doomed, s.void, s.ticket)
                assert left == (FREE, 0, 0, 0, 0, False, False, 0), \
                    f"slot {s.id} claimed holding (state, pins, reads, landed, writing, " \
                    f"doomed, void, ticket) {left}"
            claimed.append(len(slots))
            return claim(slots, *a, **kw)
        ix.table.claim = checked
        drive_random_stores(ix, seed)
        assert claimed and ix.table.stats.evictions > 0, "the drive should reuse evicted slots"
    finally:
        pool.close(unlink=True)


def test_loads_and_hits_keep_both_queues_in_use_order(pool, slot_records):
    """A load's pins take its slots out of their size's queue and their namespace's (under a
    quota); its unpins put them back as most recently used, in the order unpinned; hits move
    unpinned slots to the back and leave pinned ones out; slots pinned twice come back with
    their last pin only. Both queues agree with the order of use throughout."""
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=8 * SMALL.slot_bytes)
    ks = keys(6, b"q")
    refs = [store(ix, NS_A, [k])[0] for k in ks]
    by_key = dict(zip(ks, (ix.table.slots[r & 0xFFFF_FFFF].id for r in refs)))

    def queues():
        size = list(ix.table.slots[by_key[ks[0]]].size_class.lru)
        own = list(ix.namespaces.lru[NS_A])
        assert size == own, "the namespace's queue left its size's order"
        return [k for i in size for k in ks if by_key[k] == i]

    assert queues() == ks
    loading = ix.resolve_load(NS_A, refs[1:4], ks[1:4])
    ix.pin(loading)
    ix.pin(loading[:1])                                   # q1 twice (a lease and a load)
    assert queues() == [ks[0], ks[4], ks[5]]
    ix.touch(NS_A, [ks[5], ks[2], ks[0]])                 # q2 is pinned: not queued
    assert queues() == [ks[4], ks[5], ks[0]]
    ix.end_load(loading[::-1], True)                      # q3, q2 back; q1 still pinned once
    assert queues() == [ks[4], ks[5], ks[0], ks[3], ks[2]]
    ix.unpin(loading[:1])
    assert queues() == [ks[4], ks[5], ks[0], ks[3], ks[2], ks[1]]
    assert [s.pins for s in loading] == [0, 0, 0]
