"""The index on a real (small) shm pool, without sockets: states, leases, eviction, adoption."""

import pytest

from kvpool.daemon.index import RESERVE_SHARE, Index
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import (LayoutMismatch, LeaseExpired, OutOfRange, PoolFull,
                                  ProtocolError, UnknownId)
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import SLOT_NO_SPACE, SLOT_PRESENT

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


# ---- P/D hand-off families ---------------------------------------------------------------

def test_handoff_refuses_another_tp_size_while_the_other_is_registered(index):
    family = b"F" * 16
    live: set[bytes] = {NS_SMALL}
    index.check_handoff(family, NS_SMALL, 1, live.__contains__)
    index.check_handoff(family, NS_SMALL, 1, live.__contains__)    # the same again: fine
    with pytest.raises(LayoutMismatch, match="tensor_parallel_size=2.*tensor_parallel_size=1"):
        index.check_handoff(family, NS_TP2, 2, live.__contains__)
    index.check_handoff(b"G" * 16, NS_TP2, 2, live.__contains__)   # another model: fine
    index.check_handoff(b"", NS_TP2, 2, live.__contains__)         # not P/D: fine
    store(index, NS_SMALL, keys(1))
    live.clear()            # the TP=1 engines stopped: the fleet may move to TP=2, blocks or not
    index.check_handoff(family, NS_TP2, 2, live.__contains__)
    live.add(NS_TP2)
    with pytest.raises(LayoutMismatch, match="tensor_parallel_size=1.*tensor_parallel_size=2"):
        index.check_handoff(family, NS_SMALL, 1, live.__contains__)


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
    assert len(refs) == 3 and index.reserved_count == 3
    assert index.slot_counts()[0] == 0      # reserved is not writing
    ks = keys(3, b"r")
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    r0 = index.begin_store(NS_TP2, refs, 0, ks, now=1)
    assert index.reserved_count == 0 and index.slot_counts()[0] == 3
    # bound now: a prepare_store of those keys finds them in flight
    assert index.prepare_store(NS_TP2, ks, OTHER, 1) == [SLOT_PRESENT] * 3
    index.end_store(r0, 0, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]   # rank 1 not landed
    with pytest.raises(ProtocolError, match="another key"):
        index.begin_store(NS_TP2, refs, 1, keys(3, b"x"), now=1)
    index.end_store(index.begin_store(NS_TP2, refs, 1, ks, now=1), 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks], False, OWNER, 0)
    assert hits == [3] and slots[0] == refs


def test_a_key_already_held_binds_as_a_duplicate_never_written_nor_shown_twice(index):
    ks = keys(2, b"d")
    first = index.reserve(NS_TP2, 2, OWNER, now=0)        # engine A
    second = index.reserve(NS_TP2, 3, OTHER, now=0)       # engine B, same keys, later
    a0 = index.begin_store(NS_TP2, first, 0, ks, now=0)
    b0 = index.begin_store(NS_TP2, second[:2], 0, ks, now=0)   # both keys in flight from A
    assert [s.void for s in a0] == [False, False] and [s.void for s in b0] == [True, True]
    index.end_store(a0, 0, True)
    index.end_store(b0, 0, True)
    index.end_store(index.begin_store(NS_TP2, first, 1, ks, now=0), 1, True)
    assert index.slot_counts()[:2] == (2, 2)              # B's duplicates wait for rank 1
    b1 = index.begin_store(NS_TP2, second[:2], 1, ks, now=0)
    index.end_store(b1, 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks], False, OWNER, 0)
    assert hits == [2] and slots[0] == first              # A's blocks, once
    assert index.slot_counts()[:2] == (0, 2) and index.stats.duplicate_blocks == 2
    # a committed key is a duplicate too, and so is a key named twice in one job
    k = keys(1, b"e")
    r = index.begin_store(NS_TP2, second[2:] + index.reserve(NS_TP2, 1, OTHER, 0), 0,
                          ks[:1] + k, now=0)
    assert [s.void for s in r] == [True, False]
    index.end_store(r, 0, True)
    twice = index.reserve(NS_SMALL, 2, OWNER, 0)
    r = index.begin_store(NS_SMALL, twice, 0, k + k, now=0)
    assert [s.void for s in r] == [False, True]
    index.end_store(r, 0, True)
    assert index.lookup(NS_SMALL, [k], False, OWNER, 0)[0] == [1]


def test_a_failed_primary_leaves_its_duplicate_unwritten_and_the_key_absent(index):
    ks = keys(1, b"f")
    a = index.begin_store(NS_SMALL, index.reserve(NS_SMALL, 1, OWNER, 0), 0, ks, now=0)
    b = index.begin_store(NS_SMALL, index.reserve(NS_SMALL, 1, OTHER, 0), 0, ks, now=0)
    index.end_store(a, 0, ok=False)
    index.end_store(b, 0, ok=True)     # nothing was copied into it: it must not commit
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [0]
    assert index.slot_counts() == (0, 0, 0)


def test_unused_reservations_expire_and_their_refs_are_refused_after(index):
    refs = index.reserve(NS_SMALL, 4, OWNER, now=100)
    assert index.expire(now=100 + index.reserve_ttl_s - 0.01) == (0, 0, 0)
    used = index.begin_store(NS_SMALL, refs[:1], 0, keys(1, b"u"), now=101)
    assert index.expire(now=100 + index.reserve_ttl_s) == (0, 0, 3)
    assert index.reserved_count == 0 and index.slot_counts()[2] == SMALL.slot_bytes
    with pytest.raises(UnknownId, match="expired"):
        index.begin_store(NS_SMALL, refs[1:2], 0, keys(1, b"v"), now=200)
    # the slot is reused under a new generation: the old ref still names nothing writable
    again = index.reserve(NS_SMALL, 8, OTHER, now=200)
    assert {r & 0xFFFF_FFFF for r in refs[1:]} <= {r & 0xFFFF_FFFF for r in again}
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, refs[1:2], 0, keys(1, b"v"), now=200)
    index.end_store(used, 0, True)
    assert index.lookup(NS_SMALL, [keys(1, b"u")], False, OWNER, 0)[0] == [1]


def test_reservations_go_with_their_owner_or_an_abort_and_survive_a_reset(index):
    mine = index.reserve(NS_SMALL, 3, OWNER, 0)
    theirs = index.reserve(NS_SMALL, 2, OTHER, 0)
    assert index.abort_store(mine[:1], OTHER) == 0          # not theirs to give back
    assert index.abort_store(mine[:1], OWNER) == 1
    assert index.reset(NS_SMALL) == 0 and index.reserved_count == 4
    index.release_owner(OWNER)
    assert index.reserved_count == 2
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, mine[1:], 0, keys(2), now=0)
    index.end_store(index.begin_store(NS_SMALL, theirs, 0, keys(2), now=0), 0, True)
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
        index.begin_store(NS_BIG, refs, 0, keys(2), now=0)
    assert index.reserved_count == 2                      # nothing was bound by the failures


def test_quotas_apply_when_reserved_slots_are_bound_and_owners_have_a_share(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
    old = keys(1, b"old")
    store(ix, NS_A, old)
    lease = ix.lookup(NS_A, [old], True, OWNER, 0)[1][0]           # pinned: not evictable
    refs = ix.reserve(NS_A, 5, OWNER, 0)
    assert len(refs) == 5 and ix.used_bytes_of(NS_A) == SMALL.slot_bytes   # stock: no quota
    ks = keys(3, b"q")
    slots = ix.begin_store(NS_A, refs[:3], 0, ks, now=0)
    # one fits the quota; the others find nothing of A's own to evict: void, not written
    assert [s.void for s in slots] == [False, True, True]
    ix.end_store(slots, 0, True)
    assert ix.lookup(NS_A, [ks], False, OWNER, 0)[0] == [1]
    assert ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.release_leases([lease], OWNER)
    slots = ix.begin_store(NS_A, refs[3:4], 0, keys(1, b"n"), now=0)  # evicts "old" now
    assert [s.void for s in slots] == [False]
    ix.end_store(slots, 0, True)
    assert ix.lookup(NS_A, [old], False, OWNER, 0)[0] == [0]
    assert ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.register_namespace(NS_B, SMALL)
    share = pool.nbytes // RESERVE_SHARE // SMALL.slot_bytes - 1     # OWNER holds one already
    assert len(ix.reserve(NS_B, share + 10, OWNER, 0)) == share
    assert ix.reserve(NS_B, 1, OWNER, 0) == []            # its share is used up
    assert len(ix.reserve(NS_B, 1, OTHER, 0)) == 1         # another client still gets some
    ix.expire(1000)
    assert ix.reserved_count == 0 and ix.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    assert len(ix.reserve(NS_B, 2, OWNER, 1000)) == 2      # the share is back


def test_a_restart_drops_reservations_with_the_pool_records(pool_config):
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    store(ix, NS_SMALL, keys(2))
    refs = ix.reserve(NS_SMALL, 3, OWNER, 0)
    ix.begin_store(NS_SMALL, refs[:1], 0, keys(1, b"half"), now=0)   # bound, never landed
    pool.close(unlink=False)   # as after kill -9
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == 2 and ix2.reserved_count == 0
        assert ix2.slot_counts()[:2] == (0, 2)
        with pytest.raises(UnknownId):
            ix2.begin_store(NS_SMALL, refs[1:], 0, keys(2, b"late"), now=0)
    finally:
        pool2.close(unlink=True)
