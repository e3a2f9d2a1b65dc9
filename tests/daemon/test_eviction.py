"""The LRU queue of evictable slots (daemon/eviction.py): pure policy, no pool."""

from kvpool.daemon.eviction import LruPolicy


def test_least_recently_used_first_and_touch_moves_to_back():
    lru = LruPolicy()
    for s in (1, 2, 3):
        lru.insert(s)
    lru.touch(1)
    lru.touch(9)                        # not evictable now: nothing happens
    assert lru.victims(3) == [2, 3, 1] and lru.oldest() == 2
    assert len(lru) == 3, "choosing removes nothing"


def test_remove_and_shortfall():
    lru = LruPolicy()
    lru.insert_many([1, 2, 3])
    lru.remove(2)
    lru.remove(7)                       # absent: fine
    assert lru.victims(5) == [1, 3] and 2 not in lru and 1 in lru
    lru.remove_many([1, 3])
    assert lru.victims(1) == [] and lru.oldest() is None


def test_a_slot_back_from_a_pin_is_most_recently_used():
    lru = LruPolicy()
    lru.insert_many([1, 2, 3])
    lru.remove(1)                       # pinned by a load
    lru.insert(1)                       # its last unpin
    assert lru.victims(3) == [2, 3, 1]


def test_choosing_n_victims_examines_n_entries_whatever_else_the_queue_holds():
    lru = LruPolicy()
    lru.insert_many(range(10_000))
    lru.touch_many(range(0, 10_000, 2))
    lru.examined = 0
    assert lru.victims(4) == [1, 3, 5, 7]
    assert lru.oldest() == 1
    assert lru.examined == 5
