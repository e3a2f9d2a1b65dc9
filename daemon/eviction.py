"""LRU eviction over slot ids: told which slots are evictable, asked for victims; frees nothing.

The policy holds *only* evictable slots: committed, unpinned and not being dropped. The slot
table (``daemon/slot_table.py``) inserts a slot when it becomes evictable (its commit, its last
unpin) and removes it when it stops being so (a pin, an eviction, a reset). So choosing ``n``
victims reads the first ``n`` entries of the queue and nothing else: O(1) per victim, whatever
share of the pool is pinned by loads, leases or lower-tier writes (vLLM's free block queue holds
only unreferenced blocks for the same reason). The policy it replaced kept every committed slot
and skipped pinned ones while scanning: with a third of the pool pinned, 86% of the daemon's main
thread went to that scan during stores (issue 36).

Recency: a slot enters at the most recently used end, and a hit moves it there (``touch``). A
pinned slot (a load, a lease) is not in the queue; its last unpin puts it back at the most
recently used end (it was just read). A lower tier reading a slot to write it down does not pin
it: the slot keeps its place, and if it is chosen as a victim meanwhile its space is reused once
the read ends (the slot table's ``end_read``).

``examined`` counts the queue entries every query has looked at, so tests can bound the work
per victim with an operation count rather than a time.

Two implementations of one behaviour: ``daemon/_lru.c`` where the install built it (a list
linked through two arrays indexed by slot id: slot ids are dense, so no hash table), else
``OrderedLru`` below, which stays the reference. ``LruPolicy`` is the one in use.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from itertools import islice
from typing import Iterable, Iterator

try:
    from kvpool.daemon import _lru
except ImportError:       # no C compiler at install: the OrderedDict queue
    _lru = None


class OrderedLru:
    """Evictable slot ids, least recently used first: the reference queue, and the one used
    where ``daemon/_lru.c`` was not built.

    An ``OrderedDict`` gives O(1) insertion, removal by id and move to the back (``touch``), in
    C; a linked list of our own in Python would be slower. Values are unused (None).
    """

    __slots__ = ("_order", "examined")

    def __init__(self, capacity: int = 0) -> None:
        # (``capacity``: the ids the compiled queue sizes its arrays for; nothing to size here)
        self._order: OrderedDict[int, None] = OrderedDict()
        self.examined = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def __iter__(self) -> Iterator[int]:
        """Least recently used first."""
        return iter(list(self._order))

    def insert(self, slot: int) -> None:
        """``slot`` became evictable: most recently used."""
        self._order[slot] = None

    def insert_many(self, slots: Iterable[int]) -> None:
        """``insert`` of each of ``slots``, in order. (A loop: an OrderedDict's ``update``
        took ~2x as long for 128 slots, this VM.)"""
        order = self._order
        for s in slots:
            order[s] = None

    def touch(self, slot: int) -> None:
        """A hit on ``slot``: most recently used (nothing if it is not evictable now)."""
        if slot in self._order:
            self._order.move_to_end(slot)

    def touch_many(self, slots: Iterable[int]) -> None:
        order = self._order
        for s in slots:
            if s in order:
                order.move_to_end(s)

    def remove(self, slot: int) -> None:
        """``slot`` stopped being evictable (pinned, evicted, dropped); absent ones are fine."""
        self._order.pop(slot, None)

    def remove_many(self, slots: Iterable[int]) -> None:
        """``remove`` of each of ``slots`` (all present), in one C-level pass."""
        deque(map(self._order.pop, slots), 0)

    def victims(self, n: int) -> list[int]:
        """Up to ``n`` least recently used slots, oldest first (fewer if fewer are evictable).
        Removes nothing: the caller evicts them, then calls ``remove_many``."""
        out = list(islice(self._order, n))
        self.examined += len(out)
        return out

    def order(self) -> bytes:
        """Every queued id, least recently used first, as native int64s (no int per id for a
        caller that walks a whole queue in C)."""
        return array("q", self._order).tobytes()

    def oldest(self) -> int | None:
        """The least recently used evictable slot, or None."""
        for s in self._order:
            self.examined += 1
            return s
        return None


# The queue in use: the compiled one where it was built.
LruPolicy = OrderedLru if _lru is None else _lru.LruPolicy
