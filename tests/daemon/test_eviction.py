"""The LRU queue of evictable slots (daemon/eviction.py): pure policy, no pool. Each test runs
on both queues: the compiled one (daemon/_lru.c) and the OrderedDict one it falls back to."""

from array import array
import random

import pytest

from kvpool.daemon import eviction


@pytest.fixture(params=["compiled", "ordered"])
def LruPolicy(request):
    if request.param == "ordered":
        return eviction.OrderedLru
    return request.getfixturevalue("compiled_lru").LruPolicy


def test_least_recently_used_first_and_touch_moves_to_back(LruPolicy):
    lru = LruPolicy()
    for s in (1, 2, 3):
        lru.insert(s)
    lru.touch(1)
    lru.touch(9)                        # not evictable now: nothing happens
    assert lru.victims(3) == [2, 3, 1] and lru.oldest() == 2
    assert len(lru) == 3, "choosing removes nothing"


def test_remove_and_shortfall(LruPolicy):
    lru = LruPolicy()
    lru.insert_many([1, 2, 3])
    lru.remove(2)
    lru.remove(7)                       # absent: fine
    assert lru.victims(5) == [1, 3] and 2 not in lru and 1 in lru
    lru.remove_many([1, 3])
    assert lru.victims(1) == [] and lru.oldest() is None and list(lru) == []


def test_a_slot_back_from_a_pin_is_most_recently_used(LruPolicy):
    lru = LruPolicy()
    lru.insert_many([1, 2, 3])
    lru.remove(1)                       # pinned by a load
    lru.insert(1)                       # its last unpin
    assert lru.victims(3) == [2, 3, 1]


def test_inserting_a_queued_slot_keeps_its_place(LruPolicy):
    lru = LruPolicy()
    lru.insert_many([5, 6, 7])
    lru.insert(5)
    assert list(lru) == [5, 6, 7] and len(lru) == 3


def test_removing_many_names_a_slot_that_is_not_queued(LruPolicy):
    lru = LruPolicy()
    lru.insert_many([1, 2])
    with pytest.raises(KeyError):
        lru.remove_many([1, 4])


def test_choosing_n_victims_examines_n_entries_whatever_else_the_queue_holds(LruPolicy):
    lru = LruPolicy()
    lru.insert_many(range(10_000))
    lru.touch_many(range(0, 10_000, 2))
    lru.examined = 0
    assert lru.victims(4) == [1, 3, 5, 7]
    assert lru.oldest() == 1
    assert lru.examined == 5


@pytest.mark.parametrize("seed, capacity", [(1, 0), (2, 0), (3, 0), (4, 50_000), (5, 200_000)])
def test_both_queues_agree_through_random_operations(compiled_lru, seed, capacity):
    """Inserts (new and queued), touches, removals, batches and queries at random, ids spread
    far apart (the compiled queue's arrays grow, from nothing or from the capacity it was made
    with, or are sized for every id at once): the same order, length and answers."""
    rng = random.Random(seed)
    ours, ref = compiled_lru.LruPolicy(capacity), eviction.OrderedLru(capacity)
    ids = [rng.randrange(200_000) for _ in range(400)]
    for step in range(3000):
        op = rng.choice(["insert", "insert_many", "touch", "touch_many", "remove",
                         "remove_many", "victims", "oldest"])
        if op in ("insert", "touch", "remove"):
            arg = rng.choice(ids)
        elif op in ("insert_many", "touch_many"):
            arg = rng.sample(ids, rng.randrange(1, 20))
        elif op == "remove_many":
            arg = list(ref)[:rng.randrange(0, 10)]
            rng.shuffle(arg)
        elif op == "victims":
            arg = rng.randrange(0, 50)
        got = [getattr(q, op)(*(() if op == "oldest" else (arg,))) for q in (ours, ref)]
        assert got[0] == got[1], f"step {step}: {op} answered {got[0]} against {got[1]}"
        assert list(ours) == list(ref) and len(ours) == len(ref), f"step {step}: after {op}"
        assert array("q", ours.order()).tolist() == list(ref), f"step {step}: order after {op}"
    assert ours.examined == ref.examined
    assert all((i in ours) == (i in ref) for i in ids)


def test_the_compiled_queue_refuses_what_is_no_slot_id(compiled_lru):
    lru = compiled_lru.LruPolicy()
    for bad, error in ((-1, ValueError), (1 << 40, ValueError), ("7", TypeError)):
        with pytest.raises(error):
            lru.insert(bad)
    assert len(lru) == 0 and -1 not in lru and "7" not in lru


def test_the_pools_queues_are_sized_for_every_slot_id_at_once(pool, compiled_lru, monkeypatch):
    """A size's queue and a quota namespace's are made with room for every slot id of the pool:
    no growth (milliseconds with the GIL held at a million ids) inside a store's commits."""
    from kvpool.daemon.index import Index
    from tests.daemon.indexkit import NS_A, SMALL
    monkeypatch.setattr(eviction, "LruPolicy", compiled_lru.LruPolicy)
    monkeypatch.setattr("kvpool.daemon.extents.LruPolicy", compiled_lru.LruPolicy)
    monkeypatch.setattr("kvpool.daemon.namespaces.LruPolicy", compiled_lru.LruPolicy)
    ids = pool.geometry.num_extents * pool.slot_id_stride
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS_A, SMALL, quota_bytes=4 * SMALL.slot_bytes)
    assert ix.extents.size_class(SMALL.slot_bytes).lru.capacity == ids
    assert ix.namespaces.lru[NS_A].capacity == ids
    with pytest.raises(ValueError):
        compiled_lru.LruPolicy(-1)
