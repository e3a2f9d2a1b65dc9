"""LRU eviction policy over slot ids: told about slots, asked for victims; never frees memory.

The index calls ``insert`` when a slot commits, ``touch`` on every hit, ``remove`` when a slot
leaves the committed state, and ``choose_victims`` when it needs room. The policy never changes
its own state while choosing: the index evicts the victims and then calls ``remove``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable


class LruPolicy:
    """Least recently used first.

    An ``OrderedDict`` gives O(1) touch (``move_to_end``) and O(1) removal by id; a heap would
    need lazy deletion, and a linked list of our own would only redo what the dict does in C.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def insert(self, slot: int) -> None:
        self._order[slot] = None

    def touch(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def touch_many(self, slots: Iterable[int]) -> None:
        """Touch in order (the last one becomes the most recent); unknown ids are ignored."""
        move = self._order.move_to_end
        for s in slots:
            try:
                move(s)
            except KeyError:
                pass

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def oldest(self, is_pinned: Callable[[int], bool]) -> int | None:
        """The least recently used slot that is not pinned, or None."""
        for s in self._order:
            if not is_pinned(s):
                return s
        return None

    def choose_victims(self, n: int, is_pinned: Callable[[int], bool]) -> list[int] | None:
        """The ``n`` least recently used unpinned slots, or None (and no change) if fewer exist."""
        out = []
        for s in self._order:
            if not is_pinned(s):
                out.append(s)
                if len(out) == n:
                    return out
        return None

    def rank(self) -> dict[int, int]:
        """Slot → position from least recent (0); for choosing whole extents to reclaim."""
        return {s: i for i, s in enumerate(self._order)}
