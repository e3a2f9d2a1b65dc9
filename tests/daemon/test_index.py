"""The index on a real (small) shm pool, without sockets: states, leases, eviction, adoption."""

import msgspec
import pytest

from kvpool.daemon.index import Index
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import (LayoutMismatch, LeaseExpired, OutOfRange, PoolFull,
                                  ProtocolError, UnknownId)
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import MAX_RESERVE, SLOT_NO_SPACE, SLOT_PRESENT

BIG = Layout(16, 1, "f16", (256 << 10,), "big")        # 4 slots per 1 MiB extent
SMALL = Layout(16, 1, "f16", (4096,), "small")
TP2 = Layout(16, 2, "f16", (4096,), "tp2")
NS_BIG, NS_SMALL, NS_TP2 = b"B" * 16, b"S" * 16, b"T" * 16
OWNER, OTHER = 1, 2


def keys(n, prefix=b""):
    return [(prefix + b"%06d" % i).ljust(16, b"k") for i in range(n)]


@pytest.fixture
def index(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_BIG, BIG)
    ix.register_namespace(NS_SMALL, SMALL)
    ix.register_namespace(NS_TP2, TP2)
    return ix


def store(ix, ns, ks, now=0.0, ranks=(0,)):
    refs = ix.prepare_store(ns, ks, OWNER, now)
    todo = [r for r in refs if r >= 0]
    for rank in ranks:
        ix.end_store(ix.begin_store(ns, todo, rank), rank, ok=True)
    return refs


def capacity(ix, layout, ns):
    n = 0
    while True:
        try:
            refs = ix.prepare_store(ns, keys(1, b"cap%d" % n), OWNER, 0)
        except PoolFull:
            return n
        ix.end_store(ix.begin_store(ns, refs, 0), 0, True)
        ix.lookup(ns, [keys(1, b"cap%d" % n)], True, OWNER, 0)   # pin it: never evicted
        n += 1


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
    drained = next(lid for lid in pins if index._leases[lid].slots[0].extent in index.extents.draining)
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


# ---- quotas ------------------------------------------------------------------------------

NS_A, NS_B = b"A" * 16, b"Q" * 16


def test_a_namespace_over_its_quota_evicts_only_its_own_blocks(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=4 * SMALL.slot_bytes)
    ix.register_namespace(NS_B, SMALL)
    b_keys = keys(6, b"b")
    store(ix, NS_B, b_keys, now=0)                   # older than everything of A
    for i in range(10):                              # A turns over its 4 blocks, one at a time
        assert store(ix, NS_A, keys(1, b"a%d" % i))[0] >= 0
    assert ix.lookup(NS_B, [b_keys], False, OWNER, 0)[0] == [6], "B lost blocks to A's quota"
    held = ix.lookup(NS_A, [keys(1, b"a%d" % i) for i in range(10)], False, OWNER, 0)[0]
    assert held == [0] * 6 + [1] * 4                  # A keeps its 4 most recent
    assert ix.used_bytes_of(NS_A) == 4 * SMALL.slot_bytes
    assert ix.stats.evictions == 6


def test_quota_counts_blocks_being_written_and_skips_pinned_ones(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=3 * SMALL.slot_bytes)
    first = keys(2, b"p")
    store(ix, NS_A, first)
    lease = ix.lookup(NS_A, [first[:1]], True, OWNER, 0)[1][0]    # p0 pinned
    refs = ix.prepare_store(NS_A, keys(3, b"w"), OWNER, 0)
    # one fits, the second evicts p1 (p0 is pinned), the third has nothing of A left to evict
    assert [r >= 0 for r in refs] == [True, True, False] and refs[2] == SLOT_NO_SPACE
    with pytest.raises(PoolFull, match="quota"):
        ix.prepare_store(NS_A, keys(1, b"z"), OWNER, 0)
    ix.abort_store([r for r in refs if r >= 0], OWNER)            # frees quota, no eviction
    assert all(r >= 0 for r in ix.prepare_store(NS_A, keys(2, b"z"), OWNER, 0))
    assert ix.lookup(NS_A, [first[:1]], False, OWNER, 0)[0] == [1]
    ix.release_leases([lease], OWNER)


def test_daemon_quota_caps_what_engines_declare_and_a_lower_quota_takes_effect(pool):
    cap = 5 * SMALL.slot_bytes
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60, namespace_quota=cap)
    ix.register_namespace(NS_A, SMALL, quota_bytes=100 * SMALL.slot_bytes)
    assert ix.quota_of(NS_A) == cap
    store(ix, NS_A, keys(5, b"a"))
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)   # latest wins
    assert store(ix, NS_A, keys(1, b"n"))[0] >= 0
    assert ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    usage = {n.namespace: n for n in ix.namespace_usage()}
    assert (usage[NS_A].blocks, usage[NS_A].quota_bytes) == (2, 2 * SMALL.slot_bytes)
    with pytest.raises(OutOfRange):
        ix.register_namespace(NS_A, SMALL, quota_bytes=-1)
    ix.register_namespace(NS_A, SMALL)               # no declaration: the daemon's cap again
    assert ix.quota_of(NS_A) == cap
    assert all(r >= 0 for r in store(ix, NS_A, keys(3, b"m")))
    assert ix.used_bytes_of(NS_A) == cap


def test_a_quota_can_be_lifted(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
    store(ix, NS_A, keys(4, b"a"))
    assert ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.register_namespace(NS_A, SMALL)
    assert ix.quota_of(NS_A) == 0
    store(ix, NS_A, keys(4, b"b"))
    assert ix.used_bytes_of(NS_A) == 6 * SMALL.slot_bytes and ix.stats.evictions == 0


def test_quota_accounting_survives_reset_expiry_and_adoption(pool_config):
    pool = Pool.open(pool_config)
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=8 * SMALL.slot_bytes)
    store(ix, NS_A, keys(3, b"r"))
    ix.prepare_store(NS_A, keys(2, b"late"), OWNER, 0)
    assert ix.used_bytes_of(NS_A) == 5 * SMALL.slot_bytes
    ix.expire(1000)                                   # the prepared ones time out
    assert ix.used_bytes_of(NS_A) == 3 * SMALL.slot_bytes
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        ix2.adopt()
        assert ix2.used_bytes_of(NS_A) == 3 * SMALL.slot_bytes
        ix2.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
        assert store(ix2, NS_A, keys(1, b"new"))[0] >= 0       # evicts 2 adopted blocks
        assert ix2.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
        ix2.reset(NS_A)
        assert ix2.used_bytes_of(NS_A) == 0
    finally:
        pool2.close(unlink=True)


# ---- head-split slots: one namespace for every TP size ------------------------------------

def _heads(tp: int, heads: int = 4, row: int = 256, rows: int = 16) -> Layout:
    """A head-split layout of ``heads`` KV heads as one rank of ``tp`` holds it."""
    local = max(1, heads // tp)
    return Layout(16, tp, "f16", (rows * local * row // 2,) * 2, "heads", heads, row)


def test_tp_cross_index_commits_once_every_head_range_landed_from_any_tp_size(index):
    one, two, four = _heads(1), _heads(2), _heads(4)
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
    two = _heads(2)
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
    gqa = _heads(4, heads=2)
    assert [gqa.head_range(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [gqa.rank_mask(r) for r in range(4)] == [0b01, 0, 0b10, 0]
    assert gqa.full_mask == 0b11 and gqa.canonical() == _heads(1, heads=2).canonical()
    mla = _heads(8, heads=1)          # one latent copy for every rank: rank 0 stores it
    assert [mla.rank_mask(r) for r in range(8)] == [1] + [0] * 7
    assert mla.canonical() == _heads(1, heads=1).canonical() == _heads(2, heads=1).canonical()


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


# ---- reservations: stores planned without a round trip ----------------------------------------

def test_reserved_slots_are_bound_by_the_first_rank_and_visible_after_the_last(index):
    refs = index.reserve(NS_TP2, 3, OWNER, now=0)
    assert len(refs) == 3 and index.ticket_count == 3
    assert index.slot_counts() == (0, 0, 0)   # a ticket is no slot
    ks = keys(3, b"r")
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    r0 = index.begin_store(NS_TP2, refs, 0, keys=ks, now=1)
    assert index.ticket_count == 0 and index.slot_counts()[0] == 3
    # bound now: a prepare_store of those keys finds them in flight
    assert index.prepare_store(NS_TP2, ks, OTHER, 1) == [SLOT_PRESENT] * 3
    index.end_store(r0, 0, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]   # rank 1 not landed
    with pytest.raises(ProtocolError, match="another key"):
        index.begin_store(NS_TP2, refs, 1, keys=keys(3, b"x"), now=1)
    r1 = index.begin_store(NS_TP2, refs, 1, keys=ks, now=1)
    assert r1 == r0                          # the tickets name the slots rank 0 bound
    index.end_store(r1, 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks], False, OWNER, 0)
    assert hits == [3] and slots[0] == [s.ref for s in r0]


def test_a_key_already_held_binds_as_a_duplicate_never_written_nor_shown_twice(index):
    ks = keys(2, b"d")
    first = index.reserve(NS_TP2, 2, OWNER, now=0)        # engine A
    second = index.reserve(NS_TP2, 3, OTHER, now=0)       # engine B, same keys, later
    a0 = index.begin_store(NS_TP2, first, 0, keys=ks, now=0)
    b0 = index.begin_store(NS_TP2, second[:2], 0, keys=ks, now=0)   # both keys in flight from A
    assert [s.void for s in a0] == [False, False] and [s.void for s in b0] == [True, True]
    index.end_store(a0, 0, True)
    index.end_store(b0, 0, True)
    index.end_store(index.begin_store(NS_TP2, first, 1, keys=ks, now=0), 1, True)
    assert index.slot_counts()[:2] == (0, 2)              # B's duplicates take no slot
    b1 = index.begin_store(NS_TP2, second[:2], 1, keys=ks, now=0)
    assert b1 == b0 and all(s.void for s in b1)           # rank 1 finds rank 0's voids
    index.end_store(b1, 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks], False, OWNER, 0)
    assert hits == [2] and slots[0] == [s.ref for s in a0]   # A's blocks, once
    assert index.slot_counts()[:2] == (0, 2) and index.stats.duplicate_blocks == 2
    # a committed key is a duplicate too, and so is a key named twice in one job
    k = keys(1, b"e")
    r = index.begin_store(NS_TP2, second[2:] + index.reserve(NS_TP2, 1, OTHER, 0), 0,
                          keys=ks[:1] + k, now=0)
    assert [s.void for s in r] == [True, False]
    index.end_store(r, 0, True)
    twice = index.reserve(NS_SMALL, 2, OWNER, 0)
    r = index.begin_store(NS_SMALL, twice, 0, keys=k + k, now=0)
    assert [s.void for s in r] == [False, True]
    index.end_store(r, 0, True)
    assert index.lookup(NS_SMALL, [k], False, OWNER, 0)[0] == [1]


def test_a_failed_primary_leaves_its_duplicate_unwritten_and_the_key_absent(index):
    ks = keys(1, b"f")
    a = index.begin_store(NS_SMALL, index.reserve(NS_SMALL, 1, OWNER, 0), 0, keys=ks, now=0)
    b = index.begin_store(NS_SMALL, index.reserve(NS_SMALL, 1, OTHER, 0), 0, keys=ks, now=0)
    index.end_store(a, 0, ok=False)
    index.end_store(b, 0, ok=True)     # nothing was copied into it: it must not commit
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [0]
    assert index.slot_counts() == (0, 0, 0)


def test_unused_reservations_expire_and_their_refs_are_refused_after(index):
    refs = index.reserve(NS_SMALL, 4, OWNER, now=100)
    assert index.expire(now=100 + index.reserve_ttl_s - 0.01) == (0, 0, 0)
    used = index.begin_store(NS_SMALL, refs[:1], 0, keys=keys(1, b"u"), now=101)
    assert index.expire(now=100 + index.reserve_ttl_s) == (0, 0, 3)
    assert index.ticket_count == 0 and index.slot_counts()[2] == SMALL.slot_bytes
    with pytest.raises(UnknownId, match="expired"):
        index.begin_store(NS_SMALL, refs[1:2], 0, keys=keys(1, b"v"), now=200)
    # new tickets never repeat an expired one's ref: the old ref still names nothing writable
    again = index.reserve(NS_SMALL, 8, OTHER, now=200)
    assert not set(again) & set(refs)
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, refs[1:2], 0, keys=keys(1, b"v"), now=200)
    index.end_store(used, 0, True)
    assert index.lookup(NS_SMALL, [keys(1, b"u")], False, OWNER, 0)[0] == [1]


def test_reservations_go_with_their_owner_or_an_abort_and_survive_a_reset(index):
    mine = index.reserve(NS_SMALL, 3, OWNER, 0)
    theirs = index.reserve(NS_SMALL, 2, OTHER, 0)
    assert index.abort_store(mine[:1], OTHER) == 0          # not theirs to give back
    assert index.abort_store(mine[:1], OWNER) == 1
    assert index.reset(NS_SMALL) == 0 and index.ticket_count == 4
    index.release_owner(OWNER)
    assert index.ticket_count == 2
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, mine[1:], 0, keys=keys(2), now=0)
    index.end_store(index.begin_store(NS_SMALL, theirs, 0, keys=keys(2), now=0), 0, True)
    assert index.lookup(NS_SMALL, [keys(2)], False, OWNER, 0)[0] == [2]


def test_bad_reservations_and_keyless_stores_into_reserved_slots_are_refused(index):
    with pytest.raises(OutOfRange):
        index.reserve(NS_SMALL, -1, OWNER, 0)
    with pytest.raises(OutOfRange):
        index.reserve(NS_SMALL, 1 << 20, OWNER, 0)
    with pytest.raises(UnknownId, match="no registered layout"):
        index.reserve(b"?" * 16, 1, OWNER, 0)
    refs = index.reserve(NS_SMALL, 2, OWNER, 0)
    with pytest.raises(UnknownId, match="must name its key"):
        index.begin_store(NS_SMALL, refs, 0)
    with pytest.raises(UnknownId):                        # another namespace's slots
        index.begin_store(NS_BIG, refs, 0, keys=keys(2), now=0)
    assert index.ticket_count == 2                      # nothing was bound by the failures


def test_quotas_apply_when_tickets_are_bound_and_owners_hold_up_to_the_pools_slot_count(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
    old = keys(1, b"old")
    store(ix, NS_A, old)
    lease = ix.lookup(NS_A, [old], True, OWNER, 0)[1][0]           # pinned: not evictable
    refs = ix.reserve(NS_A, 5, OWNER, 0)
    assert len(refs) == 5 and ix.used_bytes_of(NS_A) == SMALL.slot_bytes   # stock: no quota
    ks = keys(3, b"q")
    slots = ix.begin_store(NS_A, refs[:3], 0, keys=ks, now=0)
    # one fits the quota; the others find nothing of A's own to evict: void, not written
    assert [s.void for s in slots] == [False, True, True]
    ix.end_store(slots, 0, True)
    assert ix.lookup(NS_A, [ks], False, OWNER, 0)[0] == [1]
    assert ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.release_leases([lease], OWNER)
    slots = ix.begin_store(NS_A, refs[3:4], 0, keys=keys(1, b"n"), now=0)  # evicts "old" now
    assert [s.void for s in slots] == [False]
    ix.end_store(slots, 0, True)
    assert ix.lookup(NS_A, [old], False, OWNER, 0)[0] == [0]
    assert ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.register_namespace(NS_B, SMALL)
    # Tickets cost bookkeeping only: an owner may hold as many as the pool has slots of the
    # size (the bound on the daemon's memory), whatever the slots hold now.
    share = pool.geometry.num_extents * pool.slots_per_extent(SMALL.slot_bytes) - 1  # 1 held
    assert len(ix.reserve(NS_B, share + 10, OWNER, 0)) == share
    assert ix.reserve(NS_B, 1, OWNER, 0) == []            # its bound is reached
    assert len(ix.reserve(NS_B, 1, OTHER, 0)) == 1         # another client still gets some
    ix.expire(1000)
    assert ix.ticket_count == 0 and ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    assert len(ix.reserve(NS_B, 2, OWNER, 1000)) == 2      # the tickets are back


def test_a_restart_drops_reservations_with_the_pool_records(pool_config):
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    store(ix, NS_SMALL, keys(2))
    refs = ix.reserve(NS_SMALL, 3, OWNER, 0)
    ix.begin_store(NS_SMALL, refs[:1], 0, keys=keys(1, b"half"), now=0)   # bound, never landed
    pool.close(unlink=False)   # as after kill -9
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == 2 and ix2.ticket_count == 0
        assert ix2.slot_counts()[:2] == (0, 2)
        with pytest.raises(OutOfRange, match="restart"):     # tickets of another life
            ix2.begin_store(NS_SMALL, refs[1:], 0, keys=keys(2, b"late"), now=0)
    finally:
        pool2.close(unlink=True)


def test_reserved_slots_bind_with_head_range_masks_of_any_tp_size(index):
    """Reservations meet head-split slots: whichever rank's store comes first binds the slot
    with its head range; the block commits once every head landed; another engine (another TP
    size) naming the same keys gets duplicates, freed once all its ranks reported them."""
    two, four = _heads(2), _heads(4)
    ns = b"H" * 16
    index.register_namespace(ns, two)
    ks = keys(2, b"h")
    refs = index.reserve(ns, 2, OWNER, now=0)
    r1 = index.begin_store(ns, refs, 1, two.rank_mask(1), keys=ks, now=0)   # rank 1 first
    assert not any(s.void for s in r1) and index.ticket_count == 0
    index.end_store(r1, 1, True, two.rank_mask(1))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [0]               # heads 0-1 missing
    with pytest.raises(ProtocolError, match="overlapping head ranges"):
        index.begin_store(ns, refs, 3, four.rank_mask(3), keys=ks, now=0)  # head 3 is in
    r0 = index.begin_store(ns, refs, 0, two.rank_mask(0), keys=ks, now=0)
    index.end_store(r0, 0, True, two.rank_mask(0))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [2]
    dup = index.reserve(ns, 2, OTHER, now=0)
    for rank in range(4):
        got = index.begin_store(ns, dup, rank, four.rank_mask(rank), keys=ks, now=0)
        assert all(s.void for s in got)
        index.end_store(got, rank, True, four.rank_mask(rank))
        assert index.slot_counts()[0] == 0                # voids take no slot
    assert index.stats.duplicate_blocks == 2
    with pytest.raises(UnknownId):                          # forgotten once all reported
        index.begin_store(ns, dup, 0, four.rank_mask(0), keys=ks, now=0)
    hits, _, slots = index.lookup(ns, [ks], False, OWNER, 0)
    assert hits == [2] and slots[0] == [s.ref for s in r1]


def test_tickets_hold_no_extent_against_another_size_and_still_bind_after(index):
    """A ticket is no slot: a pool all of one size, with tickets of that size outstanding,
    gives a new size an extent as it would without them, and the tickets still bind later
    (to slots found then)."""
    n = 0
    while index.slot_counts()[1] == n:                      # the pool is all BIG, committed
        index.end_store(index.begin_store(NS_BIG, index.prepare_store(
            NS_BIG, keys(1, b"b%d" % n), OWNER, 0), 0), 0, True)
        n += 1
    full = index.slot_counts()[1]
    tickets = index.reserve(NS_BIG, 2, OTHER, now=0)
    assert len(tickets) == 2 and index.slot_counts()[1] == full   # nothing evicted for them
    refs = index.prepare_store(NS_SMALL, keys(1, b"s"), OWNER, 1)
    assert refs[0] >= 0 and index.ticket_count == 2
    slots = index.begin_store(NS_BIG, tickets, 0, keys=keys(2, b"late"), now=1)
    assert not any(s.void for s in slots) and index.end_store(slots, 0, True) == 2
    assert index.lookup(NS_BIG, [keys(2, b"late")], False, OWNER, 1)[0] == [2]


def _records_match_slots(ix):
    """Every slot's pool record says what the index would adopt: COMMITTED with its key for a
    committed slot, WRITING for one being written or filled, FREE for a free one;
    and the slot's current generation (the one in its ref)."""
    from kvpool.daemon.index import FILLING
    from kvpool.daemon.pool import COMMITTED, FREE, WRITING
    want_state = {FREE: FREE, WRITING: WRITING, FILLING: WRITING, COMMITTED: COMMITTED}
    for s in ix._slots.values():
        rec = ix.pool.records(s.extent)[s.index]
        assert int(rec["state"]) == want_state[s.state], (s.id, s.state)
        assert int(rec["generation"]) == s.generation, s.id
        if s.state == COMMITTED:
            assert bytes(rec["key"]) == s.key


def test_batched_record_writes_mirror_the_index_through_every_store_path(pool_config):
    """Claims (prepare_store, reserve, reserve_fills), binds and commits write their records
    in batches; evictions and frees one by one. Whatever the mix, each record ends as the slot
    is, and a restarted daemon adopts exactly the committed blocks."""
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    ix.register_namespace(NS_TP2, TP2)
    store(ix, NS_SMALL, keys(40, b"a"))                          # prepared, committed
    refs = ix.reserve(NS_SMALL, 30, OWNER, 0)                    # tickets ...
    ks = keys(20, b"b") + keys(5, b"a")                          # ... 5 of them duplicates
    ix.end_store(ix.begin_store(NS_SMALL, refs[:25], 0, keys=ks), 0, True)
    ix.abort_store(refs[25:27], OWNER)                           # 3 tickets left
    half = ix.prepare_store(NS_TP2, keys(6, b"c"), OWNER, 0)     # one rank of two landed
    ix.end_store(ix.begin_store(NS_TP2, half, 0), 0, True)
    fills = ix.reserve_fills(NS_SMALL, keys(4, b"d"), 0)
    ix.end_fill(fills, [True, False, True, True])
    _records_match_slots(ix)
    n = capacity(ix, SMALL, NS_SMALL)                            # evicts everything unpinned
    assert n > 0
    _records_match_slots(ix)
    committed = ix.slot_counts()[1]
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == committed
        _records_match_slots(ix2)
    finally:
        pool2.close(unlink=True)


def test_one_store_binding_two_owners_tickets_counts_each_owner_its_own(pool):
    """Bind counts tickets per owner once per store: a store naming tickets of two
    schedulers takes from each owner's count exactly its own, and counts the bound blocks
    (not the duplicate) against the namespace."""
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    mine, theirs = ix.reserve(NS_SMALL, 20, OWNER, 0), ix.reserve(NS_SMALL, 20, OTHER, 0)
    assert len(mine) == len(theirs) == 20
    ks = keys(5)
    refs = mine[:3] + theirs[:2] + theirs[2:3]
    slots = ix.begin_store(NS_SMALL, refs, 0, keys=ks + ks[:1])    # the last: a duplicate
    assert [s.void for s in slots] == [False] * 5 + [True]
    assert ix.used_bytes_of(NS_SMALL) == 5 * SMALL.slot_bytes
    assert ix.tickets.held == {(OWNER, SMALL.slot_bytes): 17, (OTHER, SMALL.slot_bytes): 17}
    assert ix.ticket_count == 34
    assert ix.end_store(slots, 0, True) == 5
    assert ix.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [5]
    ix.abort_store(mine[3:], OWNER)
    assert ix.tickets.held == {(OTHER, SMALL.slot_bytes): 17}
    ix.release_owner(OWNER)
    ix.release_owner(OTHER)
    assert ix.ticket_count == 0 and ix.used_bytes_of(NS_SMALL) == 5 * SMALL.slot_bytes
    assert ix.tickets.held == {} and not ix.tickets.grants


def test_a_store_job_ended_chunk_by_chunk_commits_only_what_landed(index):
    """The server ends a big store's slots in chunks as their copies land, then the rest
    with the job's outcome: a job that fails after two chunks keeps exactly those, frees the
    others, and leaves nothing pinned or writing."""
    ks = keys(12)
    refs = index.prepare_store(NS_SMALL, ks, OWNER, 0)
    slots = index.begin_store(NS_SMALL, refs, 0)
    index.end_store(slots[:4], 0, True)
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [4]
    assert index.slot_counts()[:2] == (8, 4)
    index.end_store(slots[4:8], 0, True)
    index.end_store(slots[8:], 0, False)                 # the copy failed in the third chunk
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [8]
    writing, committed, used = index.slot_counts()
    assert (writing, committed, used) == (0, 8, 8 * SMALL.slot_bytes)
    assert index.pinned_count() == 0
    # the failed keys can be stored again, into fresh slots
    assert all(r >= 0 for r in index.prepare_store(NS_SMALL, ks[8:], OWNER, 0))


def test_a_chunk_of_one_rank_commits_nothing_until_every_rank_landed(index):
    ks = keys(4)
    refs = index.prepare_store(NS_TP2, ks, OWNER, 0)
    r0 = index.begin_store(NS_TP2, refs, 0)
    r1 = index.begin_store(NS_TP2, refs, 1)
    index.end_store(r0[:2], 0, True)                     # rank 0's first chunk
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    index.end_store(r1[:2], 1, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [2]
    index.end_store(r0[2:], 0, False)                    # rank 0 fails the rest
    index.end_store(r1[2:], 1, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [2]
    assert index.slot_counts()[:2] == (0, 2)


def _pins(ix, refs):
    return [(ix._slots[r & 0xFFFF_FFFF].pins, ix._slots[r & 0xFFFF_FFFF].writing) for r in refs]


def _pinned_total(ix):
    return sum(s.pins for s in ix._slots.values())


def test_a_keyed_store_refused_at_its_last_slot_leaves_every_slot_as_it_was(index):
    """A store of tickets refused at its last ref (the one-pass check, then the ref-by-ref
    one that says why) allocates, pins and binds nothing, and the same tickets still bind and
    commit after."""
    refs = index.reserve(NS_SMALL, 4, OWNER, 0)
    ks = keys(4, b"u")
    for bad in ([refs[3] + (1 << 32)], [0xFFFF_FFF0], [1], [refs[0]]):  # stale, unknown, twice
        with pytest.raises((UnknownId, OutOfRange, ProtocolError)):
            index.begin_store(NS_SMALL, refs[:3] + bad, 0, keys=ks, now=0)
        assert _pinned_total(index) == 0 and not index._bound
        assert index.ticket_count == 4 and index.slot_counts() == (0, 0, 0)
        assert index.used_bytes_of(NS_SMALL) == 0
    with pytest.raises(ProtocolError, match="another key"):       # a bound slot, wrong key
        index.begin_store(NS_TP2, *_bound_tp2(index, ks), keys=keys(4, b"v"), now=0)
    assert index.end_store(index.begin_store(NS_SMALL, refs, 0, keys=ks, now=0), 0, True) == 4
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [4]


def _bound_tp2(ix, ks):
    """TP2 tickets bound to ``ks`` by rank 0's store; (refs, 1) for rank 1's."""
    refs = ix.reserve(NS_TP2, len(ks), OWNER, 0)
    ix.begin_store(NS_TP2, refs, 0, keys=ks, now=0)
    return refs, 1


def test_open_store_leaves_pins_and_only_bindings_that_cannot_void_a_slot_for_later(pool):
    """open_store checks everything, finds the tickets' slots, and hands back, as ``finish``,
    the pins and the binding where nothing can come out void (every ref an unbound ticket,
    keys distinct and unheld, no quota, room for all): the server runs it once the copy has
    gone out. Before it, the slots are unpinned and unseen; after it, the index is as
    begin_store leaves it."""
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    ix.register_namespace(NS_TP2, TP2)
    refs = ix.reserve(NS_SMALL, 6, OWNER, 0)
    ks = keys(6, b"o")
    job = ix.open_store(NS_SMALL, refs, 0, keys=ks, now=0)
    assert job.finish is not None and not job.has_voids
    assert ix.ticket_count == 6 and all(s.pins == 0 and s.writing == 0 for s in job.slots)
    assert ix.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [0]
    job.finish()
    assert all(s.pins == 1 and s.writing == 1 and not s.void for s in job.slots)
    assert ix.ticket_count == 0 and ix.slot_counts()[0] == 6
    assert ix.used_bytes_of(NS_SMALL) == 6 * SMALL.slot_bytes and ix.tickets.held == {}
    assert ix.prepare_store(NS_SMALL, ks, OTHER, 0) == [SLOT_PRESENT] * 6
    assert ix.end_store(job.slots, 0, True) == 6
    _records_match_slots(ix)
    # prepared slots: pins later, nothing to bind
    prep = ix.prepare_store(NS_SMALL, keys(2, b"r"), OWNER, 0)
    job = ix.open_store(NS_SMALL, prep, 0)
    assert [s.pins for s in job.slots] == [0, 0] and not job.has_voids
    job.finish()
    assert ix.end_store(job.slots, 0, True) == 2
    # a key held already, a key named twice, a namespace with a quota: bound and pinned now
    more = ix.reserve(NS_SMALL, 4, OWNER, 0)
    for refs2, ks2 in ((more[:2], ks[:1] + keys(1, b"p")), (more[2:], keys(1, b"q") * 2)):
        job = ix.open_store(NS_SMALL, refs2, 0, keys=ks2, now=0)
        assert job.finish is None and job.has_voids
        assert [s.void for s in job.slots].count(True) == 1
        assert all(s.pins == 1 for s in job.slots)
        ix.end_store(job.slots, 0, True)
    ix.register_namespace(NS_TP2, TP2, quota_bytes=64 * TP2.slot_bytes)
    tp = ix.reserve(NS_TP2, 2, OWNER, 0)
    job = ix.open_store(NS_TP2, tp, 0, keys=keys(2, b"t"), now=0)
    assert job.finish is None and not job.has_voids and ix.ticket_count == 0
    # the other rank's store of bound slots has nothing to bind, only its pins
    job1 = ix.open_store(NS_TP2, tp, 1, keys=keys(2, b"t"), now=0)
    assert job1.finish is not None and not job1.has_voids
    job1.finish()
    assert [s.writing for s in job1.slots] == [3, 3]
    _records_match_slots(ix)
    with pytest.raises(ProtocolError, match="1 keys for 2 slots"):
        ix.open_store(NS_TP2, tp, 1, keys=keys(1, b"t"), now=0)


def test_a_load_refused_at_its_last_slot_leaves_every_pin_as_it_was(index):
    ks = keys(3, b"l")
    store(index, NS_SMALL, ks)
    _, _, refs = index.lookup(NS_SMALL, [ks], False, OWNER, 0)
    refs = refs[0]
    before = _pins(index, refs)
    with pytest.raises(LeaseExpired):
        index.begin_load(NS_SMALL, refs[:2] + [refs[2] + (1 << 32)])
    with pytest.raises(LeaseExpired):
        index.begin_load(NS_BIG, refs)                   # another namespace
    with pytest.raises(OutOfRange):
        index.begin_load(NS_SMALL, refs[:2] + [0xFFFF_FFF0])
    assert _pins(index, refs) == before
    slots = index.check_load(NS_SMALL, refs)             # checked, pinned by the caller later
    assert _pins(index, refs) == before and slots == index.begin_load(NS_SMALL, refs)
    index.end_load(slots, True)
    slots = index.begin_load(NS_SMALL, refs + refs[:1])  # a slot named twice: pinned twice
    assert [s.pins for s in slots] == [2, 1, 1, 2]
    index.end_load(slots, True)
    assert _pins(index, refs) == before


# ---- tickets: reservations that hold no slot (issue 26, guarantee 2) ---------------------------

def _pool_slots(pool, layout):
    return pool.geometry.num_extents * pool.slots_per_extent(layout.slot_bytes)


def _fill(ix, ns, n, prefix=b"full"):
    """``n`` committed blocks of ``ns``, stored in batches; their keys."""
    ks = keys(n, prefix)
    for i in range(0, n, 256):
        store(ix, ns, ks[i:i + 256])
    return ks


def test_a_reservation_on_a_full_pool_evicts_nothing_and_is_granted_whole(pool_config):
    """A pool full of committed blocks; a new owner asks for 1000 tickets: it gets 1000 (the
    pool has more slots), not a share of the pool, and every committed block is still
    there."""
    pool = Pool.open(msgspec.structs.replace(pool_config, pool_size="24MiB"))   # 1/8 of it: < 1000 slots
    try:
        _full_pool_reservation(pool)
    finally:
        pool.close(unlink=True)


def _full_pool_reservation(pool):
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    cap = _pool_slots(pool, SMALL)
    held = _fill(ix, NS_SMALL, cap)
    assert ix.slot_counts()[1] == cap and ix.stats.evictions == 0
    assert cap > 1000
    refs = ix.reserve(NS_SMALL, 1000, OTHER, now=0)
    assert len(refs) == 1000 and ix.ticket_count == 1000
    assert ix.stats.evictions == 0 and ix.slot_counts()[1] == cap
    assert sum(ix.lookup(NS_SMALL, [[k] for k in held], False, OWNER, 0)[0]) == cap
    # the bound is the pool's slot count per owner and size, whatever the slots hold
    assert len(ix.reserve(NS_SMALL, MAX_RESERVE, OTHER, 0)) == cap - len(refs)
    assert ix.reserve(NS_SMALL, 1, OTHER, 0) == []
    assert len(ix.reserve(NS_SMALL, cap, OWNER, 0)) == cap   # each owner has its own


def test_sustained_stores_through_tickets_keep_a_full_pool_committed(pool):
    """Rounds of a scheduler's life on a full pool: reserve a stock, store some of it by key,
    look up and load recent blocks, let the rest of the stock expire. Committed blocks stay at
    >= 95% of the pool's slots after every round (tickets never hold a slot; only a job in
    flight does)."""
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60, reserve_ttl_s=2.0)
    ix.register_namespace(NS_SMALL, SMALL)
    cap = _pool_slots(pool, SMALL)
    _fill(ix, NS_SMALL, cap)
    shares = []
    now = 0.0
    for r in range(60):
        now += 0.25
        ix.expire(now)
        stock = ix.reserve(NS_SMALL, 128, OWNER, now)
        ks = keys(48, b"r%03d" % r)
        slots = ix.begin_store(NS_SMALL, stock[:48], 0, keys=ks, now=now)
        assert not any(s.void for s in slots)
        ix.end_store(slots[:24], 0, True)                  # chunk by chunk, as the server
        ix.end_store(slots[24:], 0, True)
        hits, leases, refs = ix.lookup(NS_SMALL, [ks], True, OWNER, now)
        assert hits == [48]
        ix.end_load(ix.begin_load(NS_SMALL, refs[0]), True)
        ix.release_leases(leases, OWNER)
        shares.append(ix.slot_counts()[1] / cap)
    assert min(shares) >= 0.95, f"committed share fell to {min(shares):.3f}"
    assert ix.ticket_count > 0                              # the stock was there throughout


def test_tickets_void_duplicates_and_blocks_without_room_and_count_them(index):
    """Every slot pinned: tickets are still granted; at bind, a held key is a duplicate and a
    fresh one finds no room (void, counted in no_room_blocks); nothing is written, evicted or
    left behind, and once a slot is free a ticket binds again."""
    n = capacity(index, BIG, NS_BIG)                       # every slot BIG, leased
    held = keys(1, b"cap0")
    tickets = index.reserve(NS_BIG, 4, OTHER, now=0)
    assert len(tickets) == 4
    ks = held + keys(2, b"new") + keys(1, b"new")          # held, two fresh, one named twice
    job = index.open_store(NS_BIG, tickets, 0, keys=ks, now=0)
    assert job.has_voids and all(s.void for s in job.slots)
    assert index.stats.duplicate_blocks == 1 and index.stats.no_room_blocks == 3
    assert index.end_store(job.slots, 0, True) == 0
    assert index.slot_counts()[:2] == (0, n) and index.ticket_count == 0 and not index._bound
    with pytest.raises(UnknownId):                          # spent
        index.begin_store(NS_BIG, tickets[1:2], 0, keys=ks[1:2], now=0)
    lease = index.lookup(NS_BIG, [keys(1, b"cap1")], False, OWNER, 0)
    index.release_leases(list(range(1, n + 1)), OWNER)     # every lease goes
    more = index.reserve(NS_BIG, 1, OTHER, now=0)
    slots = index.begin_store(NS_BIG, more, 0, keys=keys(1, b"late"), now=0)
    assert not slots[0].void and index.end_store(slots, 0, True) == 1
    assert lease[0] == [1] and index.stats.no_room_blocks == 3


def test_ticket_refs_are_no_slot_refs_and_stale_expired_or_aborted_ones_are_refused(index):
    ks = keys(2, b"t")
    tickets = index.reserve(NS_SMALL, 4, OWNER, now=0)
    first = index.pool.geometry.num_extents * index.pool.slot_id_stride
    assert all(r & 0xFFFF_FFFF >= first and 0 < r < 1 << 63 for r in tickets)
    assert index.abort_store(tickets[:1], OWNER) == 1
    with pytest.raises(UnknownId, match="aborted"):
        index.begin_store(NS_SMALL, tickets[:1], 0, keys=ks[:1], now=0)
    for never in (tickets[1] + (1 << 32), tickets[-1] + 1000):   # another generation, index
        with pytest.raises(OutOfRange, match="no ticket"):
            index.begin_store(NS_SMALL, [never], 0, keys=ks[:1], now=0)
    with pytest.raises(OutOfRange):                         # a ticket is nothing to load
        index.begin_load(NS_SMALL, tickets[1:2])
    slots = index.begin_store(NS_SMALL, tickets[1:3], 0, keys=ks, now=0)
    assert index.end_store(slots, 0, True) == 2
    with pytest.raises(UnknownId):                          # bound, committed: spent
        index.begin_store(NS_SMALL, tickets[1:2], 0, keys=ks[:1], now=0)
    assert index.expire(now=index.reserve_ttl_s) == (0, 0, 1)
    with pytest.raises(UnknownId, match="expired"):
        index.begin_store(NS_SMALL, tickets[3:], 0, keys=keys(1, b"x"), now=20)
    assert index.ticket_count == 0 and not index.tickets.grants and not index.tickets.held


def test_an_owner_gone_takes_its_tickets_and_what_they_bound(index):
    """release_owner: unbound tickets go, a slot one of them bound (still being written)
    is dropped, a void placeholder is forgotten; another owner's tickets stay."""
    mine = index.reserve(NS_TP2, 4, OWNER, now=0)
    theirs = index.reserve(NS_TP2, 2, OTHER, now=0)
    store(index, NS_TP2, keys(1, b"held"), ranks=(0, 1))
    r0 = index.begin_store(NS_TP2, mine[:2], 0, keys=keys(1, b"held") + keys(1, b"w"), now=0)
    assert [s.void for s in r0] == [True, False]
    index.end_store(r0, 0, True)                            # rank 1 never comes
    assert index.ticket_count == 4 and len(index._bound) == 2
    index.release_owner(OWNER)
    assert index.ticket_count == 2 and not index._bound and index.slot_counts()[0] == 0
    for refs in (mine[:1], mine[1:2], mine[2:3]):
        with pytest.raises(UnknownId):
            index.begin_store(NS_TP2, refs, 1, keys=keys(1, b"w"), now=0)
    slots = index.begin_store(NS_TP2, theirs, 0, keys=keys(2, b"o"), now=0)
    index.end_store(slots, 0, True)
    index.end_store(index.begin_store(NS_TP2, theirs, 1, keys=keys(2, b"o"), now=0), 1, True)
    assert index.lookup(NS_TP2, [keys(2, b"o")], False, OWNER, 0)[0] == [2]
