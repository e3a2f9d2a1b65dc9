"""Tiering over fake lower tiers on a real (small) pool, without sockets: every committed block
goes down to every tier that wants it, lookups ask the tiers in order and probe only past what
the pool and the upper tiers hold, and a tier that comes back is offered the pool again."""

from __future__ import annotations

import asyncio

from kvpool.daemon import tiering
from kvpool.daemon.index import Index
from kvpool.daemon.tiering import Tiering
from kvpool.shared.layout import Layout
from tests.daemon.tierkit import FakeTier, GatedTier

LAYOUT = Layout(16, 1, "f16", (64 << 10,), "t")       # 16 slots per 1 MiB extent
NS = b"N" * 16
SLOT = 64 << 10


def keys(n, prefix=b""):
    return [(prefix + b"%06d" % i).ljust(16, b"k") for i in range(n)]


def setup(pool, disk: FakeTier, remote: FakeTier) -> tuple[Index, Tiering]:
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS, LAYOUT)
    return ix, Tiering(ix, [disk, remote])


def store(ix, ks):
    tickets = ix.reserve(NS, len(ks), 1, 0)
    ix.end_store(ix.begin_store(NS, tickets, ks, 0), 0, ok=True)


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
    """A round-trip lookup counts what the tiers hold past the pool, in order, bringing nothing
    up (ref 0 for a lower tier's block, none pinned); the load's staging window (``fetch``)
    brings each run up from the first tier that holds it."""
    ks = keys(8)
    disk = FakeTier("disk", {NS + k for k in ks[2:5]})
    remote = FakeTier("remote", probe_adds={NS + k for k in ks[3:7]})
    ix, t = setup(pool, disk, remote)

    async def run():
        store(ix, ks[:2])
        waiting = t.probe(NS, [ks])
        assert waiting is not None
        await waiting
        hits, leases, refs = ix.lookup(NS, [ks], True, 1, 0.0, t.held_past)
        assert hits == [7] and refs[0][2:] == [0] * 5 and all(refs[0][:2])
        assert ix.table.pinned_count() == 2, "the lease pins the pool's run only"
        assert disk.promoted == [] and remote.promoted == [], "nothing comes up at lookup"
        slots, out_of_room = t.fetch(NS, ks[2:7], 0.0)
        assert not out_of_room and all(slots)
        await asyncio.sleep(0)
    asyncio.run(run())
    assert remote.probed == [[ks[5:]]], "the probe starts past the pool and the disk tier"
    assert disk.promoted == [NS + k for k in ks[2:5]]
    assert remote.promoted == [NS + k for k in ks[5:7]]


def test_a_lookup_past_the_pool_counts_a_tier_run_larger_than_the_pool(pool):
    """Lower-tier hits no longer need room at lookup time: a run longer than the pool has
    slots is counted whole (issue 37: it used to stop where the pool's room did)."""
    capacity = pool.nbytes // SLOT
    ks = keys(capacity + 40)
    disk = FakeTier("disk", {NS + k for k in ks[1:]})
    ix, t = setup(pool, disk, FakeTier("remote"))

    async def run():
        store(ix, ks[:1])
        hits, _, refs = ix.lookup(NS, [ks], False, 1, 0.0, t.held_past)
        assert hits == [len(ks)] and refs[0][1:] == [0] * (len(ks) - 1)
        assert disk.promoted == []
        # the same with the tier off: the pool's run only
        disk.enabled = False
        assert ix.lookup(NS, [ks], False, 1, 0.0, t.held_past)[0] == [1]
    asyncio.run(run())


def test_a_lookup_past_the_pool_stops_at_a_block_being_written_and_counts_a_filling_one(pool):
    """Past the pool's run, a block the pool is still writing is not a hit (and a lower tier
    that lacks it ends the run there), while one the pool is filling from a tier counts with
    its slot's ref. (The walk once named FILLING without importing it, and a block being
    written past the run raised NameError.)"""
    ks = keys(6)
    disk = FakeTier("disk", {NS + k for k in ks[3:5]})
    ix, t = setup(pool, disk, FakeTier("remote"))

    async def run():
        store(ix, ks[:1])
        ix.begin_store(NS, ix.reserve(NS, 1, 1, 0), ks[1:2], 0)        # WRITING, not ended
        assert ix.lookup(NS, [ks], False, 1, 0.0, t.held_past)[0] == [1]
        assert t.held_past(NS, ks, 1) == []
        store(ix, ks[2:3])
        filling, out_of_room = t.fetch(NS, ks[3:4], 0.0)
        assert not out_of_room and filling[0] is not None
        # from ks[2] on: the pool's ks[2], the FILLING ks[3] by its ref, the disk's ks[4]
        refs = t.held_past(NS, ks, 2)
        assert refs[:2] == [ix.table.tables[NS][ks[2]].ref, filling[0].ref] and refs[2:] == [0]
        await asyncio.sleep(0)
    asyncio.run(run())


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
        remote.events.restored()
        await asyncio.sleep(0.01)
    asyncio.run(run())
    assert remote.held == {NS + k for k in keys(5)}


def gated(pool) -> tuple[Index, Tiering, GatedTier]:
    disk = GatedTier()
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS, LAYOUT)
    return ix, Tiering(ix, [disk]), disk


def fill(ix) -> int:
    """Store blocks until every slot of the pool holds one; how many."""
    n = 0
    while True:
        ks = keys(16, b"%d" % n)
        slots = ix.begin_store(NS, ix.reserve(NS, 16, 1, 0), ks, 0)
        ix.end_store(slots, 0, ok=True)
        if any(s.void for s in slots):
            return n
        n += 16
        cls = ix.extents.size_class(SLOT)
        if not cls.free and not ix.extents.free_extents:
            return n


def test_a_store_that_would_evict_blocks_not_yet_written_waits_until_the_tier_wrote_them(pool):
    ix, t, disk = gated(pool)

    async def run():
        t.start()
        total = fill(ix)
        await asyncio.sleep(0)
        assert total >= 64 and len(disk.pending) == 2
        # Every block is queued or being written: any new block would push one out unwritten.
        assert t.must_hold(NS, 1) and t.must_hold(NS, 8)
        await disk.write_next()                 # 4 written: room for 4, not for 8
        assert not t.must_hold(NS, 4) and t.must_hold(NS, 8)
        await disk.write_next()
        assert not t.must_hold(NS, 8) and t.must_hold(NS, 9)
        t.hold_expired()                        # the tier is too slow: nobody waits for it
        assert t.overloaded and not t.must_hold(NS, 9)
        while disk.pending:
            await disk.write_next()
        assert not t.overloaded, "caught up: stores wait for the tier again"
        return total
    total = asyncio.run(run())
    assert len(disk.held) == total and t.info()[0].missed_blocks == 0


def test_no_store_waits_while_nothing_is_queued_for_a_tier_or_the_pool_has_free_room(pool):
    ix, t, disk = gated(pool)

    async def run():
        t.start()
        store(ix, keys(8))
        await asyncio.sleep(0)
        assert len(disk.pending) == 2          # being written, with room to spare
        assert not t.must_hold(NS, 16)
        while disk.pending:
            await disk.write_next()
        assert not t.must_hold(NS, 10 ** 6), "nothing unwritten: eviction loses nothing"
    asyncio.run(run())
    assert len(disk.held) == 8


def test_a_tier_that_goes_off_frees_what_it_had_queued(pool):
    ix, t, disk = gated(pool)

    async def run():
        t.start()
        fill(ix)
        await asyncio.sleep(0)
        assert t.must_hold(NS, 1)
        disk.enabled = False
        while disk.pending:
            await disk.write_next()
        assert not t.must_hold(NS, 1), "a disabled tier holds nothing back"
    asyncio.run(run())


class OrderedTier(GatedTier):
    """A gated disk that remembers the order of the keys it was asked to write."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def demote(self, keys, offsets, slot_bytes):
        self.written += keys
        return super().demote(keys, offsets, slot_bytes)

    def batch_blocks(self, slot_bytes):
        return 64


async def _until(what, why: str, turns: int = 1000) -> None:
    for _ in range(turns):
        if what():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{why} within {turns} turns of the loop")


def test_an_adopted_pool_is_offered_run_by_run_oldest_first_each_block_once(pool, monkeypatch):
    """The pool's offer to its tiers at the start takes a run of blocks per turn of the loop
    (all at once held it ~90 ms at 130K blocks over a disk), least recently used first from the
    size's queue, the pinned after; a block committed while the offer goes on is queued once,
    by its commit, not again by the offer."""
    monkeypatch.setattr(tiering, "OFFER_RUN_BLOCKS", 3)
    disk = OrderedTier()
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS, LAYOUT)
    ks = keys(10, b"adopted")
    store(ix, ks)                                # before the tiering: an adopted pool's blocks
    ix.lookup(NS, [ks[2:3]], False, 1, 0)        # used last
    ix.lookup(NS, [ks[5:6]], True, 1, 0)         # leased: pinned
    t = Tiering(ix, [disk])
    late = keys(2, b"late")

    async def run():
        t.start()
        await asyncio.sleep(0)
        queued = sum(t._dirty.values())
        assert 0 < queued < len(ks), f"{queued} of {len(ks)} blocks offered in one turn"
        store(ix, late)                          # committed while the offer goes on
        await _until(lambda: t._lanes[0].offering is None, "the offer ended")
        assert set(t._dirty.values()) == {1}, "a block queued twice"
        while disk.pending:
            await disk.write_next()
    asyncio.run(run())
    adopted = [k for k in disk.written if k[16:] in ks]
    assert adopted == [NS + k for k in ks[:2] + ks[3:5] + ks[6:] + ks[2:3] + ks[5:6]]
    assert sorted(disk.written) == sorted(NS + k for k in ks + late)


def test_a_tier_back_during_the_start_offer_gets_the_whole_pool_and_the_others_go_on(pool,
                                                                                   monkeypatch):
    monkeypatch.setattr(tiering, "OFFER_RUN_BLOCKS", 3)
    disk, remote = FakeTier("disk"), FakeTier("remote")
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
    ix.register_namespace(NS, LAYOUT)
    ks = keys(12, b"adopted")
    store(ix, ks)
    t = Tiering(ix, [disk, remote])
    remote.enabled = False

    async def run():
        t.start()
        await asyncio.sleep(0)
        remote.enabled = True
        remote.events.restored()
        await _until(lambda: all(lane.offering is None for lane in t._lanes), "the offers ended")
        await _until(lambda: not t._dirty, "every block written")
    asyncio.run(run())
    assert disk.held == remote.held == {NS + k for k in ks}
