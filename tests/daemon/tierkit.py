"""Lower tiers for tests of the tiering and the copy jobs: a set of keys that takes every
demote at once (``FakeTier``), and one that writes a batch only when the test says
(``GatedTier``: a disk behind the stores)."""

from __future__ import annotations

import asyncio

from kvpool.daemon.tier import LowerTier
from kvpool.shared.protocol import TierInfo


class FakeTier(LowerTier):
    """Holds keys in a set; demotes and promotes at once (promote checks nothing)."""

    def __init__(self, name: str, held: set[bytes] | None = None, probe_adds=()) -> None:
        self.name = name
        self.held = set(held or ())
        self.enabled = True
        self.probed: list[list[list[bytes]]] = []
        self.promoted: list[bytes] = []
        self._probe_adds = set(probe_adds)

    @property
    def is_enabled(self) -> bool:
        return self.enabled

    def leading(self, ns, hashes, slot_bytes):
        n = 0
        for h in hashes:
            if ns + h not in self.held:
                break
            n += 1
        return n

    def probe(self, ns, tails, slot_bytes):
        if self.name != "remote":
            return None
        self.probed.append(tails)
        self.held |= {ns + h for t in tails for h in t if ns + h in self._probe_adds}
        f = asyncio.get_running_loop().create_future()
        f.set_result(None)
        return f

    def wants(self, key, slot_bytes):
        return self.enabled and key not in self.held

    def can_demote(self):
        return self.enabled

    def batch_blocks(self, slot_bytes):
        return 4

    def demote(self, keys, offsets, slot_bytes):
        self.held |= set(keys)
        f = asyncio.get_running_loop().create_future()
        f.set_result(len(keys))
        return f

    def promote(self, keys, offsets, slot_bytes):
        self.promoted += keys
        f = asyncio.get_running_loop().create_future()
        f.set_result([True] * len(keys))
        return f

    def forget(self, ns):
        return 0

    def info(self):
        return TierInfo(self.name, self.enabled, "", 0, 0, len(self.held), 0, 0, 0, 0, 0, 0, 0,
                        0, 0, 0)

    async def close(self, timeout_s):
        pass


class GatedTier(FakeTier):
    """A disk that writes a batch only when the test says so (``write_next``)."""

    def __init__(self) -> None:
        super().__init__("disk")
        self.pending: list[tuple[list[bytes], asyncio.Future]] = []

    def can_demote(self):
        return self.enabled and len(self.pending) < 2

    def demote(self, keys, offsets, slot_bytes):
        f = asyncio.get_running_loop().create_future()
        self.pending.append((list(keys), f))
        return f

    async def write_next(self) -> None:
        keys, f = self.pending.pop(0)
        self.held |= set(keys)
        f.set_result(len(keys))
        await asyncio.sleep(0)             # the tiering's callback, and its next batches
