"""What a copy job checks before its copy starts, and how a store's slots end (the whole job's
path through a real daemon is in tests/integration/test_server.py)."""

import numpy as np
import pytest

from kvpool.daemon.copy_jobs import (_LIST_CHECKED, MAX_BLOCKS_PER_REQUEST, Landing, _block_ids,
                                     check_count)
from kvpool.shared.errors import OutOfRange, TooLarge


def test_landing_ends_every_slot_once_in_chunks_then_the_rest():
    slots = list("abcdefg")
    keep = np.array([1, 1, 0, 1, 1, 1, 0], dtype=bool)
    landing = Landing(slots, keep)          # c and g are void: never copied
    assert landing.take(2) == ["a", "b"]
    assert landing.take(2) == []             # told twice: nothing more
    assert landing.take(4) == ["d", "e"]
    assert landing.rest() == ["f", "c", "g"]
    assert landing.rest() == [] and landing.take(5) == []


def test_a_landing_without_voids_ends_its_slots_in_order():
    landing = Landing([1, 2, 3])
    assert landing.take(1) == [1]
    assert landing.rest() == [2, 3]


# (ids up to _LIST_CHECKED are checked on the list, more on a numpy array: both ways)
LONG = _LIST_CHECKED + 1


@pytest.mark.parametrize("ids", [[0, 5, 15], list(range(16)) * 4, [5] * LONG])
def test_block_ids_in_range_come_back_as_int64(ids):
    out = _block_ids(ids, 16)
    assert out.dtype == np.int64 and out.tolist() == ids


@pytest.mark.parametrize("ids", [[-1], [16], [0] * 40 + [16], [0] * 40 + [-3], [2 ** 70],
                                 [0] * 40 + [2 ** 70], [0] * LONG + [16], [0] * LONG + [-3],
                                 [0] * LONG + [2 ** 70]])
def test_block_ids_out_of_range_are_refused_by_name(ids):
    with pytest.raises(OutOfRange, match=r"block ids must be in \[0, 16\)"):
        _block_ids(ids, 16)


def test_a_request_naming_too_many_blocks_is_refused():
    check_count(MAX_BLOCKS_PER_REQUEST, "blocks")
    with pytest.raises(TooLarge, match="split it"):
        check_count(MAX_BLOCKS_PER_REQUEST + 1, "blocks")


# ---- stores held for a lower tier that is behind --------------------------------------------

class _Instant:
    """A copy engine whose jobs are done as they are submitted."""

    def __new__(cls):
        from concurrent.futures import Future

        from kvpool.daemon.copy_engine import CopyEngine, JobResult, Mapped

        class Instant(CopyEngine):
            name = "instant"

            def attach(self, registration, peer=None):
                m = Mapped.__new__(Mapped)
                m.registration = registration
                return m

            def detach(self, mapped):
                pass

            def submit_store(self, mapped, block_ids, shard_offsets, wait_event=b"",
                             progress=None, late=None):
                f = Future()
                f.set_result(JobResult(len(block_ids)))
                return f

            def submit_load(self, mapped, shard_offsets, block_ids, late=None):
                raise AssertionError("no loads here")
        return Instant()


def holds(srv) -> dict[str, float]:
    """``kvpool_store_holds_total`` by outcome, as a scrape would read it."""
    registry = srv.jobs.telemetry.metrics.registry
    return {o: registry.get_sample_value("kvpool_store_holds_total", {"outcome": o})
            for o in ("written", "expired")}


async def _held_store_server(pool):
    """An in-process daemon on ``pool`` over a disk that writes only when told, its pool
    filled with blocks the disk has not written yet; (server, disk, store) where ``store(n)``
    sends a keyed store of ``n`` new blocks and returns the replies list's length before it."""
    import os

    from kvpool.daemon.server import Server
    from kvpool.shared import protocol as p
    from kvpool.shared.config import DaemonConfig
    from kvpool.shared.layout import Layout, SegmentPlacement
    from tests.conftest import wait_for_async
    from tests.daemon.tierkit import GatedTier

    slot = 64 << 10
    disk = GatedTier()
    cfg = DaemonConfig(pool_name=pool.name.lstrip("/"), pool_size="8MiB", extent_size="1MiB")
    srv = Server(cfg, pool, {p.CudaRegion: _Instant()}, lowers=[disk])
    replies: list = []
    srv._send = srv.jobs.send = lambda _identity, reply: replies.append(reply)
    ns = b"s" * 16

    class Frame:
        def __init__(self, msg) -> None:
            self.buffer = memoryview(p.encode(msg))

    def call(msg):
        srv._dispatch(b"\0me", Frame(msg))
        return replies[-1]

    call(p.Hello(1, p.PROTOCOL_VERSION, p.Role.WORKER, "t", os.getpid()))
    srv._dispatch(b"\0me", Frame(p.RegisterRequest(
        2, ns, Layout(16, 1, "f16", (slot,), "t"), 0, 16,
        [p.CudaRegion("GPU-0", b"h" * 64, 16 * slot)], [SegmentPlacement(0, 0, slot)])))
    await wait_for_async(lambda: len(replies) == 2, 10, "the registration's reply")  # attached
    reg = replies[-1].registration_id
    made = iter(range(10 ** 6))

    def store(n: int) -> int:
        ks = [b"%016d" % next(made) for _ in range(n)]
        refs = srv.index.reserve(ns, n, 7, 0.0)
        before = len(replies)
        srv._dispatch(b"\0me", Frame(p.StoreRequest(next(made), reg, 1, list(range(n)), refs,
                                                    keys=ks)))
        return before
    return srv, disk, store, replies


def test_a_store_that_would_push_out_blocks_the_disk_has_not_written_waits_for_the_disk(pool):
    import asyncio

    async def run():
        srv, disk, store, replies = await _held_store_server(pool)
        srv.tiering.start()
        while srv.index.extents.free_extents or srv.index.extents.size_class(64 << 10).free:
            n = store(16)
            assert replies[n].code == 0, replies[n]
        await asyncio.sleep(0)
        assert len(disk.pending) == 2, "the disk writes two batches at a time"
        n = store(8)
        assert len(replies) == n, "held: the pool has no block the disk has written"
        await disk.write_next()
        assert len(replies) == n, "4 written: not room enough for 8"
        await disk.write_next()
        assert len(replies) == n + 1 and replies[n].code == 0, "8 written: the store went"
        assert srv.jobs.held_jobs == 1 and not srv.tiering.overloaded
        assert holds(srv) == {"written": 1.0, "expired": 0.0}
        while disk.pending:
            await disk.write_next()
        return srv
    srv = asyncio.run(run())
    assert srv.tiering.info()[0].missed_blocks == 0


def test_a_hold_runs_out_when_the_disk_does_not_keep_up_and_then_nobody_waits(pool):
    import asyncio

    from kvpool.daemon.tiering import STORE_HOLD_S
    from kvpool.shared.errors import ErrorCode

    async def run():
        srv, disk, store, replies = await _held_store_server(pool)
        srv.tiering.start()
        while srv.index.extents.free_extents or srv.index.extents.size_class(64 << 10).free:
            store(16)
        await asyncio.sleep(0)
        n = store(8)
        m = store(4)                         # behind the first, in arrival order
        assert len(replies) == n
        deadline = asyncio.get_running_loop().time() + 10 * STORE_HOLD_S + 5
        while len(replies) < n + 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert [r.code for r in replies[n:]] == [0, 0], replies[n:]
        assert m == n and srv.tiering.overloaded
        assert holds(srv) == {"written": 0.0, "expired": 2.0}, "both waited their hold out"
        k = store(4)
        assert len(replies) == k + 1, "overloaded: a store no longer waits"
        while disk.pending:
            await disk.write_next()
        assert not srv.tiering.overloaded, "the disk caught up"
        for _ in range(20):                  # the written blocks make room, until none is left
            k = store(16)
            if len(replies) == k:
                break
        assert len(replies) == k, "caught up: stores wait again once the clean room is used"
        srv.jobs.abort_held()
        assert replies[k].code == int(ErrorCode.ABORTED), replies[k]
        return srv
    srv = asyncio.run(run())
    assert srv.tiering.info()[0].missed_blocks > 0, "the blocks pushed out unwritten are counted"
