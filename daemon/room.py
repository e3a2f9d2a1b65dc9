"""Room for new slots: where a store's or a fill's slots come from when the pool is full.

In order: free slots of the size, then unassigned extents, then a whole free extent of another
size (its blocks were reset or expired), then either the size's least recently used blocks or,
where another size's least recently used block sits in an extent last used before all of them,
that whole extent (drained, see ``daemon/extents.py``): a new model takes space from an idle one
without a static split. Each pass evicts a batch of victims read off the LRU queue's head (the
queue holds only evictable slots, ``daemon/eviction.py``), so the work per slot found is O(1)
whatever is pinned and whatever slot sizes share the pool (issue 36). A namespace under a quota
first makes room among its own blocks (``fit_quota``).

Decides, never frees: the slot table evicts, hides and drops. Runs on the daemon's event loop
thread, never blocks.
"""

from __future__ import annotations

from kvpool.daemon.extents import FILLING, Extents, SizeClass, Slot
from kvpool.daemon.namespaces import Namespaces
from kvpool.daemon.pool import COMMITTED, WRITING
from kvpool.daemon.slot_table import SlotTable


class Room:
    """Finds room for slots of a size. Callers: the store path and the index's fills."""

    def __init__(self, table: SlotTable, extents: Extents, namespaces: Namespaces) -> None:
        self.table = table
        self.extents = extents
        self.namespaces = namespaces

    def allocate(self, cls: SizeClass, n: int) -> list[Slot]:
        """Up to ``n`` free slots of ``cls`` (room found as the module docstring says), FREE
        still: the caller claims them (``SlotTable.claim``) before anything else runs. Fewer where no
        more room can be made now (every slot written or pinned, or a drain under way)."""
        got = self.extents.take_free(cls, n)
        while len(got) < n:
            if not self._make_room(cls, n - len(got)):
                break
            got += self.extents.take_free(cls, n - len(got))
        return got

    def assured(self, cls: SizeClass, n: int) -> bool:
        """Whether ``allocate(cls, n)`` will find all ``n`` (now, and after any allocations of
        ``cls`` that come to fewer in all, with nothing else run in between): its free slots,
        unassigned extents and least recently used blocks alone are enough, and no drain can
        take evicted slots."""
        if self.extents.draining:
            return False
        have = len(cls.free) + len(cls.lru)
        if have < n and self.extents.free_extents:
            have += len(self.extents.free_extents) * self.extents.pool.slots_per_extent(
                cls.slot_bytes)
        return have >= n

    def fit_quota(self, ns: bytes, slot_bytes: int, n: int) -> int:
        """How many of ``n`` new slots of ``ns`` its quota lets in, after evicting its own
        least recently used blocks to make that room (all ``n`` when it has no quota)."""
        quota = self.namespaces.quota.get(ns, 0)
        if not quota:
            return n
        used = self.namespaces.bytes_used.get(ns, 0)
        over = -(-(used + n * slot_bytes - quota) // slot_bytes)
        if over > 0:
            victims = self.namespaces.lru[ns].victims(over)
            self.table.evict_many(self.table.slots.many(victims))
            used = self.namespaces.bytes_used.get(ns, 0)
        return max(0, min(n, (quota - used) // slot_bytes))

    def _make_room(self, cls: SizeClass, n: int) -> bool:
        """Free up to ``n`` slots for ``cls`` in one batch (see the module docstring);
        whether any came free."""
        extent = self.extents.whole_free_extent(cls) if not self.extents.draining else None
        if extent is not None:
            self._drain(extent, cls)          # nothing in it to evict: handed over at once
            return True
        own = cls.lru.oldest()
        extent = self._idle_extent(cls, self.table.slots[own].last_use if own is not None else None)
        if extent is not None:
            before = len(cls.free)
            self._drain(extent, cls)
            if len(cls.free) > before:
                return True
        if own is not None:
            self.table.evict_many(self.table.slots.many(cls.lru.victims(n)))
            return True
        return False

    def _idle_extent(self, wanting: SizeClass, own_age: int | None) -> int | None:
        """The extent of another size's least recently used evictable block, if that extent
        was last used before ``own_age`` (or ``wanting`` has nothing to evict) and no drain is
        under way; else None. O(sizes): each size's queue head."""
        if self.extents.draining or len(self.extents.classes) < 2:
            return None
        best: Slot | None = None
        for cls in self.extents.classes.values():
            if cls is wanting:
                continue
            head = cls.lru.oldest()
            if head is not None and (best is None or self.table.slots[head].last_use < best.last_use):
                best = self.table.slots[head]
        if best is None:
            return None
        if own_age is not None and self.extents.newest_use[best.extent] >= own_age:
            return None
        return best.extent

    def _drain(self, extent: int, wanting: SizeClass) -> None:
        busy = self.extents.start_drain(extent, wanting)
        self.table.evict_many([s for s in busy if s.state == COMMITTED and not s.pins])
        for s in busy:
            if s.state == COMMITTED and s.pins:
                # Leased or being loaded: new lookups miss it, but its load still reads it;
                # freed when its last pin ends.
                self.table.hide(s)
            elif s.state in (WRITING, FILLING):
                self.table.drop(s)            # a store into it is refused, or lands unseen
        self.extents.finish_drain(extent)
