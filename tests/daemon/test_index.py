"""The index on a real (small) shm pool, without sockets: states, leases, eviction, adoption."""

import pytest

from kvpool.daemon.index import Index
from kvpool.daemon.pool import GENERATION_MASK, Pool
from kvpool.shared.errors import LayoutMismatch, LeaseExpired, OutOfRange, ProtocolError, UnknownId
from kvpool.shared.protocol import slot_ref_generation, slot_ref_index
from tests.daemon.indexkit import (BIG, NOT_STORED, NS_A, NS_BIG, NS_SMALL, NS_TP2, OTHER, OWNER,
                                   SMALL, TP2, bind, capacity, head_layout, keys, make_index,
                                   pins_of, records_match_slots, store)


@pytest.fixture
def index(pool):
    return make_index(pool)


def test_slot_is_visible_only_after_every_rank_landed(index):
    ks = keys(4)
    tickets, first = bind(index, NS_TP2, ks, rank=0)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    index.end_store(first, 0, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    assert store(index, NS_TP2, ks) == [NOT_STORED] * 4            # in flight: duplicates
    index.end_store(index.begin_store(NS_TP2, tickets[:2], ks[:2], 1), 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks, ks[1:]], False, OWNER, 0)
    assert hits == [2, 1] and slots[0] == [s.ref for s in first[:2]]
    assert index.slot_counts()[:2] == (2, 2)


def test_bad_refs_are_refused_without_side_effects(index):
    ks = keys(2)
    tickets = index.reserve(NS_TP2, 2, OWNER, 0)
    for rank in (0, 1):
        index.end_store(index.begin_store(NS_TP2, tickets[:1], ks[:1], rank), rank, True)
    with pytest.raises(UnknownId, match="not reserved"):          # committed: spent
        index.begin_store(NS_TP2, tickets, ks, 0)
    with pytest.raises(UnknownId):                                # wrong namespace
        index.begin_store(NS_SMALL, tickets[1:], ks[1:], 0)
    with pytest.raises(OutOfRange):
        index.begin_store(NS_TP2, [0xFFFF_FFF0], ks[:1], 0)
    with pytest.raises(OutOfRange):                               # another generation
        index.begin_store(NS_TP2, [tickets[1] + (1 << 32)], ks[1:], 0)
    with pytest.raises(ProtocolError, match="twice"):
        index.begin_store(NS_TP2, [tickets[1], tickets[1]], ks, 0)
    with pytest.raises(ProtocolError, match="keys for"):
        index.begin_store(NS_TP2, tickets[1:], ks, 0)
    slots = index.begin_store(NS_TP2, tickets[1:], ks[1:], 0)     # still fine after all that
    with pytest.raises(ProtocolError, match="overlap"):
        index.begin_store(NS_TP2, tickets[1:], ks[1:], 0)         # the same rank twice
    with pytest.raises(ProtocolError, match="another key"):
        index.begin_store(NS_TP2, tickets[1:], ks[:1], 1)
    index.end_store(slots, 0, True)
    with pytest.raises(LeaseExpired):
        index.begin_load(NS_TP2, [slots[0].ref + (1 << 32)])
    with pytest.raises(UnknownId, match="no registered layout"):
        index.reserve(b"?" * 16, 1, OWNER, 0)
    with pytest.raises(LayoutMismatch):
        index.register_namespace(NS_SMALL, BIG)


def test_eviction_is_lru_and_never_takes_leased_or_writing_slots(index):
    cap = capacity(index, BIG, NS_BIG)   # every slot committed and leased
    assert cap >= 6
    assert store(index, NS_BIG, keys(1, b"x")) == [NOT_STORED]      # no room: all pinned
    index.release_owner(OWNER)            # drops the leases; all committed, unpinned
    old = [keys(1, b"cap%d" % i)[0] for i in range(cap)]
    index.lookup(NS_BIG, [[old[0]]], False, OWNER, 0)                # touch 0: most recent
    leased = index.lookup(NS_BIG, [[old[1]]], True, OTHER, 0)[1][0]  # pin 1
    _, writing = bind(index, NS_BIG, keys(1, b"w"))                  # evicts 2 (LRU)
    assert not writing[0].void
    assert NOT_STORED not in store(index, NS_BIG, keys(2, b"n"))     # evicts 3, 4
    hits = index.lookup(NS_BIG, [[k] for k in old], False, OWNER, 0)[0]
    assert hits[:5] == [1, 1, 0, 0, 0] and all(hits[5:])
    assert index.table.stats.evictions == 3
    index.release_leases([leased], OTHER)
    assert index.lease_count == 0


def test_a_full_pool_stores_what_it_can_evict_for_and_not_the_rest(index):
    cap = capacity(index, BIG, NS_BIG)
    index.release_leases(list(range(1, cap)), OWNER)   # all but the last lease
    _, slots = bind(index, NS_BIG, keys(cap, b"y"))     # (an owner holds up to cap tickets)
    voids = [s.void for s in slots]
    assert voids == [False] * (cap - 1) + [True]
    assert index.stores.stats.no_room_blocks == 1
    assert store(index, NS_BIG, keys(1, b"z")) == [NOT_STORED]      # all written or pinned
    assert store(index, NS_BIG, keys(1, b"y")) == [NOT_STORED]      # in flight: a duplicate
    index.end_store(slots, 0, True)
    assert index.lookup(NS_BIG, [keys(cap, b"y")], False, OWNER, 0)[0] == [cap - 1]


def test_a_new_layout_takes_whole_extents_from_an_idle_one(index):
    cap = capacity(index, BIG, NS_BIG)
    index.release_owner(OWNER)
    small = store(index, NS_SMALL, keys(10, b"s"), now=1)
    assert NOT_STORED not in small
    per = index.pool.slots_per_extent(BIG.slot_bytes)
    writing, committed, _ = index.slot_counts()
    assert committed == cap - per + 10    # exactly one BIG extent was reclaimed
    # The newest BIG blocks survive: the reclaimed extent held the least recently used ones.
    hits = index.lookup(NS_BIG, [keys(1, b"cap%d" % i) for i in range(cap)], False, OWNER, 0)[0]
    assert hits[:per] == [0] * per and all(hits[per:])


def test_a_new_layout_gets_room_from_a_busy_one(index):
    """Regression (soak, worker kills with two block sizes): an extent went to another size
    only when idle as a whole, so while one model kept a block in flight in each of its
    extents, a second model got no room for as long as that lasted. Now the least recently
    used extent of the busy size is drained for it and handed over once its pins end."""
    n = 0
    while True:                                             # the pool is all BIG
        if store(index, NS_BIG, keys(1, b"b%d" % n))[0] == NOT_STORED:
            break
        n += 1
        if index.slot_counts()[1] < n:                      # it evicts: the pool is full
            break
    per = index.pool.slots_per_extent(BIG.slot_bytes)

    def busy_everywhere():
        """One block pinned in each BIG extent (a load in flight, say): none is idle."""
        leases = []
        for e in list(index.extents.classes[BIG.slot_bytes].extents):
            if e in index.extents.draining:
                continue
            s = next(s for s in index.extents.extent_slots(e) if s.state == 2 and not s.pins)
            leases += index.lookup(NS_BIG, [[s.key[16:]]], True, OTHER, 0)[1]
        return leases
    pins = busy_everywhere()
    index.release_owner(OWNER)
    # Every BIG block is more recent than nothing: the small model, with nothing of its own
    # to evict, starts a drain of the extent of the least recently used BIG block.
    assert store(index, NS_SMALL, keys(1, b"s"), now=1) == [NOT_STORED]
    assert index.extents.draining
    # The busy model keeps being busy elsewhere: new pins, old ones released.
    fresh = busy_everywhere()
    # A lease taken before the drain still loads what it pinned.
    drained = next(lid for lid in pins
                   if index._leases[lid].slots[0].extent in index.extents.draining)
    held = index._leases[drained].slots
    index.end_load(index.begin_load(NS_BIG, [x.ref for x in held]), True)
    index.release_leases(pins, OTHER)
    assert NOT_STORED not in store(index, NS_SMALL, keys(4, b"s"), now=2), \
        "the small model still starves"
    assert index.lookup(NS_SMALL, [keys(4, b"s")], False, OWNER, 2)[0] == [4]
    # The busy model lost one extent's worth of blocks, nothing it had pinned.
    writing, committed, _ = index.slot_counts()
    assert committed >= n - per - 1 + 4
    index.release_leases(fresh, OTHER)


def test_lease_ttl_and_write_timeout_expire(index):
    ks = keys(3)
    store(index, NS_SMALL, ks)
    lease = index.lookup(NS_SMALL, [ks], True, OWNER, now=0)[1][0]
    assert index.lease_count == 1
    tickets, pending = bind(index, NS_TP2, keys(2, b"p"), rank=0)      # rank 1 never comes
    index.end_store(pending, 0, True)
    assert index.expire(now=5) == (0, 0, 0)
    assert index.expire(now=11) == (1, 0, 0) and index.lease_count == 0
    assert index.release_leases([lease], OWNER) == 0        # already gone: harmless
    assert index.expire(now=61) == (0, 2, 0)
    with pytest.raises(UnknownId):
        index.begin_store(NS_TP2, tickets, keys(2, b"p"), 1)


def test_owner_release_drops_its_leases_and_stores_only(index):
    ks = keys(3)
    store(index, NS_SMALL, ks)
    index.lookup(NS_SMALL, [ks], True, OWNER, 0)
    index.lookup(NS_SMALL, [ks], True, OTHER, 0)
    mine, slots = bind(index, NS_TP2, keys(1, b"m"), owner=OWNER)
    index.end_store(slots, 0, True)
    theirs, slots = bind(index, NS_TP2, keys(1, b"t"), owner=OTHER)
    index.end_store(slots, 0, True)
    index.release_owner(OWNER)
    assert index.leases_of(OWNER) == 0 and index.leases_of(OTHER) == 1
    with pytest.raises(UnknownId):
        index.begin_store(NS_TP2, mine, keys(1, b"m"), 1)
    index.end_store(index.begin_store(NS_TP2, theirs, keys(1, b"t"), 1), 1, True)
    assert index.lookup(NS_TP2, [keys(1, b"t"), keys(1, b"m")], False, OWNER, 0)[0] == [1, 0]


def test_failed_rank_drops_the_slot_even_while_another_rank_writes(index):
    ks = keys(1)
    tickets, r0 = bind(index, NS_TP2, ks, rank=0)
    r1 = index.begin_store(NS_TP2, tickets, ks, 1)
    index.end_store(r1, 1, ok=False)
    assert store(index, NS_TP2, ks, ranks=(0,))[0] != NOT_STORED   # key free again, new slot
    index.end_store(r0, 0, ok=True)                               # late rank: no effect
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
    _, half = bind(ix, NS_TP2, keys(2))
    ix.end_store(half, 0, True)
    pool.close(unlink=False)   # as after kill -9: nothing cleaned up
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == 5
        hits, _, refs = ix2.lookup(NS_SMALL, [keys(5)], False, OWNER, 0)
        assert hits == [5] and refs[0] == done
        assert ix2.lookup(NS_TP2, [keys(2)], False, OWNER, 0)[0] == [0]
        _, again = bind(ix2, NS_TP2, keys(2))
        assert not any(s.void for s in again)
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
    _, writing = bind(ix, NS_SMALL, keys(3, b"a"))               # bound, never written
    old = [s.ref for s in writing]
    store(ix, NS_SMALL, keys(2, b"c"))
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        ix2.adopt()
        _, slots = bind(ix2, NS_SMALL, keys(3, b"b"))
        assert not set(old) & {s.ref for s in slots}, "a ref of the previous daemon came back"
        with pytest.raises(LeaseExpired):
            ix2.begin_load(NS_SMALL, old[:1])
    finally:
        pool2.close(unlink=True)


def test_a_new_pool_does_not_start_generations_at_zero(pool_config):
    """Refs from a replaced pool's daemon must not match the new one's first refs either."""
    pool = Pool.open(pool_config)
    try:
        ix = Index(pool, 10, 60)
        ix.register_namespace(NS_SMALL, SMALL)
        assert slot_ref_generation(store(ix, NS_SMALL, keys(1))[0]) != 1
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
        ends = sorted((s.offset, s.offset + s.size_class.slot_bytes)
                      for s in ix2.table.slots.values())
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
    t = index.reserve(ns, 3, OWNER, 0)
    # TP=2: rank 0 holds heads 0-1, rank 1 heads 2-3; a block commits once both landed
    index.end_store(index.begin_store(ns, t, ks, 0, two.rank_mask(0)), 0, True, two.rank_mask(0))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [0]
    with pytest.raises(ProtocolError, match="overlap"):
        index.begin_store(ns, t, ks, 1, four.rank_mask(1))       # heads 1: rank 0 stored them
    got = index.begin_store(ns, t[:2], ks[:2], 1, two.rank_mask(1))
    assert index.end_store(got, 1, True, two.rank_mask(1)) == 2
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [2]
    # the third block's other half from TP=4 ranks (heads 2 and 3), in either order
    index.end_store(index.begin_store(ns, t[2:], ks[2:], 3, four.rank_mask(3)), 3, True,
                    four.rank_mask(3))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [2]
    index.end_store(index.begin_store(ns, t[2:], ks[2:], 2, four.rank_mask(2)), 2, True,
                    four.rank_mask(2))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [3]


def test_tp_cross_a_rank_that_dies_after_its_head_range_leaves_the_block_uncommitted(index):
    """Rank 0 of a TP=2 engine lands its heads, rank 1 dies before storing: the block is never
    visible, and the write timeout frees it."""
    two = head_layout(2)
    ns = b"H" * 16
    index.register_namespace(ns, two)
    ks = keys(2)
    t = index.reserve(ns, 2, OWNER, 0.0)
    index.end_store(index.begin_store(ns, t, ks, 0, two.rank_mask(0)), 0, True, two.rank_mask(0))
    assert index.lookup(ns, [ks], False, OWNER, 1.0)[0] == [0]
    assert index.expire(now=61.0) == (0, 2, 0)
    assert index.lookup(ns, [ks], False, OWNER, 62.0)[0] == [0]
    assert index.slot_counts() == (0, 0, 0)
    with pytest.raises(UnknownId):
        index.begin_store(ns, t, ks, 1, two.rank_mask(1))      # the late rank finds it gone
    t2 = index.reserve(ns, 2, OWNER, 62.0)                     # stored again from scratch
    assert not index.begin_store(ns, t2, ks, 0, two.rank_mask(0), now=62.0)[0].void


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

class _Committed:
    """A slot-table watcher that records what committed."""

    def __init__(self):
        self.slots = []

    def committed(self, slots):
        self.slots += slots

    def removed(self, slots):
        pass


def test_filling_slots_are_hits_loadable_after_end_fill_and_dropped_when_it_fails(index):
    feed = _Committed()
    index.table.watch(feed)
    ks = keys(4, b"fill")
    slots = index.reserve_fills(NS_SMALL, ks, now=0.0)
    assert len(slots) == 4 and index.leading(NS_SMALL, ks) == 4
    hits, leases, refs = index.lookup(NS_SMALL, [ks], True, OWNER, 0.0)
    assert hits == [4]
    loading = index.begin_load(NS_SMALL, refs[0])      # a load may name FILLING slots...
    assert not index.is_loadable(loading)               # ...but must wait for the fill
    assert store(index, NS_SMALL, ks) == [NOT_STORED] * 4
    index.end_fill(slots, [True, True, False, True])
    assert feed.slots == [slots[0], slots[1], slots[3]]  # the lower tier's feed
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


@pytest.mark.parametrize("recorded, claimed", [(GENERATION_MASK - 1, GENERATION_MASK),
                                               (GENERATION_MASK, 0)])
def test_a_claim_takes_the_next_generation_after_the_recorded_one(pool_config, recorded,
                                                                  claimed):
    """A slot's generation is its ref's upper half, carried over from the pool's records and
    bumped by each claim (31 bits): after the last comes 0, whose ref is the slot id alone.
    The slots' records say the same."""
    pool = Pool.open(pool_config)
    try:
        pool._rec_generation[:] = recorded             # as a pool used for long might hold
        ix = Index(pool, 10, 60)
        ix.register_namespace(NS_SMALL, SMALL)
        refs = store(ix, NS_SMALL, keys(3))
        assert [slot_ref_generation(r) for r in refs] == [claimed] * 3
        assert all(ix.table.slots[slot_ref_index(r)].generation == claimed for r in refs)
        if claimed == 0:
            assert all(r == slot_ref_index(r) for r in refs)
        records_match_slots(ix)
    finally:
        pool.close(unlink=True)


def test_committed_hashes_are_every_committed_block_of_the_namespace(pool):
    """What an engine that joins a namespace is told it can load: every committed block of
    it once, pinned or not, in slot order (a router keeps a set); none of another namespace's,
    none dropped while pinned, and nothing for a namespace with none. The quota seed's filter
    of the size's queue keeps the order of use."""
    ix = make_index(pool)
    ix.register_namespace(NS_A, SMALL)                      # the same size: the same queue
    ks = keys(4, b"c")
    store(ix, NS_SMALL, ks)
    store(ix, NS_A, keys(2, b"o"))
    ix.lookup(NS_SMALL, [ks[1:2]], False, OWNER, 0)          # c1 used last
    lease = ix.lookup(NS_SMALL, [ks[2:3]], True, OWNER, 0)[1][0]
    assert ix.committed_hashes(NS_SMALL) == ks
    assert [s.block_hash for s in ix._evictable_of(NS_SMALL)] == [ks[0], ks[3], ks[1]]
    ix.release_leases([lease], OWNER)
    assert ix.committed_hashes(NS_SMALL) == ks
    assert [s.block_hash for s in ix._evictable_of(NS_SMALL)] == [ks[0], ks[3], ks[1], ks[2]]
    assert ix.committed_hashes(b"z" * 16) == []
    ix.lookup(NS_A, [keys(1, b"o")], True, OWNER, 0)          # another namespace's lease
    ix.lookup(NS_SMALL, [ks[:1]], True, OWNER, 0)
    ix.reset(NS_SMALL)                                       # c0 leased: doomed, not freed
    fresh = keys(2, b"f")
    store(ix, NS_SMALL, fresh)
    assert sorted(ix.committed_hashes(NS_SMALL)) == sorted(fresh)
