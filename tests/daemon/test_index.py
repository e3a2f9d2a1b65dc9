"""The index on a real (small) shm pool, without sockets: states, leases, eviction, adoption."""

import pytest

from kvpool.daemon.index import Index
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import (LayoutMismatch, LeaseExpired, OutOfRange, PoolFull,
                                  ProtocolError, UnknownId)
from kvpool.shared.protocol import SLOT_NO_SPACE, SLOT_PRESENT
from tests.daemon.indexkit import (BIG, NS_BIG, NS_SMALL, NS_TP2, OTHER, OWNER, SMALL, TP2,
                                   head_layout, pins_of, capacity, keys, make_index, store)


@pytest.fixture
def index(pool):
    return make_index(pool)


def test_slot_is_visible_only_after_every_rank_landed(index):
    ks = keys(4)
    refs = index.prepare_store(NS_TP2, ks, OWNER, 0)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    index.end_store(index.begin_store(NS_TP2, refs, 0), 0, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    assert index.prepare_store(NS_TP2, ks, OWNER, 0) == [SLOT_PRESENT] * 4   # in flight
    index.end_store(index.begin_store(NS_TP2, refs[:2], 1), 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks, ks[1:]], False, OWNER, 0)
    assert hits == [2, 1] and slots[0] == refs[:2]
    assert index.slot_counts()[:2] == (2, 2)


def test_bad_refs_are_refused_without_side_effects(index):
    refs = index.prepare_store(NS_SMALL, keys(2), OWNER, 0)
    index.end_store(index.begin_store(NS_SMALL, refs[:1], 0), 0, True)
    with pytest.raises(UnknownId, match="not prepared"):          # committed, not writing
        index.begin_store(NS_SMALL, refs, 0)
    with pytest.raises(UnknownId):                                # wrong namespace
        index.begin_store(NS_BIG, refs[1:], 0)
    with pytest.raises(OutOfRange):
        index.begin_store(NS_SMALL, [0xFFFF_FFF0], 0)
    with pytest.raises(UnknownId):                                # stale generation
        index.begin_store(NS_SMALL, [refs[1] + (1 << 32)], 0)
    with pytest.raises(ProtocolError, match="twice"):
        index.begin_store(NS_SMALL, [refs[1], refs[1]], 0)
    slots = index.begin_store(NS_SMALL, refs[1:], 0)              # still fine after all that
    with pytest.raises(ProtocolError, match="already stored"):
        index.begin_store(NS_SMALL, refs[1:], 0)
    index.end_store(slots, 0, True)
    with pytest.raises(LeaseExpired):
        index.begin_load(NS_SMALL, [refs[0] + (1 << 32)])
    with pytest.raises(UnknownId, match="no registered layout"):
        index.prepare_store(b"?" * 16, keys(1), OWNER, 0)
    with pytest.raises(LayoutMismatch):
        index.register_namespace(NS_SMALL, BIG)


def test_eviction_is_lru_and_never_takes_leased_or_writing_slots(index):
    cap = capacity(index, BIG, NS_BIG)   # every slot committed and leased
    assert cap >= 6
    with pytest.raises(PoolFull, match="pinned"):
        index.prepare_store(NS_BIG, keys(1, b"x"), OWNER, 0)
    index.release_owner(OWNER)            # drops the leases; all committed, unpinned
    old = [keys(1, b"cap%d" % i)[0] for i in range(cap)]
    index.lookup(NS_BIG, [[old[0]]], False, OWNER, 0)                # touch 0: most recent
    leased = index.lookup(NS_BIG, [[old[1]]], True, OTHER, 0)[1][0]  # pin 1
    writing = index.prepare_store(NS_BIG, keys(1, b"w"), OWNER, 0)  # evicts 2 (LRU)
    assert writing[0] >= 0
    new = index.prepare_store(NS_BIG, keys(2, b"n"), OWNER, 0)        # evicts 3, 4
    assert all(r >= 0 for r in new)
    hits = index.lookup(NS_BIG, [[k] for k in old], False, OWNER, 0)[0]
    assert hits[:5] == [1, 1, 0, 0, 0] and all(hits[5:])
    assert index.stats.evictions == 3
    index.release_leases([leased], OTHER)
    assert index.lease_count == 0


def test_pool_full_only_when_nothing_is_evictable_and_partial_room_is_reported(index):
    cap = capacity(index, BIG, NS_BIG)
    index.release_leases(list(range(1, cap)), OWNER)   # all but the last lease
    refs = index.prepare_store(NS_BIG, keys(cap + 2, b"y"), OWNER, 0)
    assert refs.count(SLOT_NO_SPACE) == 3 and len([r for r in refs if r >= 0]) == cap - 1
    with pytest.raises(PoolFull):
        index.prepare_store(NS_BIG, keys(1, b"z"), OWNER, 0)
    assert index.prepare_store(NS_BIG, keys(1, b"y"), OWNER, 0) == [SLOT_PRESENT]


def test_a_new_layout_takes_whole_extents_from_an_idle_one(index):
    cap = capacity(index, BIG, NS_BIG)
    index.release_owner(OWNER)
    small = store(index, NS_SMALL, keys(10, b"s"), now=1)
    assert all(r >= 0 for r in small)
    per = index.pool.slots_per_extent(BIG.slot_bytes)
    writing, committed, _ = index.slot_counts()
    assert committed == cap - per + 10    # exactly one BIG extent was reclaimed
    # The newest BIG blocks survive: the reclaimed extent held the least recently used ones.
    hits = index.lookup(NS_BIG, [keys(1, b"cap%d" % i) for i in range(cap)], False, OWNER, 0)[0]
    assert hits[:per] == [0] * per and all(hits[per:])


def test_a_new_layout_gets_room_from_a_busy_one(index):
    """Regression (soak, worker kills with two block sizes): an extent went to another size
    only when idle as a whole, so while one model kept a block in flight in each of its
    extents, a second model got POOL_FULL for as long as that lasted. Now the least recently
    used extent of the busy size is drained for it and handed over once its pins end."""
    n = 0
    while True:                                             # the pool is all BIG
        try:
            refs = index.prepare_store(NS_BIG, keys(1, b"b%d" % n), OWNER, 0)
        except PoolFull:
            break
        index.end_store(index.begin_store(NS_BIG, refs, 0), 0, True)
        n += 1
        if index.slot_counts()[1] < n:                      # it evicts: the pool is full
            break
    per = index.pool.slots_per_extent(BIG.slot_bytes)

    def busy_everywhere():
        """One block pinned in each BIG extent (a load in flight, say): none is idle."""
        leases = []
        for e in list(index.extents.classes[BIG.slot_bytes].extents):
            s = next(s for s in index.extents.extent_slots(e) if s.state == 2)
            leases += index.lookup(NS_BIG, [[s.key[16:]]], True, OTHER, 0)[1]
        return leases
    pins = busy_everywhere()
    index.release_owner(OWNER)
    with pytest.raises(PoolFull):
        index.prepare_store(NS_SMALL, keys(1, b"s"), OWNER, 1)    # starts a drain
    # The busy model keeps being busy elsewhere: new pins, old ones released.
    fresh = busy_everywhere()
    # A lease taken before the drain still loads what it pinned.
    drained = next(lid for lid in pins
                   if index._leases[lid].slots[0].extent in index.extents.draining)
    held = index._leases[drained].slots
    index.end_load(index.begin_load(NS_BIG, [x.ref for x in held]), True)
    index.release_leases(pins, OTHER)
    refs = index.prepare_store(NS_SMALL, keys(4, b"s"), OWNER, 2)
    assert all(r >= 0 for r in refs), "the small model still starves"
    index.end_store(index.begin_store(NS_SMALL, refs, 0), 0, True)
    assert index.lookup(NS_SMALL, [keys(4, b"s")], False, OWNER, 2)[0] == [4]
    # The busy model lost one extent's worth of blocks, nothing it had pinned.
    writing, committed, _ = index.slot_counts()
    assert committed >= n - per - 1
    index.release_leases(fresh, OTHER)


def test_lease_ttl_and_write_timeout_expire(index):
    ks = keys(3)
    store(index, NS_SMALL, ks)
    lease = index.lookup(NS_SMALL, [ks], True, OWNER, now=0)[1][0]
    assert index.lease_count == 1
    pending = index.prepare_store(NS_SMALL, keys(2, b"p"), OWNER, now=0)
    assert index.expire(now=5) == (0, 0, 0)
    assert index.expire(now=11) == (1, 0, 0) and index.lease_count == 0
    assert index.release_leases([lease], OWNER) == 0        # already gone: harmless
    assert index.expire(now=61) == (0, 2, 0)
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, pending, 0)


def test_owner_release_drops_its_leases_and_prepared_slots_only(index):
    ks = keys(3)
    store(index, NS_SMALL, ks)
    index.lookup(NS_SMALL, [ks], True, OWNER, 0)
    index.lookup(NS_SMALL, [ks], True, OTHER, 0)
    mine = index.prepare_store(NS_SMALL, keys(1, b"m"), OWNER, 0)
    theirs = index.prepare_store(NS_SMALL, keys(1, b"t"), OTHER, 0)
    index.release_owner(OWNER)
    assert index.leases_of(OWNER) == 0 and index.leases_of(OTHER) == 1
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, mine, 0)
    index.begin_store(NS_SMALL, theirs, 0)


def test_failed_rank_drops_the_slot_even_while_another_rank_writes(index):
    ks = keys(1)
    refs = index.prepare_store(NS_TP2, ks, OWNER, 0)
    r0 = index.begin_store(NS_TP2, refs, 0)
    r1 = index.begin_store(NS_TP2, refs, 1)
    index.end_store(r1, 1, ok=False)
    assert index.prepare_store(NS_TP2, ks, OWNER, 0)[0] >= 0     # key free again, new slot
    index.end_store(r0, 0, ok=True)                             # late rank: no effect
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]


def test_reset_forgets_now_and_frees_pinned_slots_later(index):
    ks = keys(4)
    store(index, NS_SMALL, ks)
    store(index, NS_BIG, keys(1))
    lease = index.lookup(NS_SMALL, [ks], True, OWNER, 0)[1][0]
    loading = index.begin_load(NS_SMALL, index.lookup(NS_SMALL, [ks], False, OWNER, 0)[2][0])
    assert index.reset(NS_SMALL) == 4
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [0]
    assert index.lookup(NS_BIG, [keys(1)], False, OWNER, 0)[0] == [1]
    index.release_leases([lease], OWNER)
    index.end_load(loading, ok=True)
    assert index.slot_counts()[1] == 1


def test_adoption_keeps_committed_blocks_and_drops_unfinished_ones(pool_config):
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    ix.register_namespace(NS_TP2, TP2)
    done = store(ix, NS_SMALL, keys(5))
    half = ix.prepare_store(NS_TP2, keys(2), OWNER, 0)
    ix.end_store(ix.begin_store(NS_TP2, half, 0), 0, True)
    pool.close(unlink=False)   # as after kill -9: nothing cleaned up
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == 5
        hits, _, refs = ix2.lookup(NS_SMALL, [keys(5)], False, OWNER, 0)
        assert hits == [5] and refs[0] == done
        assert ix2.lookup(NS_TP2, [keys(2)], False, OWNER, 0)[0] == [0]
        assert all(r >= 0 for r in ix2.prepare_store(NS_TP2, keys(2), OWNER, 0))
        assert ix2.slot_counts()[:2] == (2, 5)
    finally:
        pool2.close(unlink=True)


def test_refs_handed_out_before_a_restart_are_never_handed_out_again(pool_config):
    """Regression (soak, daemon kills): generations of slots that were only being written were
    not kept, so the restarted daemon handed the very same slot ref to another key, and a store
    the engine sent late with the old ref landed under that key."""
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    old = ix.prepare_store(NS_SMALL, keys(3, b"a"), OWNER, 0)     # prepared, never written
    store(ix, NS_SMALL, keys(2, b"c"))
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        ix2.adopt()
        new = ix2.prepare_store(NS_SMALL, keys(3, b"b"), OWNER, 0)
        assert not set(old) & set(new), "a ref of the previous daemon was handed out again"
        with pytest.raises(UnknownId):
            ix2.begin_store(NS_SMALL, old[:1], 0)
    finally:
        pool2.close(unlink=True)


def test_a_new_pool_does_not_start_generations_at_zero(pool_config):
    """Refs from a replaced pool's daemon must not match the new one's first refs either."""
    pool = Pool.open(pool_config)
    try:
        ix = Index(pool, 10, 60)
        ix.register_namespace(NS_SMALL, SMALL)
        ref = ix.prepare_store(NS_SMALL, keys(1), OWNER, 0)[0]
        from kvpool.shared.protocol import slot_ref_generation
        assert slot_ref_generation(ref) != 1
    finally:
        pool.close(unlink=True)


def test_adoption_ignores_an_extent_entry_torn_by_a_crash(pool_config):
    """Regression: assign_extent wrote num_slots before slot_bytes; a crash between them left
    an entry whose slots overran the extent, and adoption laid them over the next extent."""
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_BIG, BIG)
    store(ix, NS_BIG, keys(2))
    extent = next(e for e in range(pool.geometry.num_extents)
                  if int(pool.extents[e]["slot_bytes"]))
    pool.extents[extent]["num_slots"] = pool.geometry.records_per_extent   # 64 x 256 KiB > 1 MiB
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        assert not pool2.extent_is_sane(extent)
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == 0
        ends = sorted((s.offset, s.offset + s.size_class.slot_bytes) for s in ix2._slots.values())
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "slots overlap"
        ix2.register_namespace(NS_SMALL, SMALL)
        assert capacity(ix2, SMALL, NS_SMALL) > 0
    finally:
        pool2.close(unlink=True)


# ---- head-split slots: one namespace for every TP size ------------------------------------


def test_tp_cross_index_commits_once_every_head_range_landed_from_any_tp_size(index):
    one, two, four = head_layout(1), head_layout(2), head_layout(4)
    assert one.canonical() == two.canonical() == four.canonical()
    assert one.slot_bytes == two.slot_bytes == four.slot_bytes == 16 * 4 * 256
    ns = b"H" * 16
    index.register_namespace(ns, two)
    index.register_namespace(ns, one)          # another TP size of the same model: same slots
    index.register_namespace(ns, four)
    ks = keys(3)
    refs = index.prepare_store(ns, ks, OWNER, 0)
    # TP=2: rank 0 holds heads 0-1, rank 1 heads 2-3; a block commits once both landed
    index.end_store(index.begin_store(ns, refs, 0, two.rank_mask(0)), 0, True, two.rank_mask(0))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [0]
    with pytest.raises(ProtocolError, match="overlapping head ranges"):
        index.begin_store(ns, refs, 1, four.rank_mask(1))       # heads 1: rank 0 stored them
    got = index.begin_store(ns, refs[:2], 1, two.rank_mask(1))
    assert index.end_store(got, 1, True, two.rank_mask(1)) == 2
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [2]
    # the third block's other half from TP=4 ranks (heads 2 and 3), in either order
    index.end_store(index.begin_store(ns, refs[2:], 3, four.rank_mask(3)), 3, True,
                    four.rank_mask(3))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [2]
    index.end_store(index.begin_store(ns, refs[2:], 2, four.rank_mask(2)), 2, True,
                    four.rank_mask(2))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [3]


def test_tp_cross_a_rank_that_dies_after_its_head_range_leaves_the_block_uncommitted(index):
    """Rank 0 of a TP=2 engine lands its heads, rank 1 dies before storing: the block is never
    visible, and the write timeout frees it."""
    two = head_layout(2)
    ns = b"H" * 16
    index.register_namespace(ns, two)
    ks = keys(2)
    refs = index.prepare_store(ns, ks, OWNER, now=0.0)
    index.end_store(index.begin_store(ns, refs, 0, two.rank_mask(0)), 0, True, two.rank_mask(0))
    assert index.lookup(ns, [ks], False, OWNER, 1.0)[0] == [0]
    assert index.expire(now=61.0) == (0, 2, 0)
    assert index.lookup(ns, [ks], False, OWNER, 62.0)[0] == [0]
    assert index.slot_counts() == (0, 0, 0)
    with pytest.raises(UnknownId):
        index.begin_store(ns, refs, 1, two.rank_mask(1))      # the late rank finds it gone
    assert index.prepare_store(ns, ks, OWNER, 62.0)[0] >= 0   # stored again from scratch


def test_tp_cross_replicated_heads_and_mla_store_one_copy():
    # 2 KV heads over TP=4: ranks 0 and 2 store heads 0 and 1; ranks 1 and 3 hold replicas
    gqa = head_layout(4, heads=2)
    assert [gqa.head_range(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [gqa.rank_mask(r) for r in range(4)] == [0b01, 0, 0b10, 0]
    assert gqa.full_mask == 0b11 and gqa.canonical() == head_layout(1, heads=2).canonical()
    mla = head_layout(8, heads=1)          # one latent copy for every rank: rank 0 stores it
    assert [mla.rank_mask(r) for r in range(8)] == [1] + [0] * 7
    assert (mla.canonical() == head_layout(1, heads=1).canonical()
            == head_layout(2, heads=1).canonical())


# ---- fills from a lower tier (daemon/tiering.py drives these) -------------------------------

def test_filling_slots_are_hits_loadable_after_end_fill_and_dropped_when_it_fails(index):
    committed = []
    index.on_commit = committed.extend
    ks = keys(4, b"fill")
    slots = index.reserve_fills(NS_SMALL, ks, now=0.0)
    assert len(slots) == 4 and index.leading(NS_SMALL, ks) == 4
    hits, leases, refs = index.lookup(NS_SMALL, [ks], True, OWNER, 0.0)
    assert hits == [4]
    loading = index.begin_load(NS_SMALL, refs[0])      # a load may name FILLING slots...
    assert not index.is_loadable(loading)               # ...but must wait for the fill
    assert index.prepare_store(NS_SMALL, ks, OWNER, 0.0) == [SLOT_PRESENT] * 4
    index.end_fill(slots, [True, True, False, True])
    assert committed == [slots[0], slots[1], slots[3]]  # the lower tier's feed
    assert not index.is_loadable(loading)               # one block did not come back
    index.end_load(loading, ok=False)
    index.release_leases(leases, OWNER)
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0.0)[0] == [2]
    writing, committed_n, _ = index.slot_counts()
    assert (writing, committed_n) == (0, 3)


def test_a_reset_during_a_fill_frees_its_slots_when_the_fill_ends(index):
    ks = keys(3, b"rf")
    slots = index.reserve_fills(NS_SMALL, ks, now=0.0)
    assert index.reset(NS_SMALL) == 3
    assert index.leading(NS_SMALL, ks) == 0
    index.end_fill(slots, [True] * 3)
    assert index.slot_counts() == (0, 0, 0)


def test_fills_stop_where_the_pool_has_no_room(index):
    n = capacity(index, BIG, NS_BIG)                     # every BIG slot pinned
    assert index.reserve_fills(NS_BIG, keys(2, b"nofit"), now=0.0) == []
    assert n > 0


def test_a_load_refused_at_its_last_slot_leaves_every_pin_as_it_was(index):
    ks = keys(3, b"l")
    store(index, NS_SMALL, ks)
    _, _, refs = index.lookup(NS_SMALL, [ks], False, OWNER, 0)
    refs = refs[0]
    before = pins_of(index, refs)
    with pytest.raises(LeaseExpired):
        index.begin_load(NS_SMALL, refs[:2] + [refs[2] + (1 << 32)])
    with pytest.raises(LeaseExpired):
        index.begin_load(NS_BIG, refs)                   # another namespace
    with pytest.raises(OutOfRange):
        index.begin_load(NS_SMALL, refs[:2] + [0xFFFF_FFF0])
    assert pins_of(index, refs) == before
    slots = index.check_load(NS_SMALL, refs)             # checked, pinned by the caller later
    assert pins_of(index, refs) == before and slots == index.begin_load(NS_SMALL, refs)
    index.end_load(slots, True)
    slots = index.begin_load(NS_SMALL, refs + refs[:1])  # a slot named twice: pinned twice
    assert [s.pins for s in slots] == [2, 1, 1, 2]
    index.end_load(slots, True)
    assert pins_of(index, refs) == before
