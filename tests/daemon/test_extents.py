"""The pool's space on a real (small) shm pool, driven directly: free lists, fresh extents,
whole free extents and drains (the slot table decides what to evict; see test_slot_table)."""

import pytest

from kvpool.daemon.extents import Extents
from kvpool.daemon.pool import COMMITTED, FREE
from kvpool.shared.errors import LayoutMismatch

SLOT = 4096


def test_slots_come_from_free_lists_then_fresh_extents_until_none_is_left(pool):
    ext = Extents(pool)
    per_extent = pool.slots_per_extent(SLOT)
    total = pool.geometry.num_extents * per_extent
    cls = ext.size_class(SLOT)
    first = ext.take_free(cls, 1)
    assert first[0].state == FREE and len(cls.extents) == 1
    rest = ext.take_free(cls, total)
    assert len(rest) == total - 1 and not ext.free_extents
    assert len({s.id for s in rest + first}) == total
    assert ext.take_free(cls, 1) == []
    ext.release(rest[0])
    assert ext.take_free(cls, 2) == [rest[0]]


def test_a_slot_that_fits_no_extent_is_refused_and_its_extent_kept(pool):
    ext = Extents(pool)
    free = list(ext.free_extents)
    with pytest.raises(LayoutMismatch, match="extent_size"):
        ext.take_free(ext.size_class(pool.geometry.extent_bytes * 2), 1)
    assert ext.free_extents == free


def test_a_whole_free_extent_of_another_size_is_found_and_handed_over_by_a_drain(pool):
    ext = Extents(pool)
    small, big = ext.size_class(SLOT), ext.size_class(4 * SLOT)
    taken = ext.take_free(small, pool.geometry.num_extents * pool.slots_per_extent(SLOT))
    assert not ext.free_extents
    assert ext.whole_free_extent(big) is None
    one_extent = [s for s in taken if s.extent == taken[0].extent]
    for s in one_extent[1:]:
        ext.release(s)
    assert ext.whole_free_extent(big) is None, "one slot of it is still taken"
    ext.release(one_extent[0])
    e = ext.whole_free_extent(big)
    assert e == taken[0].extent
    assert ext.start_drain(e, big) == []                 # nothing in it to evict
    ext.finish_drain(e)
    assert ext.extent_class[e] is big and e in big.extents and e not in small.extents
    got = ext.take_free(big, 100)
    assert len(got) == pool.slots_per_extent(4 * SLOT) and {s.extent for s in got} == {e}


def test_a_drained_extent_goes_over_when_its_last_busy_slot_is_released(pool):
    ext = Extents(pool)
    small, big = ext.size_class(SLOT), ext.size_class(4 * SLOT)
    taken = ext.take_free(small, pool.geometry.num_extents * pool.slots_per_extent(SLOT))
    e = taken[0].extent
    mine = [s for s in taken if s.extent == e]
    for s in mine[2:]:
        ext.release(s)                                   # free, on small's list
    for s in mine[:2]:
        s.state = COMMITTED                              # busy: the slot table's to deal with
    assert ext.start_drain(e, big) == mine[:2]
    assert all(s.extent != e for s in small.free), "its free slots left small's list"
    mine[0].state = FREE
    ext.release(mine[0])
    assert e in ext.draining
    mine[1].state = FREE
    ext.release(mine[1])
    assert e not in ext.draining and ext.extent_class[e] is big
