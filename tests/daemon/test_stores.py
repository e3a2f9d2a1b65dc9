"""The store path (daemon/stores.py) through the index on a real (small) shm pool: tickets
given slots by keyed stores, voids, the store check, open_store's deferred half."""

import msgspec
import pytest

from kvpool.daemon.index import Index
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import OutOfRange, ProtocolError, UnknownId
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import MAX_RESERVE
from tests.daemon.indexkit import (BIG, NOT_STORED, NS_A, NS_B, NS_BIG, NS_SMALL, NS_TP2, OTHER,
                                   OWNER, SMALL, TP2, bind, bound_tp2, capacity, fill_pool,
                                   head_layout, keys, make_index, pinned_total, pool_slots,
                                   records_match_slots, store)


@pytest.fixture
def index(pool):
    return make_index(pool)


# ---- reservations: stores planned without a round trip ----------------------------------------

def test_reserved_slots_are_bound_by_the_first_rank_and_visible_after_the_last(index):
    refs = index.reserve(NS_TP2, 3, OWNER, now=0)
    assert len(refs) == 3 and index.ticket_count == 3
    assert index.slot_counts() == (0, 0, 0)   # a ticket is no slot
    ks = keys(3, b"r")
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    r0 = index.begin_store(NS_TP2, refs, ks, 0, now=1)
    assert index.ticket_count == 0 and index.slot_counts()[0] == 3
    # bound now: another store of those keys finds them in flight (duplicates)
    assert store(index, NS_TP2, ks, now=1, owner=OTHER) == [NOT_STORED] * 3
    index.end_store(r0, 0, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]   # rank 1 not landed
    with pytest.raises(ProtocolError, match="another key"):
        index.begin_store(NS_TP2, refs, keys(3, b"x"), 1, now=1)
    r1 = index.begin_store(NS_TP2, refs, ks, 1, now=1)
    assert r1 == r0                          # the tickets name the slots rank 0 bound
    index.end_store(r1, 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks], False, OWNER, 0)
    assert hits == [3] and slots[0] == [s.ref for s in r0]


def test_a_key_already_held_binds_as_a_duplicate_never_written_nor_shown_twice(index):
    ks = keys(2, b"d")
    first = index.reserve(NS_TP2, 2, OWNER, now=0)        # engine A
    second = index.reserve(NS_TP2, 3, OTHER, now=0)       # engine B, same keys, later
    a0 = index.begin_store(NS_TP2, first, ks, 0, now=0)
    b0 = index.begin_store(NS_TP2, second[:2], ks, 0, now=0)   # both keys in flight from A
    assert [s.void for s in a0] == [False, False] and [s.void for s in b0] == [True, True]
    index.end_store(a0, 0, True)
    index.end_store(b0, 0, True)
    index.end_store(index.begin_store(NS_TP2, first, ks, 1, now=0), 1, True)
    assert index.slot_counts()[:2] == (0, 2)              # B's duplicates take no slot
    b1 = index.begin_store(NS_TP2, second[:2], ks, 1, now=0)
    assert b1 == b0 and all(s.void for s in b1)           # rank 1 finds rank 0's voids
    index.end_store(b1, 1, True)
    hits, _, slots = index.lookup(NS_TP2, [ks], False, OWNER, 0)
    assert hits == [2] and slots[0] == [s.ref for s in a0]   # A's blocks, once
    assert index.slot_counts()[:2] == (0, 2) and index.stores.stats.duplicate_blocks == 2
    # a committed key is a duplicate too, and so is a key named twice in one job
    k = keys(1, b"e")
    r = index.begin_store(NS_TP2, second[2:] + index.reserve(NS_TP2, 1, OTHER, 0),
                          ks[:1] + k, 0, now=0)
    assert [s.void for s in r] == [True, False]
    index.end_store(r, 0, True)
    twice = index.reserve(NS_SMALL, 2, OWNER, 0)
    r = index.begin_store(NS_SMALL, twice, k + k, 0, now=0)
    assert [s.void for s in r] == [False, True]
    index.end_store(r, 0, True)
    assert index.lookup(NS_SMALL, [k], False, OWNER, 0)[0] == [1]


def test_a_failed_primary_leaves_its_duplicate_unwritten_and_the_key_absent(index):
    ks = keys(1, b"f")
    a = index.begin_store(NS_SMALL, index.reserve(NS_SMALL, 1, OWNER, 0), ks, 0, now=0)
    b = index.begin_store(NS_SMALL, index.reserve(NS_SMALL, 1, OTHER, 0), ks, 0, now=0)
    index.end_store(a, 0, ok=False)
    index.end_store(b, 0, ok=True)     # nothing was copied into it: it must not commit
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [0]
    assert index.slot_counts() == (0, 0, 0)


def test_unused_reservations_expire_and_their_refs_are_refused_after(index):
    refs = index.reserve(NS_SMALL, 4, OWNER, now=100)
    assert index.expire(now=100 + index.stores.reserve_ttl_s - 0.01) == (0, 0, 0)
    used = index.begin_store(NS_SMALL, refs[:1], keys(1, b"u"), 0, now=101)
    assert index.expire(now=100 + index.stores.reserve_ttl_s) == (0, 0, 3)
    assert index.ticket_count == 0 and index.slot_counts()[2] == SMALL.slot_bytes
    with pytest.raises(UnknownId, match="expired"):
        index.begin_store(NS_SMALL, refs[1:2], keys(1, b"v"), 0, now=200)
    # new tickets never repeat an expired one's ref: the old ref still names nothing writable
    again = index.reserve(NS_SMALL, 8, OTHER, now=200)
    assert not set(again) & set(refs)
    with pytest.raises(UnknownId):
        index.begin_store(NS_SMALL, refs[1:2], keys(1, b"v"), 0, now=200)
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
        index.begin_store(NS_SMALL, mine[1:], keys(2), 0, now=0)
    index.end_store(index.begin_store(NS_SMALL, theirs, keys(2), 0, now=0), 0, True)
    assert index.lookup(NS_SMALL, [keys(2)], False, OWNER, 0)[0] == [2]


def test_bad_reservations_and_keyless_stores_into_reserved_slots_are_refused(index):
    with pytest.raises(OutOfRange):
        index.reserve(NS_SMALL, -1, OWNER, 0)
    with pytest.raises(OutOfRange):
        index.reserve(NS_SMALL, 1 << 20, OWNER, 0)
    with pytest.raises(UnknownId, match="no registered layout"):
        index.reserve(b"?" * 16, 1, OWNER, 0)
    refs = index.reserve(NS_SMALL, 2, OWNER, 0)
    with pytest.raises(ProtocolError, match="0 keys for 2 slots"):
        index.begin_store(NS_SMALL, refs, [], 0)
    with pytest.raises(UnknownId):                        # another namespace's slots
        index.begin_store(NS_BIG, refs, keys(2), 0, now=0)
    assert index.ticket_count == 2                      # nothing was bound by the failures


def test_quotas_apply_when_tickets_are_bound_and_owners_hold_up_to_the_pools_slot_count(pool):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=2 * SMALL.slot_bytes)
    old = keys(1, b"old")
    store(ix, NS_A, old)
    lease = ix.lookup(NS_A, [old], True, OWNER, 0)[1][0]           # pinned: not evictable
    refs = ix.reserve(NS_A, 5, OWNER, 0)
    assert len(refs) == 5 and ix.namespaces.used_bytes_of(NS_A) == SMALL.slot_bytes  # no quota
    ks = keys(3, b"q")
    slots = ix.begin_store(NS_A, refs[:3], ks, 0, now=0)
    # one fits the quota; the others find nothing of A's own to evict: void, not written
    assert [s.void for s in slots] == [False, True, True]
    ix.end_store(slots, 0, True)
    assert ix.lookup(NS_A, [ks], False, OWNER, 0)[0] == [1]
    assert ix.namespaces.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.release_leases([lease], OWNER)      # "old" was in use until now: most recently used
    slots = ix.begin_store(NS_A, refs[3:4], keys(1, b"n"), 0, now=0)  # evicts A's other one
    assert [s.void for s in slots] == [False]
    ix.end_store(slots, 0, True)
    assert ix.lookup(NS_A, [old, ks[:1]], False, OWNER, 0)[0] == [1, 0]
    assert ix.namespaces.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    ix.register_namespace(NS_B, SMALL)
    # Tickets cost bookkeeping only: an owner may hold as many as the pool has slots of the
    # size (the bound on the daemon's memory), whatever the slots hold now.
    share = pool.geometry.num_extents * pool.slots_per_extent(SMALL.slot_bytes) - 1  # 1 held
    assert len(ix.reserve(NS_B, share + 10, OWNER, 0)) == share
    assert ix.reserve(NS_B, 1, OWNER, 0) == []            # its bound is reached
    assert len(ix.reserve(NS_B, 1, OTHER, 0)) == 1         # another client still gets some
    ix.expire(1000)
    assert ix.ticket_count == 0 and ix.namespaces.used_bytes_of(NS_A) == 2 * SMALL.slot_bytes
    assert len(ix.reserve(NS_B, 2, OWNER, 1000)) == 2      # the tickets are back


def test_a_restart_drops_reservations_with_the_pool_records(pool_config):
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    store(ix, NS_SMALL, keys(2))
    refs = ix.reserve(NS_SMALL, 3, OWNER, 0)
    ix.begin_store(NS_SMALL, refs[:1], keys(1, b"half"), 0, now=0)   # bound, never landed
    pool.close(unlink=False)   # as after kill -9
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == 2 and ix2.ticket_count == 0
        assert ix2.slot_counts()[:2] == (0, 2)
        with pytest.raises(OutOfRange, match="restart"):     # tickets of another life
            ix2.begin_store(NS_SMALL, refs[1:], keys(2, b"late"), 0, now=0)
    finally:
        pool2.close(unlink=True)


def test_reserved_slots_bind_with_head_range_masks_of_any_tp_size(index):
    """Reservations meet head-split slots: whichever rank's store comes first binds the slot
    with its head range; the block commits once every head landed; another engine (another TP
    size) naming the same keys gets duplicates, freed once all its ranks reported them."""
    two, four = head_layout(2), head_layout(4)
    ns = b"H" * 16
    index.register_namespace(ns, two)
    ks = keys(2, b"h")
    refs = index.reserve(ns, 2, OWNER, now=0)
    r1 = index.begin_store(ns, refs, ks, 1, two.rank_mask(1), now=0)   # rank 1 first
    assert not any(s.void for s in r1) and index.ticket_count == 0
    index.end_store(r1, 1, True, two.rank_mask(1))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [0]               # heads 0-1 missing
    with pytest.raises(ProtocolError, match="overlapping head ranges"):
        index.begin_store(ns, refs, ks, 3, four.rank_mask(3), now=0)  # head 3 is in
    r0 = index.begin_store(ns, refs, ks, 0, two.rank_mask(0), now=0)
    index.end_store(r0, 0, True, two.rank_mask(0))
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [2]
    dup = index.reserve(ns, 2, OTHER, now=0)
    for rank in range(4):
        got = index.begin_store(ns, dup, ks, rank, four.rank_mask(rank), now=0)
        assert all(s.void for s in got)
        index.end_store(got, rank, True, four.rank_mask(rank))
        assert index.slot_counts()[0] == 0                # voids take no slot
    assert index.stores.stats.duplicate_blocks == 2
    with pytest.raises(UnknownId):                          # forgotten once all reported
        index.begin_store(ns, dup, ks, 0, four.rank_mask(0), now=0)
    hits, _, slots = index.lookup(ns, [ks], False, OWNER, 0)
    assert hits == [2] and slots[0] == [s.ref for s in r1]


def test_tickets_hold_no_extent_against_another_size_and_still_bind_after(index):
    """A ticket is no slot: a pool all of one size, with tickets of that size outstanding,
    gives a new size an extent as it would without them, and the tickets still bind later
    (to slots found then)."""
    n = 0
    while index.slot_counts()[1] == n:                      # the pool is all BIG, committed
        store(index, NS_BIG, keys(1, b"b%d" % n))
        n += 1
    full = index.slot_counts()[1]
    tickets = index.reserve(NS_BIG, 2, OTHER, now=0)
    assert len(tickets) == 2 and index.slot_counts()[1] == full   # nothing evicted for them
    assert store(index, NS_SMALL, keys(1, b"s"), now=1)[0] != NOT_STORED
    assert index.ticket_count == 2
    slots = index.begin_store(NS_BIG, tickets, keys(2, b"late"), 0, now=1)
    assert not any(s.void for s in slots) and index.end_store(slots, 0, True) == 2
    assert index.lookup(NS_BIG, [keys(2, b"late")], False, OWNER, 1)[0] == [2]



def test_batched_record_writes_mirror_the_index_through_every_store_path(pool_config):
    """Claims (binds of tickets, reserve_fills) and commits write their records
    in batches; evictions and frees one by one. Whatever the mix, each record ends as the slot
    is, and a restarted daemon adopts exactly the committed blocks."""
    pool = Pool.open(pool_config)
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    ix.register_namespace(NS_TP2, TP2)
    store(ix, NS_SMALL, keys(40, b"a"))                          # bound in a batch, committed
    refs = ix.reserve(NS_SMALL, 30, OWNER, 0)                    # tickets ...
    ks = keys(20, b"b") + keys(5, b"a")                          # ... 5 of them duplicates
    ix.end_store(ix.begin_store(NS_SMALL, refs[:25], ks, 0), 0, True)
    ix.abort_store(refs[25:27], OWNER)                           # 3 tickets left
    _, half = bind(ix, NS_TP2, keys(6, b"c"))                     # one rank of two landed
    ix.end_store(half, 0, True)
    fills = ix.reserve_fills(NS_SMALL, keys(4, b"d"), 0)
    ix.end_fill(fills, [True, False, True, True])
    records_match_slots(ix)
    n = capacity(ix, SMALL, NS_SMALL)                            # evicts everything unpinned
    assert n > 0
    records_match_slots(ix)
    committed = ix.slot_counts()[1]
    pool.close(unlink=False)
    pool2 = Pool.open(pool_config)
    try:
        ix2 = Index(pool2, 10, 60)
        assert ix2.adopt() == committed
        records_match_slots(ix2)
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
    slots = ix.begin_store(NS_SMALL, refs, ks + ks[:1], 0)    # the last: a duplicate
    assert [s.void for s in slots] == [False] * 5 + [True]
    assert ix.namespaces.used_bytes_of(NS_SMALL) == 5 * SMALL.slot_bytes
    assert ix.tickets.held == {(OWNER, SMALL.slot_bytes): 17, (OTHER, SMALL.slot_bytes): 17}
    assert ix.ticket_count == 34
    assert ix.end_store(slots, 0, True) == 5
    assert ix.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [5]
    ix.abort_store(mine[3:], OWNER)
    assert ix.tickets.held == {(OTHER, SMALL.slot_bytes): 17}
    ix.release_owner(OWNER)
    ix.release_owner(OTHER)
    assert ix.ticket_count == 0 and ix.namespaces.used_bytes_of(NS_SMALL) == 5 * SMALL.slot_bytes
    assert ix.tickets.held == {} and not ix.tickets.grants


def test_a_store_job_ended_chunk_by_chunk_commits_only_what_landed(index):
    """The server ends a big store's slots in chunks as their copies land, then the rest
    with the job's outcome: a job that fails after two chunks keeps exactly those, frees the
    others, and leaves nothing pinned or writing."""
    ks = keys(12)
    _, slots = bind(index, NS_SMALL, ks)
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
    assert NOT_STORED not in store(index, NS_SMALL, ks[8:])


def test_a_chunk_of_one_rank_commits_nothing_until_every_rank_landed(index):
    ks = keys(4)
    refs, r0 = bind(index, NS_TP2, ks, rank=0)
    r1 = index.begin_store(NS_TP2, refs, ks, 1)
    index.end_store(r0[:2], 0, True)                     # rank 0's first chunk
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [0]
    index.end_store(r1[:2], 1, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [2]
    index.end_store(r0[2:], 0, False)                    # rank 0 fails the rest
    index.end_store(r1[2:], 1, True)
    assert index.lookup(NS_TP2, [ks], False, OWNER, 0)[0] == [2]
    assert index.slot_counts()[:2] == (0, 2)



def test_a_keyed_store_refused_at_its_last_slot_leaves_every_slot_as_it_was(index):
    """A store of tickets refused at its last ref (the one-pass check, then the ref-by-ref
    one that says why) allocates, pins and binds nothing, and the same tickets still bind and
    commit after."""
    refs = index.reserve(NS_SMALL, 4, OWNER, 0)
    ks = keys(4, b"u")
    for bad in ([refs[3] + (1 << 32)], [0xFFFF_FFF0], [1], [refs[0]]):  # stale, unknown, twice
        with pytest.raises((UnknownId, OutOfRange, ProtocolError)):
            index.begin_store(NS_SMALL, refs[:3] + bad, ks, 0, now=0)
        assert pinned_total(index) == 0 and not index.stores.bound
        assert index.ticket_count == 4 and index.slot_counts() == (0, 0, 0)
        assert index.namespaces.used_bytes_of(NS_SMALL) == 0
    with pytest.raises(ProtocolError, match="another key"):       # a bound slot, wrong key
        tp, rank = bound_tp2(index, ks)
        index.begin_store(NS_TP2, tp, keys(4, b"v"), rank, now=0)
    assert index.end_store(index.begin_store(NS_SMALL, refs, ks, 0, now=0), 0, True) == 4
    assert index.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [4]



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
    job = ix.open_store(NS_SMALL, refs, ks, 0, now=0)
    assert job.finish is not None and not job.has_voids
    assert ix.ticket_count == 6 and all(s.pins == 0 and s.writing == 0 for s in job.slots)
    assert ix.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [0]
    job.finish()
    assert all(s.pins == 1 and s.writing == 1 and not s.void for s in job.slots)
    assert ix.ticket_count == 0 and ix.slot_counts()[0] == 6
    assert ix.namespaces.used_bytes_of(NS_SMALL) == 6 * SMALL.slot_bytes and ix.tickets.held == {}
    assert store(ix, NS_SMALL, ks, owner=OTHER) == [NOT_STORED] * 6
    assert ix.end_store(job.slots, 0, True) == 6
    records_match_slots(ix)
    # a key held already, a key named twice: voids, so bound and pinned now
    more = ix.reserve(NS_SMALL, 4, OWNER, 0)
    for refs2, ks2 in ((more[:2], ks[:1] + keys(1, b"p")), (more[2:], keys(1, b"q") * 2)):
        job = ix.open_store(NS_SMALL, refs2, ks2, 0, now=0)
        assert job.finish is None and job.has_voids
        assert [s.void for s in job.slots].count(True) == 1
        assert all(s.pins == 1 for s in job.slots)
        ix.end_store(job.slots, 0, True)
    # a namespace with a quota that leaves room for all: deferred like any other
    ix.register_namespace(NS_TP2, TP2, quota_bytes=64 * TP2.slot_bytes)
    tp = ix.reserve(NS_TP2, 2, OWNER, 0)
    job = ix.open_store(NS_TP2, tp, keys(2, b"t"), 0, now=0)
    assert job.finish is not None and not job.has_voids and ix.ticket_count == 2
    job.finish()
    assert ix.ticket_count == 0
    # the other rank's store of bound slots has nothing to bind: pinned at once
    job1 = ix.open_store(NS_TP2, tp, keys(2, b"t"), 1, now=0)
    assert job1.finish is None and not job1.has_voids
    assert [s.writing for s in job1.slots] == [3, 3]
    records_match_slots(ix)
    with pytest.raises(ProtocolError, match="1 keys for 2 slots"):
        ix.open_store(NS_TP2, tp, keys(1, b"t"), 1, now=0)


def _full_index(pool):
    """An index over a pool full of committed SMALL blocks, a third of them leased (pinned);
    the keys of the blocks that may be evicted, oldest first."""
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    held = fill_pool(ix, NS_SMALL, pool_slots(pool, SMALL))
    third = len(held) // 3
    for i in range(0, third, 256):
        ix.lookup(NS_SMALL, [held[i:min(i + 256, third)]], True, OTHER, 0)
    return ix, held[third:]


def test_a_big_fresh_store_gets_room_for_its_head_and_the_rest_in_finish(pool, pool_config):
    """With ``head`` and room assured for the whole job, open_store finds room for the head
    alone (so the copy of the head can start), ``place`` the rest's (up to a count, then all),
    appending to the same list, and ``finish`` binds them all: the same blocks are evicted and
    the same keys held as where the job was bound in one piece, with the bindings, pins and
    pool records of begin_store."""
    ix, evictable = _full_index(pool)
    other = Pool.open(msgspec.structs.replace(pool_config, pool_name=pool_config.pool_name + "b"))
    try:
        whole, _ = _full_index(other)
        ks = keys(200, b"late")
        refs = ix.reserve(NS_SMALL, 200, OWNER, 0)
        job = ix.open_store(NS_SMALL, refs, ks, 0, now=0, head=32)
        assert job.late == 168 and len(job.slots) == 32 and job.finish is not None
        assert ix.table.stats.evictions == 32 and ix.ticket_count == 200
        head = job.slots
        job.place(96)                             # room up to a count first (an engine's step)
        assert len(head) == 96 and ix.table.stats.evictions == 96 and not job.short
        job.place(64)                             # (already there: nothing more)
        assert len(head) == 96 and ix.table.stats.evictions == 96
        job.place()                               # the rest's room: offsets, no claims yet
        assert len(head) == 200 and ix.table.stats.evictions == 200 and not job.short
        assert ix.ticket_count == 200 and all(s.pins == 0 and s.writing == 0 for s in head)
        job.finish()
        assert job.slots is head and len(head) == 200 and not job.short
        assert all(s.pins == 1 and s.writing == 1 and not s.void for s in head)
        assert [s.block_hash for s in head] == ks and ix.ticket_count == 0
        assert ix.end_store(head, 0, True) == 200
        one = whole.begin_store(NS_SMALL, whole.reserve(NS_SMALL, 200, OWNER, 0), ks, 0, now=0)
        assert whole.end_store(one, 0, True) == 200
        for a in (ix, whole):
            records_match_slots(a)
            assert a.table.stats.evictions == 200
            assert a.lookup(NS_SMALL, [[k] for k in evictable[:200]], False, OWNER, 0)[0] \
                == [0] * 200                       # the 200 oldest went, in both
            assert a.lookup(NS_SMALL, [ks], False, OWNER, 0)[0] == [200]
        assert ix.slot_counts() == whole.slot_counts()
    finally:
        other.close(unlink=True)


def test_a_store_that_may_not_all_find_room_or_may_void_is_bound_in_one_piece(pool):
    """No head split where a ticket could come out void or short: keys named twice or held
    already, a quota that lets fewer in, a pool whose free and evictable slots are fewer than
    the job, claims not deferred, or a job no bigger than its head."""
    ix, evictable = _full_index(pool)
    cases = {
        "named twice": keys(40, b"a") + keys(1, b"a"),
        "held already": keys(40, b"b") + evictable[-1:],
        "no bigger than its head": keys(8, b"c"),
    }
    for why, ks in cases.items():
        job = ix.open_store(NS_SMALL, ix.reserve(NS_SMALL, len(ks), OWNER, 0), ks, 0, now=0,
                            head=8)
        assert job.late == 0 and len(job.slots) == len(ks), why
        if job.finish is not None:
            job.finish()
        ix.end_store(job.slots, 0, True)
    ix.stores.defer_claims = False
    job = ix.open_store(NS_SMALL, ix.reserve(NS_SMALL, 40, OWNER, 0), keys(40, b"d"), 0,
                        now=0, head=8)
    assert job.late == 0 and job.finish is None and len(job.slots) == 40
    ix.end_store(job.slots, 0, True)
    ix.stores.defer_claims = True
    # a quota of 10 slots: 40 do not fit
    ix.register_namespace(NS_TP2, TP2, quota_bytes=10 * TP2.slot_bytes)
    job = ix.open_store(NS_TP2, ix.reserve(NS_TP2, 40, OWNER, 0), keys(40, b"e"), 0, now=0,
                        head=8)
    assert job.late == 0 and [s.void for s in job.slots].count(False) == 10
    ix.end_store(job.slots, 0, True)
    # every slot pinned but 20: no room for 40 assured
    cls = ix.table.extents.size_class(SMALL.slot_bytes)
    spare = len(cls.free) + len(cls.lru)
    ix.lookup(NS_SMALL, [[k] for k in evictable], True, OTHER, 0)
    ix.lookup(NS_SMALL, [[k] for k in keys(40, b"a") + keys(40, b"b") + keys(8, b"c")
                         + keys(40, b"d")], True, OTHER, 0)
    assert len(cls.lru) + len(cls.free) < spare and not ix.room.assured(cls, 40)
    job = ix.open_store(NS_SMALL, ix.reserve(NS_SMALL, 40, OWNER, 0), keys(40, b"f"), 0, now=0,
                        head=8)
    assert job.late == 0 and len(job.slots) == 40
    records_match_slots(ix)


# ---- tickets: reservations that hold no slot (issue 26, guarantee 2) ---------------------------


def test_a_reservation_on_a_full_pool_evicts_nothing_and_is_granted_whole(pool_config):
    """A pool full of committed blocks; a new owner asks for 1000 tickets: it gets 1000 (the
    pool has more slots), not a share of the pool, and every committed block is still
    there."""
    # 1/8 of 24 MiB is fewer than 1000 slots: the old share would not do
    pool = Pool.open(msgspec.structs.replace(pool_config, pool_size="24MiB"))
    try:
        _full_pool_reservation(pool)
    finally:
        pool.close(unlink=True)


def _full_pool_reservation(pool):
    ix = Index(pool, 10, 60)
    ix.register_namespace(NS_SMALL, SMALL)
    cap = pool_slots(pool, SMALL)
    held = fill_pool(ix, NS_SMALL, cap)
    assert ix.slot_counts()[1] == cap and ix.table.stats.evictions == 0
    assert cap > 1000
    refs = ix.reserve(NS_SMALL, 1000, OTHER, now=0)
    assert len(refs) == 1000 and ix.ticket_count == 1000
    assert ix.table.stats.evictions == 0 and ix.slot_counts()[1] == cap
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
    cap = pool_slots(pool, SMALL)
    fill_pool(ix, NS_SMALL, cap)
    shares = []
    now = 0.0
    for r in range(60):
        now += 0.25
        ix.expire(now)
        stock = ix.reserve(NS_SMALL, 128, OWNER, now)
        ks = keys(48, b"r%03d" % r)
        slots = ix.begin_store(NS_SMALL, stock[:48], ks, 0, now=now)
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
    job = index.open_store(NS_BIG, tickets, ks, 0, now=0)
    assert job.has_voids and all(s.void for s in job.slots)
    assert index.stores.stats.duplicate_blocks == 2 and index.stores.stats.no_room_blocks == 2
    assert index.end_store(job.slots, 0, True) == 0
    assert index.slot_counts()[:2] == (0, n) and index.ticket_count == 0 and not index.stores.bound
    with pytest.raises(UnknownId):                          # spent
        index.begin_store(NS_BIG, tickets[1:2], ks[1:2], 0, now=0)
    lease = index.lookup(NS_BIG, [keys(1, b"cap1")], False, OWNER, 0)
    index.release_leases(list(range(1, n + 1)), OWNER)     # every lease goes
    more = index.reserve(NS_BIG, 1, OTHER, now=0)
    slots = index.begin_store(NS_BIG, more, keys(1, b"late"), 0, now=0)
    assert not slots[0].void and index.end_store(slots, 0, True) == 1
    assert lease[0] == [1] and index.stores.stats.no_room_blocks == 2


def test_ticket_refs_are_no_slot_refs_and_stale_expired_or_aborted_ones_are_refused(index):
    ks = keys(2, b"t")
    tickets = index.reserve(NS_SMALL, 4, OWNER, now=0)
    first = index.pool.geometry.num_extents * index.pool.slot_id_stride
    assert all(r & 0xFFFF_FFFF >= first and 0 < r < 1 << 63 for r in tickets)
    assert index.abort_store(tickets[:1], OWNER) == 1
    with pytest.raises(UnknownId, match="aborted"):
        index.begin_store(NS_SMALL, tickets[:1], ks[:1], 0, now=0)
    for never in (tickets[1] + (1 << 32), tickets[-1] + 1000):   # another generation, index
        with pytest.raises(OutOfRange, match="no ticket"):
            index.begin_store(NS_SMALL, [never], ks[:1], 0, now=0)
    with pytest.raises(OutOfRange):                         # a ticket is nothing to load
        index.begin_load(NS_SMALL, tickets[1:2])
    slots = index.begin_store(NS_SMALL, tickets[1:3], ks, 0, now=0)
    assert index.end_store(slots, 0, True) == 2
    with pytest.raises(UnknownId):                          # bound, committed: spent
        index.begin_store(NS_SMALL, tickets[1:2], ks[:1], 0, now=0)
    assert index.expire(now=index.stores.reserve_ttl_s) == (0, 0, 1)
    with pytest.raises(UnknownId, match="expired"):
        index.begin_store(NS_SMALL, tickets[3:], keys(1, b"x"), 0, now=20)
    assert index.ticket_count == 0 and not index.tickets.grants and not index.tickets.held


def test_an_owner_gone_takes_its_tickets_and_what_they_bound(index):
    """release_owner: unbound tickets go, a slot one of them bound (still being written)
    is dropped, a void placeholder is forgotten; another owner's tickets stay."""
    mine = index.reserve(NS_TP2, 4, OWNER, now=0)
    theirs = index.reserve(NS_TP2, 2, OTHER, now=0)
    store(index, NS_TP2, keys(1, b"held"), ranks=(0, 1))
    r0 = index.begin_store(NS_TP2, mine[:2], keys(1, b"held") + keys(1, b"w"), 0, now=0)
    assert [s.void for s in r0] == [True, False]
    index.end_store(r0, 0, True)                            # rank 1 never comes
    assert index.ticket_count == 4 and len(index.stores.bound) == 2
    index.release_owner(OWNER)
    assert index.ticket_count == 2 and not index.stores.bound and index.slot_counts()[0] == 0
    for refs in (mine[:1], mine[1:2], mine[2:3]):
        with pytest.raises(UnknownId):
            index.begin_store(NS_TP2, refs, keys(1, b"w"), 1, now=0)
    slots = index.begin_store(NS_TP2, theirs, keys(2, b"o"), 0, now=0)
    index.end_store(slots, 0, True)
    index.end_store(index.begin_store(NS_TP2, theirs, keys(2, b"o"), 1, now=0), 1, True)
    assert index.lookup(NS_TP2, [keys(2, b"o")], False, OWNER, 0)[0] == [2]


def test_tickets_without_room_are_void_for_every_tp_rank(index):
    """A TP2 store of fresh keys finds room for some tickets only: the rest are void for rank
    0, rank 1 finds the same slots and the same voids, and once both ranks reported, the
    stored blocks commit and the voids are gone."""
    n = capacity(index, BIG, NS_BIG)                       # every slot leased but one extent
    index.release_leases(list(range(1, 5)), OWNER)          # one extent's worth (4 BIG) freed
    index.reset(NS_BIG)                                     # the unleased blocks go now
    free = len(index.extents.classes[BIG.slot_bytes].free)
    assert 0 < free < n
    index.register_namespace(b"W" * 16, Layout(16, 2, "f16", (128 << 10,), "big2"))  # BIG's size
    ns = b"W" * 16
    tickets = index.reserve(ns, free + 2, OWNER, now=0)
    ks = keys(free + 2, b"tp")
    r0 = index.begin_store(ns, tickets, ks, 0, now=0)
    assert [s.void for s in r0] == [False] * free + [True, True]
    assert index.stores.stats.no_room_blocks == 2
    r1 = index.begin_store(ns, tickets, ks, 1, now=0)
    assert r1 == r0
    index.end_store(r0, 0, True)
    assert index.end_store(r1, 1, True) == free
    assert index.lookup(ns, [ks], False, OWNER, 0)[0] == [free] and not index.stores.bound

