"""The pool's space for slots: extents handed to one slot size at a time, and room for a slot.

Owns the slot objects (``Slot``: where a block lives and what state it is in), the size classes
(a slot size's extents, free list and LRU of committed slots) and the extent table's in-memory
side: which extent serves which size, which are free, which are being drained for another
size. The block index (``daemon/index.py``) owns every slot's state, key and pins; this module
never changes them except to hand a free slot out or take one back, and it never decides what a
slot's removal means: it asks the index, through the ``evict``, ``hide`` and ``drop``
callbacks given at construction. Runs on the daemon's event loop thread, never blocks.

Room for a slot comes from a free slot of its size, then a free extent, then eviction: the least
recently used slot of the same size, or a whole extent of another size whose newest use is
older than that (so a new model can take space from an idle one without a static split).
``allocate`` answers None only when neither exists.

Draining an extent for another size: an extent goes to another slot size only when all of it is
free or evictable. A busy model nearly always has some block being written or read in every one
of its extents, so a second model could be refused (POOL_FULL) for as long as the first stays
busy (found by the soak campaign). When a size finds no room at all, the extent of the least
recently used block of another size is drained: its free slots leave that size's free list, its
unpinned blocks are evicted, its other blocks hidden (new lookups miss them, freed when the
transfer or lease holding them ends: at most lease_ttl_s; a lease keeps its promise and still
loads). The last one freed hands the extent to the size that asked, which meanwhile gets
SLOT_NO_SPACE. One at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.pool import COMMITTED, FREE, WRITING, Pool
from kvpool.shared.errors import LayoutMismatch

# An index-only state (the pool record says WRITING): a lower tier is filling the slot.
FILLING = 3


@dataclass(slots=True, eq=False)
class Slot:
    id: int
    extent: int
    index: int
    offset: int                 # pool byte offset of rank 0's shard
    size_class: "SizeClass"
    state: int = FREE
    generation: int = 0
    ns: bytes = b""
    key: bytes = b""            # ns + block hash (32 bytes), as in the slot record
    ref: int = 0                # slot ref for the current generation
    pins: int = 0
    landed: int = 0             # bit u: unit u (a head, or a rank's shard) is in
    writing: int = 0            # bit u: a store job of unit u is in flight
    owner: int = 0              # who prepared it (while WRITING)
    deadline: float = 0.0       # WRITING: dropped if not landed by then
    last_use: int = 0           # LRU tick of the last commit or hit
    doomed: bool = False
    void: bool = False          # a ticket bound to no slot (duplicate, no room): never written
    ticket: int = 0             # the ticket ref that bound it, while WRITING (0: none)


@dataclass(slots=True, eq=False)
class SizeClass:
    slot_bytes: int
    extents: list[int] = field(default_factory=list)
    free: list[Slot] = field(default_factory=list)
    lru: LruPolicy = field(default_factory=LruPolicy)


class Extents:
    """Extents, size classes and free lists of one pool. Callers: the index only."""

    def __init__(self, pool: Pool, evict: Callable[[Slot], None], hide: Callable[[Slot], None],
                 drop: Callable[[Slot], None]) -> None:
        """``evict``: free a committed, unpinned slot now (counted as an eviction). ``hide``:
        make a pinned committed slot unreachable, freed when its last pin goes. ``drop``: refuse
        or hide whatever is being written or filled into a slot. Each ends, now or later, in
        ``release``."""
        self.pool = pool
        self.slots: dict[int, Slot] = {}
        self.classes: dict[int, SizeClass] = {}
        self.extent_class: dict[int, SizeClass] = {}
        # Extent being emptied for another size -> that size (see the module docstring).
        self.draining: dict[int, SizeClass] = {}
        self.free_extents = list(range(pool.geometry.num_extents - 1, -1, -1))
        self._evict, self._hide, self._drop = evict, hide, drop

    def size_class(self, slot_bytes: int) -> SizeClass:
        cls = self.classes.get(slot_bytes)
        if cls is None:
            slots = self.slots
            cls = self.classes[slot_bytes] = SizeClass(
                slot_bytes, lru=LruPolicy(lambda sid: slots[sid].last_use))
        return cls

    def adopt(self) -> list[tuple[SizeClass, list[Slot]]]:
        """Rebuild from an adopted pool's extent table (called once, by ``Index.adopt``): each
        assigned extent's size and slots, for the caller to fill from the records; the caller
        puts the free ones on their size's free list. Extents torn by a crash mid-assignment
        are released."""
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

    def allocate(self, slot_bytes: int) -> Slot | None:
        """A free slot of ``slot_bytes`` off its free list (its state still FREE: the caller
        claims it before anything else runs), evicting or draining for room as the module
        docstring says; None where nothing can be. ``LayoutMismatch`` if the size does not fit
        an extent."""
        cls = self.size_class(slot_bytes)
        if cls.free:
            return cls.free.pop()
        if self.free_extents:
            e = self.free_extents.pop()
            n = self.pool.assign_extent(e, slot_bytes)
            if n == 0:
                self.free_extents.append(e)
                raise LayoutMismatch(f"a slot of {slot_bytes} bytes does not fit one extent of "
                                     f"{self.pool.geometry.extent_bytes} bytes: raise extent_size")
            self._add_extent(cls, e, n, fresh=True)
            return cls.free.pop()
        victim_id = cls.lru.oldest(self.is_pinned)
        victim = self.slots[victim_id] if victim_id is not None else None
        extent, age = self._reclaimable_extent(cls)
        if extent is not None and (victim is None or age < victim.last_use):
            self._reclaim_extent(extent)
            n = self.pool.assign_extent(extent, slot_bytes)
            self._add_extent(cls, extent, n, fresh=True)
            return cls.free.pop()
        while victim is not None:
            self._evict(victim)
            if cls.free:
                return cls.free.pop()
            # The victim sat in an extent being drained for another size: it did not come back
            # to this size's free list. Evict the next one.
            victim_id = cls.lru.oldest(self.is_pinned)
            victim = self.slots[victim_id] if victim_id is not None else None
        self._drain_for(cls)
        return cls.free.pop() if cls.free else None

    def allocate_many(self, slot_bytes: int, n: int,
                      evict_many: Callable[[SizeClass, int], int]) -> list[Slot]:
        """Up to ``n`` free slots of ``slot_bytes`` (room found as ``allocate`` finds it), for
        the caller to claim before anything else runs; fewer where nothing more can be
        evicted. Free slots come off the free list in slices and, while one size has the whole
        pool, victims go as a batch (``evict_many(cls, k)``: the index's, returning how many it
        put on the free list): a 1024-slot store on a full pool pays its evictions before its
        copy starts. Taken slots are marked WRITING when more room must be found after them
        (no eviction may free them again)."""
        cls = self.size_class(slot_bytes)
        got: list[Slot] = []
        while True:
            free = cls.free
            k = min(n - len(got), len(free))
            if k:
                taken = free[len(free) - k:]
                del free[len(free) - k:]
                taken.reverse()             # the order ``pop`` would give
                got += taken
            if len(got) == n:
                return got
            for s in taken if k else ():
                s.state = WRITING
            if len(self.classes) == 1 and not self.free_extents:
                if not evict_many(cls, n - len(got)):
                    return got
                continue
            s = self.allocate(slot_bytes)   # a fresh extent, or room from another size
            if s is None:
                return got
            s.state = WRITING
            got.append(s)

    def release(self, s: Slot) -> None:
        """``s`` (FREE now) goes back to its size's free list, or to the drain of its extent
        (called by the index as it frees a slot)."""
        if s.extent in self.draining:
            self._finish_drain(s.extent)
        else:
            s.size_class.free.append(s)

    def is_pinned(self, slot_id: int) -> bool:
        return self.slots[slot_id].pins > 0

    def extent_slots(self, extent: int) -> list[Slot]:
        base = extent * self.pool.slot_id_stride
        n = int(self.pool.extents[extent]["num_slots"])
        return [self.slots[base + i] for i in range(n)]

    def _add_extent(self, cls: SizeClass, extent: int, n: int, fresh: bool) -> list[Slot]:
        cls.extents.append(extent)
        self.extent_class[extent] = cls
        base = extent * self.pool.slot_id_stride
        first = self.pool.slot_offset(extent, 0)
        # Generations continue from the records: a slot id that served another size, or the
        # previous daemon, never repeats a generation (and so a slot ref) it handed out.
        gens = self.pool.generations(extent, n).tolist()
        slots = [Slot(base + i, extent, i, first + i * cls.slot_bytes, cls, generation=gens[i])
                 for i in range(n)]
        for s in slots:
            self.slots[s.id] = s
        if fresh:
            cls.free.extend(reversed(slots))
        return slots

    def _reclaimable_extent(self, wanting: SizeClass) -> tuple[int | None, int]:
        """The extent of another size whose slots are all free or evictable, newest use
        oldest; (None, 0) if none. Only scanned when several slot sizes share the pool."""
        best, best_age = None, 0
        if len(self.classes) < 2:
            return best, best_age
        for cls in self.classes.values():
            if cls is wanting:
                continue
            for e in cls.extents:
                if e in self.draining:
                    continue
                age = 0
                for s in self.extent_slots(e):
                    if s.state == WRITING or s.pins:
                        break
                    age = max(age, s.last_use)
                else:
                    if best is None or age < best_age:
                        best, best_age = e, age
        return best, best_age

    def _drain_for(self, wanting: SizeClass) -> None:
        if self.draining or len(self.classes) < 2:
            return
        # The extent of the least recently used evictable block of another size: no scan of
        # the pool, and a size with nothing evictable (all pinned or written) is left alone.
        oldest = None
        for cls in self.classes.values():
            victim = cls.lru.oldest(self.is_pinned) if cls is not wanting else None
            if victim is not None and (oldest is None
                                       or self.slots[victim].last_use < oldest.last_use):
                oldest = self.slots[victim]
        if oldest is None:
            return
        best = oldest.extent
        self.draining[best] = wanting
        owner = self.extent_class[best]
        slots = self.extent_slots(best)
        ids = {s.id for s in slots}
        owner.free = [s for s in owner.free if s.id not in ids]
        for s in slots:
            if best not in self.draining:
                break
            if s.state == COMMITTED and not s.pins:
                self._evict(s)
            elif s.state == COMMITTED:
                # Leased or being loaded: new lookups miss it (a hot block cannot hold the
                # extent forever), but the lease still loads it; freed when the last pin ends.
                self._hide(s)
            elif s.state == WRITING or s.state == FILLING:
                # A store into it is refused, or lands unseen.
                self._drop(s)
        self._finish_drain(best)

    def _finish_drain(self, extent: int) -> None:
        """Hand a drained extent to the size that asked for it, once every slot is free."""
        wanting = self.draining.get(extent)
        if wanting is None or any(s.state != FREE for s in self.extent_slots(extent)):
            return
        del self.draining[extent]
        self._reclaim_extent(extent)
        n = self.pool.assign_extent(extent, wanting.slot_bytes)
        if n:
            self._add_extent(wanting, extent, n, fresh=True)
        else:
            self.pool.release_extent(extent)
            self.free_extents.append(extent)

    def _reclaim_extent(self, extent: int) -> None:
        cls = self.extent_class.pop(extent)
        slots = self.extent_slots(extent)
        for s in slots:
            if s.state == COMMITTED:
                self._evict(s)
        ids = {s.id for s in slots}
        cls.free = [s for s in cls.free if s.id not in ids]
        cls.extents.remove(extent)
        for s in slots:
            del self.slots[s.id]
        self.pool.release_extent(extent)
