"""The extent allocator on a real (small) shm pool, driven directly: free lists, fresh extents,
batched room, and the callbacks it asks the index to run."""

import pytest

from kvpool.daemon.extents import Extents
from kvpool.daemon.pool import COMMITTED, FREE, WRITING
from kvpool.shared.errors import LayoutMismatch

SLOT = 4096


class _Index:
    """Stands in for the index: records what the allocator asked, frees as the index would."""

    def __init__(self, pool) -> None:
        self.evicted: list[int] = []
        self.ext = Extents(pool, self.evict, self.hide, self.drop)

    def evict(self, s) -> None:
        self.evicted.append(s.id)
        s.size_class.lru.remove(s.id)
        s.state = FREE
        self.ext.release(s)

    def hide(self, s) -> None:
        raise AssertionError("one size only: nothing is drained")

    drop = hide

    def evict_many(self, cls, n) -> int:
        ids = cls.lru.oldest_many(n, self.ext.is_pinned)
        for i in ids:
            self.evict(self.ext.slots[i])
        return len(ids)

    def commit(self, slots, tick) -> None:
        for s in slots:
            s.state, s.last_use = COMMITTED, tick
        slots[0].size_class.lru.insert_many([s.id for s in slots], tick)


def test_slots_come_from_free_extents_then_from_the_lru(pool):
    ix = _Index(pool)
    per_extent = pool.slots_per_extent(SLOT)
    total = pool.geometry.num_extents * per_extent
    first = ix.ext.allocate(SLOT)
    assert first.state == FREE and len(ix.ext.classes[SLOT].extents) == 1
    rest = ix.ext.allocate_many(SLOT, total - 1, ix.evict_many)
    assert len(rest) == total - 1 and not ix.ext.free_extents and not ix.evicted
    assert len({s.id for s in rest + [first]}) == total
    ix.commit(rest + [first], 1)
    ix.ext.slots[rest[0].id].pins = 1                  # pinned: never a victim
    again = ix.ext.allocate_many(SLOT, 3, ix.evict_many)
    assert len(again) == 3 and rest[0].id not in ix.evicted
    assert {s.id for s in again} == set(ix.evicted) and len(ix.evicted) == 3
    assert ix.evicted == [s.id for s in rest[1:4]]     # the oldest unpinned, in order


def test_allocate_many_stops_where_nothing_can_be_evicted(pool):
    ix = _Index(pool)
    total = pool.geometry.num_extents * pool.slots_per_extent(SLOT)
    got = ix.ext.allocate_many(SLOT, total, ix.evict_many)
    for s in got:
        s.state = WRITING                              # being written: not evictable
    assert ix.ext.allocate_many(SLOT, 2, ix.evict_many) == []
    assert ix.ext.allocate(SLOT) is None


def test_a_slot_that_fits_no_extent_is_refused_and_its_extent_kept(pool):
    ix = _Index(pool)
    free = list(ix.ext.free_extents)
    with pytest.raises(LayoutMismatch, match="extent_size"):
        ix.ext.allocate(pool.geometry.extent_bytes * 2)
    assert ix.ext.free_extents == free
