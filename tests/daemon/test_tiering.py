"""Tiering over fake lower tiers on a real (small) pool, without sockets: every committed block
goes down to every tier that wants it, lookups ask the tiers in order and probe only past what
the pool and the upper tiers hold, and a tier that comes back is offered the pool again."""

from __future__ import annotations

import asyncio

from kvpool.daemon.index import Index
from kvpool.daemon.tier import LowerTier
from kvpool.daemon.tiering import Tiering
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import TierInfo

LAYOUT = Layout(16, 1, "f16", (64 << 10,), "t")       # 16 slots per 1 MiB extent
NS = b"N" * 16
SLOT = 64 << 10


def keys(n, prefix=b""):
    return [(prefix + b"%06d" % i).ljust(16, b"k") for i in range(n)]


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


def setup(pool, disk: FakeTier, remote: FakeTier) -> tuple[Index, Tiering]:
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS, LAYOUT)
    return ix, Tiering(ix, [disk, remote])


def store(ix, ks):
    refs = ix.prepare_store(NS, ks, 1, 0)
    ix.end_store(ix.begin_store(NS, refs, 0), 0, ok=True)


def test_every_commit_goes_to_every_tier(pool):
    disk, remote = FakeTier("disk"), FakeTier("remote")
    ix, t = setup(pool, disk, remote)

    async def run():
        t.start()
        store(ix, keys(6))
        await asyncio.sleep(0.01)
    asyncio.run(run())
    want = {NS + k for k in keys(6)}
    assert disk.held == want and remote.held == want
    assert [i.name for i in t.info()] == ["disk", "remote"]


def test_lookup_takes_pool_then_disk_then_remote(pool):
    ks = keys(8)
    disk = FakeTier("disk", {NS + k for k in ks[2:5]})
    remote = FakeTier("remote", probe_adds={NS + k for k in ks[3:7]})
    ix, t = setup(pool, disk, remote)

    async def run():
        store(ix, ks[:2])
        waiting = t.probe(NS, [ks])
        assert waiting is not None
        await waiting
        t.before_lookup(NS, [ks], 0.0)
        await asyncio.sleep(0)
        return ix.lookup(NS, [ks], False, 1, 0.0)[0]
    assert asyncio.run(run()) == [7]
    assert remote.probed == [[ks[5:]]], "the probe starts past the pool and the disk tier"
    assert disk.promoted == [NS + k for k in ks[2:5]]
    assert remote.promoted == [NS + k for k in ks[5:7]]


def test_no_probe_when_the_pool_and_disk_hold_everything(pool):
    ks = keys(4)
    disk = FakeTier("disk", {NS + k for k in ks[1:]})
    remote = FakeTier("remote")
    ix, t = setup(pool, disk, remote)

    async def run():
        store(ix, ks[:1])
        return t.probe(NS, [ks])
    assert asyncio.run(run()) is None and remote.probed == []


def test_a_tier_that_comes_back_is_offered_the_pool(pool):
    disk, remote = FakeTier("disk"), FakeTier("remote")
    ix, t = setup(pool, disk, remote)

    async def run():
        t.start()
        remote.enabled = False
        store(ix, keys(5))
        await asyncio.sleep(0.01)
        assert remote.held == set()
        remote.held.clear()                  # what it held is gone (a restarted store)
        remote.enabled = True
        remote.on_restored()
        await asyncio.sleep(0.01)
    asyncio.run(run())
    assert remote.held == {NS + k for k in keys(5)}
