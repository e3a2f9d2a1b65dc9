"""A staged load's window gives back every pin it took, however it ends: a window waiting for
room in the pool that is cancelled (its job's task torn down) must not leave its pool hits
pinned, or they could never be evicted again."""

import asyncio

import numpy as np

from kvpool.daemon import loads as loads_mod
from kvpool.daemon.loads import Loads


class _Slot:
    def __init__(self, i):
        self.ref, self.offset, self.pins = i, i * 4096, 0


class _Index:
    """resolve_load finds the first half of a window in the pool; pins are counted."""

    def __init__(self):
        self.ended: list = []

    def resolve_load(self, ns, refs, keys):
        return [_Slot(r) if k < len(refs) // 2 else None for k, r in enumerate(refs)]

    def pin(self, slots):
        for s in slots:
            s.pins += 1

    def end_load(self, slots, ok):
        for s in slots:
            s.pins -= 1
        self.ended.append((slots, ok))


class _TierWithoutRoom:
    """Holds every block but never finds room to bring one up (short, nothing fetched)."""

    def __init__(self):
        self.asked = asyncio.Event()

    def fetch(self, ns, keys, now):
        self.asked.set()
        return [None] * len(keys), True


class _Reg:
    namespace, closing, engine = b"n" * 16, False, None


def test_a_window_cancelled_while_it_waits_for_room_gives_back_its_pins(monkeypatch):
    monkeypatch.setattr(loads_mod, "ROOM_WAIT_S", 60.0)   # still waiting when cancelled

    async def scenario():
        index, tier = _Index(), _TierWithoutRoom()
        loads = Loads(index, tier)      # type: ignore[arg-type]
        refs, keys = list(range(1, 9)), [bytes([i]) * 16 for i in range(8)]
        task = asyncio.create_task(
            loads._window_copy(_Reg(), refs, keys, np.arange(8)))  # type: ignore[arg-type]
        await asyncio.wait_for(tier.asked.wait(), 10)
        await asyncio.sleep(0)          # into its wait for room
        assert not task.done(), "the window should be waiting for room"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return index

    index = asyncio.run(scenario())
    assert len(index.ended) == 1, "the window never gave back its pins"
    held, ok = index.ended[0]
    assert len(held) == 4 and not ok
    assert [s.pins for s in held] == [0, 0, 0, 0], "pool hits left pinned after the cancel"
