"""Namespaces and quotas (daemon/namespaces.py) through the index on a real (small) shm pool."""

import pytest

from kvpool.daemon.index import Index
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import OutOfRange
from tests.daemon.indexkit import NOT_STORED, NS_A, NS_B, OWNER, SMALL, bind, keys, make_index, store


@pytest.fixture
def index(pool):
    return make_index(pool)


# ---- quotas ------------------------------------------------------------------------------



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
    assert ix.namespaces.used_bytes_of(NS_A) == 4 * SMALL.slot_bytes
    assert ix.table.stats.evictions == 6


def test_a_quota_set_later_seeds_its_queue_in_use_order_and_no_quota_walks_nothing(pool):
    """A quota set when the namespace already holds blocks starts from its evictable ones,
    least recently used first (pinned ones and other namespaces' left out); a registration
    with no quota to seed does not look at the namespace's blocks at all (one with 130K of
    them sorted them all, 300 ms of the loop)."""
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL)
    ix.register_namespace(NS_B, SMALL)
    a = keys(6, b"a")
    store(ix, NS_A, a)
    store(ix, NS_B, keys(3, b"b"))
    ix.lookup(NS_A, [a[:2]], False, OWNER, 0)                     # a0, a1 used last
    lease = ix.lookup(NS_A, [a[2:3]], True, OWNER, 0)[1][0]       # a2 pinned
    asked: list[bytes] = []
    walk = ix._evictable_of
    ix._evictable_of = lambda ns: asked.append(ns) or walk(ns)
    ix.register_namespace(NS_A, SMALL)
    assert asked == [], "no quota, yet the namespace's blocks were walked"
    ix.register_namespace(NS_A, SMALL, quota_bytes=3 * SMALL.slot_bytes)
    ix.register_namespace(NS_A, SMALL, quota_bytes=3 * SMALL.slot_bytes)   # made once
    assert asked == [NS_A]
    order = [ix.table.slots[i].block_hash for i in ix.namespaces.lru[NS_A]]
    assert order == [a[3], a[4], a[5], a[0], a[1]]
    store(ix, NS_A, keys(1, b"n"))          # 6 held + 1 over a quota of 3: the 4 oldest go
    assert [ix.lookup(NS_A, [[k]], False, OWNER, 0)[0][0] for k in a] == [0, 1, 1, 0, 0, 0]
    ix.release_leases([lease], OWNER)


def test_quota_counts_blocks_being_written_and_skips_pinned_ones(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=3 * SMALL.slot_bytes)
    first = keys(2, b"p")
    store(ix, NS_A, first)
    lease = ix.lookup(NS_A, [first[:1]], True, OWNER, 0)[1][0]    # p0 pinned
    tickets, slots = bind(ix, NS_A, keys(3, b"w"))
    # one fits, the second evicts p1 (p0 is pinned), the third has nothing of A left to evict
    assert [s.void for s in slots] == [False, False, True]
    assert store(ix, NS_A, keys(1, b"z")) == [NOT_STORED]
    ix.abort_store(tickets[:2], OWNER)                            # frees quota, no eviction
    ix.end_store(slots, 0, True)
    assert NOT_STORED not in store(ix, NS_A, keys(2, b"z"))
    assert ix.lookup(NS_A, [first[:1]], False, OWNER, 0)[0] == [1]
    ix.release_leases([lease], OWNER)


def test_daemon_quota_caps_what_engines_declare_and_a_lower_quota_takes_effect(pool):
    cap = 5 * SMALL.slot_bytes
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60, namespace_quota=cap)
    ix.register_namespace(NS_A, SMALL, quota_bytes=100 * SMALL.slot_bytes)
    assert ix.namespaces.quota_of(NS_A) == cap
    store(ix, NS_A, keys(5, b"a"))
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)   # latest wins
    assert store(ix, NS_A, keys(1, b"n"))[0] >= 0
    assert ix.namespaces.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    usage = {n.namespace: n for n in ix.namespaces.usage()}
    assert (usage[NS_A].blocks, usage[NS_A].quota_bytes) == (2, 2 * SMALL.slot_bytes)
    with pytest.raises(OutOfRange):
        ix.register_namespace(NS_A, SMALL, quota_bytes=-1)
    ix.register_namespace(NS_A, SMALL)               # no declaration: the daemon's cap again
    assert ix.namespaces.quota_of(NS_A) == cap
    assert all(r >= 0 for r in store(ix, NS_A, keys(3, b"m")))
    assert ix.namespaces.used_bytes_of(NS_A) == cap


def test_a_quota_can_be_lifted(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
    store(ix, NS_A, keys(4, b"a"))
    assert ix.namespaces.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.register_namespace(NS_A, SMALL)
    assert ix.namespaces.quota_of(NS_A) == 0
    store(ix, NS_A, keys(4, b"b"))
    assert ix.namespaces.used_bytes_of(NS_A) == 6 * SMALL.slot_bytes and ix.table.stats.evictions == 0


def test_quota_accounting_survives_reset_expiry_and_adoption(pool_config):
    pool = Pool.open(pool_config)
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=8 * SMALL.slot_bytes)
    store(ix, NS_A, keys(3, b"r"))
    _, late = bind(ix, NS_A, keys(2, b"late"))
    assert ix.namespaces.used_bytes_of(NS_A) == 5 * SMALL.slot_bytes
    ix.end_store(late, 0, False)                      # the store failed: dropped
    assert ix.namespaces.used_bytes_of(NS_A) == 3 * SMALL.slot_bytes
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        ix2.adopt()
        assert ix2.namespaces.used_bytes_of(NS_A) == 3 * SMALL.slot_bytes
        ix2.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
        assert store(ix2, NS_A, keys(1, b"new"))[0] >= 0       # evicts 2 adopted blocks
        assert ix2.namespaces.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
        ix2.reset(NS_A)
        assert ix2.namespaces.used_bytes_of(NS_A) == 0
    finally:
        pool2.close(unlink=True)
