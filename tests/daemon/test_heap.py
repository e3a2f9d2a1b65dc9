"""The daemon's heap (daemon/heap.py): nothing frozen before it settles; then each extent's
slots, as they are made, go out of the collector's generations."""

from __future__ import annotations

import gc

from kvpool.daemon.extents import Extents
from kvpool.daemon.heap import Heap

SLOT = 4096


def _in_generations(objs: list) -> int:
    """How many of ``objs`` a collection of any generation would walk."""
    ids = {id(o) for o in objs}
    return sum(1 for o in gc.get_objects() if id(o) in ids)


def test_slots_made_after_settling_are_frozen_and_those_before_are_not(pool):
    heap = Heap()
    ext = Extents(pool, on_new_slots=heap.keep_new)
    cls = ext.size_class(SLOT)
    per_extent = pool.slots_per_extent(SLOT)
    early = ext.take_free(cls, per_extent)          # one extent, before the daemon serves
    assert heap.freezes == 0 and _in_generations(early) == len(early)
    heap.settle()
    assert gc.get_freeze_count() > 0 and _in_generations(early) == 0, "the startup's heap"
    gc.unfreeze()                                   # (only what follows is under test)
    late = ext.take_free(cls, per_extent)           # a second extent, while serving
    assert {s.extent for s in late} != {s.extent for s in early}
    assert heap.freezes == 2 and _in_generations(late) == 0
    assert gc.get_freeze_count() >= len(late)


def test_an_unsettled_heap_freezes_nothing(pool):
    heap = Heap()
    ext = Extents(pool, on_new_slots=heap.keep_new)
    before = gc.get_freeze_count()
    slots = ext.take_free(ext.size_class(SLOT), 2 * pool.slots_per_extent(SLOT))
    assert heap.freezes == 0 and gc.get_freeze_count() == before
    assert _in_generations(slots) == len(slots)
