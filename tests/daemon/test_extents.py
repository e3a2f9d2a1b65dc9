"""The pool's space on a real (small) shm pool, driven directly: free lists, fresh extents,
whole free extents and drains (the slot table decides what to evict; see test_slot_table)."""

import pytest

from kvpool.daemon import slot_record
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


@pytest.mark.parametrize("kind", ["python", "compiled"])
def test_the_slots_by_id_read_as_a_dict_of_the_assigned_extents_slots(pool, kind):
    """Slots by id across assignments and a drain to another size: the same answers as a dict
    of the slots there are, single and in batches; an id of an unassigned extent, past an
    extent's slots or past the pool names none."""
    records = getattr(slot_record, kind.upper())
    if records is None:
        pytest.skip("daemon/_slot_record.c is not built")
    ext = Extents(pool, records)
    small, big = ext.size_class(SLOT), ext.size_class(8 * SLOT)
    assert len(ext.slots) == 0 and ext.slots.get(0) is None
    taken = ext.take_free(small, 3 * pool.slots_per_extent(SLOT))
    want = {s.id: s for s in taken}
    e = taken[0].extent
    for s in ext.extent_slots(e):
        ext.release(s)
    ext.start_drain(e, big)
    ext.finish_drain(e)                       # e's small slots go, its big ones come
    want = {i: s for i, s in want.items() if s.extent != e}
    want |= {s.id: s for s in ext.extent_slots(e)}
    assert {s.id for s in ext.extent_slots(e)} and all(s.size_class is big
                                                       for s in ext.extent_slots(e))
    slots = ext.slots
    assert dict(slots.items()) == want and len(slots) == len(want)
    assert sorted(s.id for s in slots.values()) == sorted(want)
    assert all(slots[i] is s and slots.get(i) is s and i in slots for i, s in want.items())
    ids = list(want)[::-1]
    assert slots.many(ids) == [want[i] for i in ids]
    stride = pool.slot_id_stride
    unassigned = ext.free_extents[0] * stride
    past_extent = e * stride + len(ext.extent_slots(e))
    assert past_extent < (e + 1) * stride, "big slots fill every id of their extent"
    for none in (unassigned, past_extent, pool.slot_ids, -1):
        assert slots.get(none) is None and none not in slots
        with pytest.raises(KeyError):
            slots[none]
        with pytest.raises(KeyError):
            slots.many([ids[0], none])
