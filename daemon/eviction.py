"""LRU eviction policy over slot ids: told about slots, asked for victims; never frees memory.

The index calls ``insert`` when a slot commits, ``remove`` when it leaves the committed state,
and ``oldest``/``choose_victims`` when it needs room; hits reach the policy through the
``recency`` function it was built with (or an explicit ``touch``). Choosing never removes
anything: the index evicts the victims and then calls ``remove``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice
from typing import Callable


class LruPolicy:
    """Least recently used first.

    An ``OrderedDict`` gives O(1) touch (``move_to_end``) and O(1) removal by id; a heap would
    need lazy deletion, and a linked list of our own would only redo what the dict does in C.

    With a ``recency`` function (slot → a counter that grows with each use), hits need not
    touch the policy at all: a lookup only stamps its slots, and when the scan for victims meets
    a slot used since it was queued, it moves it to the back then (promotion on eviction, as in
    CLOCK). That takes the per-hit dict work off the lookup path, which is the daemon's hottest.
    """

    def __init__(self, recency: Callable[[int], int] | None = None) -> None:
        self._order: OrderedDict[int, int] = OrderedDict()
        self._recency = recency or (lambda slot: 0)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def insert(self, slot: int) -> None:
        self._order[slot] = self._recency(slot)

    def insert_many(self, slots: list[int], stamp: int) -> None:
        """``insert`` of each of ``slots`` (not yet in the policy), all used at ``stamp`` (what
        ``recency`` now answers for them), in one dict update."""
        self._order.update(dict.fromkeys(slots, stamp))

    def touch(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def remove_many(self, slots: list[int]) -> None:
        """``remove`` of each of ``slots`` (all in the policy), in one C-level pass."""
        deque(map(self._order.pop, slots), 0)

    def oldest(self, is_pinned: Callable[[int], bool]) -> int | None:
        """The least recently used slot that is not pinned, or None."""
        found = self._scan(1, is_pinned)
        return found[0] if found else None

    def head(self, n: int) -> tuple[list[int], list[int]]:
        """The first ``n`` slots in the queue and the stamps they were queued with, as they
        stand (no promotion, no pin check): for a caller that checks a whole batch at C speed
        and calls ``oldest_many`` only when one of them was used since or is pinned."""
        head = list(islice(self._order.items(), n))
        return [s for s, _ in head], [t for _, t in head]

    def head_has(self, n: int, accept: Callable[[int], bool], limit: int) -> bool:
        """Whether ``n`` of the first ``limit`` slots in the queue pass ``accept`` (a look at
        the next victims as they stand: no promotion)."""
        if n <= 0:
            return True
        for s in islice(self._order, limit):
            if accept(s):
                n -= 1
                if not n:
                    return True
        return False

    def oldest_many(self, n: int, is_pinned: Callable[[int], bool]) -> list[int]:
        """Up to ``n`` least recently used unpinned slots, oldest first (fewer if fewer
        exist)."""
        return self._scan(n, is_pinned)

    def choose_victims(self, n: int, is_pinned: Callable[[int], bool]) -> list[int] | None:
        """The ``n`` least recently used unpinned slots, or None if fewer exist. Choosing
        only reorders (slots used since they were queued move back); it removes nothing."""
        found = self._scan(n, is_pinned)
        return found if len(found) == n else None

    def _scan(self, n: int, is_pinned: Callable[[int], bool]) -> list[int]:
        out = self._scan_once(n, is_pinned)
        if len(out) < n:
            # Slots promoted by the first pass have their stamps now: the second pass can take
            # them (everything evictable may have been used since it was queued).
            out = self._scan_once(n, is_pinned)
        return out

    def _scan_once(self, n: int, is_pinned: Callable[[int], bool]) -> list[int]:
        recency = self._recency
        out: list[int] = []
        used: list[tuple[int, int]] = []
        for s, stamp in self._order.items():
            now = recency(s)
            if now > stamp:
                used.append((s, now))
            elif not is_pinned(s):
                out.append(s)
                if len(out) == n:
                    break
        for s, now in used:
            self._order.move_to_end(s)
            self._order[s] = now
        return out
