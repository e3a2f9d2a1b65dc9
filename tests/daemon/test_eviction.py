from kvpool.daemon.eviction import LruPolicy


def test_least_recently_used_first_and_touch_moves_to_back():
    lru = LruPolicy()
    for s in (1, 2, 3, 4):
        lru.insert(s)
    lru.touch(1)
    assert lru.choose_victims(2, lambda s: False) == [2, 3]
    lru.touch(2)
    lru.touch(99)                 # unknown: ignored
    assert lru.oldest(lambda s: False) == 3


def test_pinned_slots_are_skipped_and_shortfall_changes_nothing():
    lru = LruPolicy()
    for s in (1, 2, 3):
        lru.insert(s)
    pinned = {1, 3}
    assert lru.choose_victims(1, pinned.__contains__) == [2]
    assert lru.choose_victims(2, pinned.__contains__) is None
    assert len(lru) == 3 and lru.oldest(lambda s: True) is None


def test_remove():
    lru = LruPolicy()
    lru.insert(1)
    lru.remove(1)
    lru.remove(1)
    assert 1 not in lru and len(lru) == 0


def test_lazy_promotion_keeps_lru_order_and_still_finds_victims():
    used = {1: 0, 2: 0, 3: 0}
    lru = LruPolicy(used.__getitem__)
    for s in (1, 2, 3):
        lru.insert(s)
    used[1] = 5                      # a hit stamps slot 1; the policy is not told
    assert lru.choose_victims(2, lambda s: False) == [2, 3]
    used.update({2: 6, 3: 7})        # now every slot was used since it was queued
    assert lru.oldest(lambda s: False) == 1
    assert lru.choose_victims(3, lambda s: s == 2) is None


def test_insert_many_is_insert_of_each_at_one_stamp():
    stamps = {1: 5, 2: 5, 3: 5, 4: 9}
    one, many = LruPolicy(stamps.__getitem__), LruPolicy(stamps.__getitem__)
    for s in (4, 1, 2, 3):
        one.insert(s)
    many.insert(4)
    many.insert_many([1, 2, 3], 5)
    assert len(many) == 4 and 2 in many
    assert many.choose_victims(4, lambda s: False) == one.choose_victims(4, lambda s: False) \
        == [4, 1, 2, 3]
    stamps[1] = 10                                 # used since: promoted when scanned
    assert many.choose_victims(3, lambda s: False) == [4, 2, 3]


def test_head_oldest_many_and_remove_many_serve_a_batch_of_victims():
    used = {1: 1, 2: 1, 3: 1, 4: 1}
    lru = LruPolicy(lambda s: used[s])
    lru.insert_many([1, 2, 3, 4], 1)
    assert lru.head(3) == ([1, 2, 3], [1, 1, 1])      # as queued: no promotion, no pin check
    used[1] = 5                                         # hit since it was queued
    assert lru.oldest_many(2, lambda s: s == 2) == [3, 4]
    assert lru.head(4) == ([2, 3, 4, 1], [1, 1, 1, 5])  # 1 promoted by the scan
    lru.remove_many([3, 4])
    assert len(lru) == 2 and lru.oldest_many(5, lambda s: False) == [2, 1]
