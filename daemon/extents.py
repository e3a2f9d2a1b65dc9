"""The pool's space for slots: extents handed to one slot size at a time, free slots, drains.

Owns the slot objects (``daemon/slot_record.py``'s ``Slot``: where a block lives and, for the
slot table, what state it is in), the size classes (a slot size's extents, free list and LRU
queue) and the extent table's in-memory side: which extent serves which size, which are free,
which are being drained for another size, and when each extent was last used. It never changes
a slot's state, key or pins and never decides what to evict: the slot table
(``daemon/slot_table.py``) does, and hands freed slots back here (``release``). Runs on the
daemon's event loop thread, never blocks.

Draining an extent for another size: an extent goes to another slot size only when all of it is
free. A busy model nearly always has some block being written or read in every one of its
extents, so a second model could be refused for as long as the first stays busy (found by the
soak campaign). So when a size finds no room, the slot table may drain the extent of another
size's least recently used block: its free slots leave that size's free list at once, the table
evicts, hides or drops its other slots (``start_drain`` lists them), and the last slot freed
hands the extent to the size that asked (``release`` → ``_finish_drain``). One at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from types import SimpleNamespace
from typing import Callable, Iterable, Iterator

from kvpool.daemon import slot_record
from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.pool import FREE, Pool
from kvpool.daemon.slot_record import Slot
from kvpool.shared.errors import LayoutMismatch

# An index-only state (the pool record says WRITING): a lower tier is filling the slot.
FILLING = 3


class SlotsById:
    """Slot id -> slot, kept as one row per extent: an id is its extent times the pool's
    ``stride`` plus its index, so a slot is two list items away, and an extent's slots come and
    go as one row. (A dict of every slot rebuilt itself whole as a fresh daemon's pool filled,
    with the GIL held: 46 ms at 700K slots and 120 ms at 1.4M on this VM.) Reads as a dict
    of the slots there are; ``many`` is the batch read (a C pass where built)."""

    __slots__ = ("rows", "stride", "_slots_of", "_of_namespace")

    def __init__(self, num_extents: int, stride: int, records: SimpleNamespace) -> None:
        self.rows: list[list[Slot] | None] = [None] * num_extents
        self.stride = stride
        self._slots_of = records.slots_of
        self._of_namespace = records.of_namespace

    def get(self, sid: int, default: Slot | None = None) -> Slot | None:
        s = slot_record.slot_at(self.rows, self.stride, sid) if sid >= 0 else None
        return default if s is None else s

    def __getitem__(self, sid: int) -> Slot:
        s = self.get(sid)
        if s is None:
            raise KeyError(sid)
        return s

    def __contains__(self, sid: object) -> bool:
        return isinstance(sid, int) and self.get(sid) is not None

    def __len__(self) -> int:
        return sum(len(r) for r in self.rows if r is not None)

    def values(self) -> Iterator[Slot]:
        return chain.from_iterable(r for r in self.rows if r is not None)

    def items(self) -> Iterator[tuple[int, Slot]]:
        return ((s.id, s) for s in self.values())

    def many(self, ids: Iterable[int]) -> list[Slot]:
        """The slots of ``ids`` (KeyError for an id with none), in order."""
        return self._slots_of(self.rows, self.stride, ids)

    def of_namespace(self, order: bytes, ns: bytes) -> list[Slot]:
        """The slots of ``ns`` among the ids of ``order`` (an LRU queue's ``order()``), in
        that order: one pass, no int per id."""
        return self._of_namespace(self.rows, self.stride, order, ns)


@dataclass(slots=True, eq=False)
class SizeClass:
    slot_bytes: int
    extents: list[int] = field(default_factory=list)
    free: list[Slot] = field(default_factory=list)      # popped from the end
    # Committed, unpinned slots of this size: kept by the slot table (``daemon/eviction.py``).
    lru: LruPolicy = field(default_factory=LruPolicy)


class Extents:
    """Extents, size classes and free lists of one pool. Callers: the slot table only."""

    def __init__(self, pool: Pool, records: SimpleNamespace | None = None,
                 on_new_slots: Callable[[], None] | None = None) -> None:
        self.pool = pool
        # What this pool's slots are and the passes over them (``daemon/slot_record.py``).
        self.records = records or slot_record.RECORDS
        # Told after an extent's slots are made: they last (the daemon's ``Heap.keep_new``).
        self.on_new_slots = on_new_slots
        self.slots = SlotsById(pool.geometry.num_extents, pool.slot_id_stride, self.records)
        self.classes: dict[int, SizeClass] = {}
        self.extent_class: dict[int, SizeClass] = {}
        # Extent being emptied for another size -> that size (see the module docstring).
        self.draining: dict[int, SizeClass] = {}
        self.free_extents = list(range(pool.geometry.num_extents - 1, -1, -1))
        # Per extent: the newest ``last_use`` of its slots (stamped by the slot table as it
        # stamps a slot: ticks only grow, so the newest is the latest stamp).
        self.newest_use = [0] * pool.geometry.num_extents
        # Per extent: how many of its slots sit on its size's free list (a whole free extent
        # can go to another size at once: ``whole_free_extent``).
        self.free_count = [0] * pool.geometry.num_extents

    def size_class(self, slot_bytes: int) -> SizeClass:
        cls = self.classes.get(slot_bytes)
        if cls is None:
            # (its queue sized for every slot id once: growing it inside a store's commits
            # held the loop for milliseconds, daemon/_lru.c)
            cls = self.classes[slot_bytes] = SizeClass(slot_bytes,
                                                       lru=LruPolicy(self.pool.slot_ids))
        return cls

    def adopt(self) -> list[tuple[SizeClass, list[Slot]]]:
        """Rebuild from an adopted pool's extent table (called once, by the slot table's
        adoption): each assigned extent's size and slots, for the caller to fill from the
        records; the caller puts the free ones on their size's free list (``put_free``).
        Extents torn by a crash mid-assignment are released."""
        pool = self.pool
        self.free_extents = []
        out = []
        for e in range(pool.geometry.num_extents - 1, -1, -1):
            slot_bytes = int(pool.extents[e]["slot_bytes"])
            if slot_bytes and not pool.extent_is_sane(e):
                pool.release_extent(e)     # torn by a crash mid-assignment, or not ours
                slot_bytes = 0
            if not slot_bytes:
                self.free_extents.append(e)
                continue
            cls = self.size_class(slot_bytes)
            out.append((cls, self._add_extent(cls, e, int(pool.extents[e]["num_slots"]),
                                              fresh=False)))
        return out

    def take_free(self, cls: SizeClass, n: int) -> list[Slot]:
        """Up to ``n`` free slots of ``cls``, from its free list and then from unassigned
        extents, in the order ``pop`` would give them (FREE still: the caller claims them before
        anything else runs). ``LayoutMismatch`` if the size does not fit an extent."""
        got: list[Slot] = []
        while True:
            free = cls.free
            k = min(n - len(got), len(free))
            if k:
                taken = free[len(free) - k:]
                del free[len(free) - k:]
                taken.reverse()
                got += taken
                counts = self.free_count
                for e, c in _per_extent(taken).items():
                    counts[e] -= c
            if len(got) == n or not self.free_extents:
                return got
            self._assign_fresh(cls, self.free_extents.pop())

    def release(self, s: Slot) -> None:
        """``s`` (FREE now) goes back to its size's free list, or to the drain of its extent
        (called by the slot table as it frees a slot)."""
        if self.slots.get(s.id) is not s:
            return          # its extent went to another size as an earlier slot of a batch freed
        if s.extent in self.draining:
            self._finish_drain(s.extent)
        else:
            s.size_class.free.append(s)
            self.free_count[s.extent] += 1

    def release_many(self, cls: SizeClass, slots: list[Slot], extent: int = -1) -> None:
        """``release`` of ``slots`` (FREE, all of ``cls``, oldest victim first): one list
        extend while no extent drains. ``extent``: the one they all sit in, where the caller
        knows it (else -1)."""
        if self.draining:
            for s in slots:
                self.release(s)
        else:
            cls.free += reversed(slots)       # the oldest victim is popped first
            counts = self.free_count
            if extent >= 0:
                counts[extent] += len(slots)
            else:
                for e, c in _per_extent(slots).items():
                    counts[e] += c

    def put_free(self, cls: SizeClass, slots: list[Slot]) -> None:
        """Adopted free slots onto ``cls``'s free list, the first popped first."""
        cls.free += reversed(slots)
        for e, c in _per_extent(slots).items():
            self.free_count[e] += c

    def whole_free_extent(self, wanting: SizeClass) -> int | None:
        """An extent of another size whose every slot is free (that size's blocks were reset
        or expired), or None. O(extents of the sizes that have an extent's worth free)."""
        counts = self.free_count
        for cls in self.classes.values():
            if cls is wanting or not cls.free:
                continue
            for e in cls.extents:
                if (e not in self.draining
                        and counts[e] == int(self.pool.extents[e]["num_slots"])):
                    return e
        return None

    def start_drain(self, extent: int, wanting: SizeClass) -> list[Slot]:
        """Begin emptying ``extent`` for ``wanting``: its free slots leave their size at once;
        returns its other slots, which the caller evicts, hides or drops (each ends in
        ``release``). The extent goes to ``wanting`` once its last slot is free."""
        self.draining[extent] = wanting
        owner = self.extent_class[extent]
        slots = self.extent_slots(extent)
        if self.free_count[extent]:
            owner.free = [s for s in owner.free if s.extent != extent]
            self.free_count[extent] = 0
        return [s for s in slots if s.state != FREE]

    def finish_drain(self, extent: int) -> None:
        """Hand ``extent`` on now if it is all free (after ``start_drain``'s slots were dealt
        with, some of which may free only later)."""
        if extent in self.draining:
            self._finish_drain(extent)

    def extent_slots(self, extent: int) -> list[Slot]:
        return self.slots.rows[extent] or []

    def _assign_fresh(self, cls: SizeClass, extent: int) -> None:
        n = self.pool.assign_extent(extent, cls.slot_bytes)
        if n == 0:
            self.free_extents.append(extent)
            raise LayoutMismatch(f"a slot of {cls.slot_bytes} bytes does not fit one extent of "
                                 f"{self.pool.geometry.extent_bytes} bytes: raise extent_size")
        self._add_extent(cls, extent, n, fresh=True)

    def _add_extent(self, cls: SizeClass, extent: int, n: int, fresh: bool) -> list[Slot]:
        cls.extents.append(extent)
        self.extent_class[extent] = cls
        base = extent * self.pool.slot_id_stride
        first = self.pool.slot_offset(extent, 0)
        # Generations continue from the records: a slot id that served another size, or the
        # previous daemon, never repeats a generation (and so a slot ref) it handed out.
        slots = self.records.make_slots(base, extent, first, cls.slot_bytes, cls,
                                        self.pool.generations(extent, n).tolist())
        self.slots.rows[extent] = slots
        if self.on_new_slots is not None:
            self.on_new_slots()
        if fresh:
            cls.free.extend(reversed(slots))
            self.free_count[extent] = n
            self.newest_use[extent] = 0
        return slots

    def _finish_drain(self, extent: int) -> None:
        """Hand a drained extent to the size that asked for it, once every slot is free."""
        if any(s.state != FREE for s in self.extent_slots(extent)):
            return
        wanting = self.draining.pop(extent)
        owner = self.extent_class.pop(extent)
        owner.extents.remove(extent)
        self.slots.rows[extent] = None
        self.pool.release_extent(extent)
        n = self.pool.assign_extent(extent, wanting.slot_bytes)
        if n:
            self._add_extent(wanting, extent, n, fresh=True)
        else:
            self.free_extents.append(extent)


def _per_extent(slots: list[Slot]) -> dict[int, int]:
    """How many of ``slots`` each extent holds. A plain loop, not ``Counter``: a big store
    finds its room (free slots taken, victims released) right after a copy evicted the CPU's
    caches, and there ``Counter``'s construction (its type checks, ``update``'s dispatch) took
    ~70 us for 64 slots against ~28 for this (~4 and ~3 us warm; this VM, 256 MiB written and
    40 ms idle before each). A job's slots nearly always sit in one extent, which a set of
    them, made in one C-level pass, says."""
    extents = set(map(_EXTENT, slots))
    if len(extents) == 1:
        return {extents.pop(): len(slots)}
    out: dict[int, int] = {}
    for s in slots:
        e = s.extent
        out[e] = out.get(e, 0) + 1
    return out


_EXTENT = attrgetter("extent")
