"""The CUDA copy engine driven directly (no daemon): bit-exact round trips for every layout and
both backends, a SIGKILLed worker, TP=2. Workers are separate processes (CUDA IPC cannot open a
handle in the process that exported it)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bench.gpu_worker import HEADS, LAYOUTS, Worker, gpu_count, head_range

GPUS = gpu_count()

NUM_BLOCKS = 96
POISON = 0xA5


def _shard_offsets(reg, slots):
    """Pool offsets of ``slots`` (the engine finds a rank's part inside each slot itself)."""
    return np.asarray(slots, dtype=np.int64) * reg.layout.slot_bytes


def _pool_shards(pool, reg, offsets):
    a = pool.array()
    n = reg.layout.shard_bytes
    return np.stack([a[o:o + n] for o in offsets])


def _load_back(engine, m, w, offs, dst, want, what: str) -> None:
    """Load ``offs`` into blocks ``dst`` of a poisoned worker: exactly ``want`` lands there, and
    nothing outside the loaded blocks is written."""
    w.call("poison", POISON)
    engine.submit_load(m, offs, dst).result(60)
    # the worker reads at once, waiting on nothing: a load is done when its future resolves
    assert np.array_equal(w.call("blocks", dst.tolist()), want), \
        f"{what}: GPU blocks differ after load"
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), dst)
    assert (w.call("blocks", untouched.tolist()) == POISON).all()


def test_pitched_copies_pass_their_check(engine):
    from kvpool.daemon import cuda
    if not cuda.has_memcpy_2d_batch():
        pytest.skip("driver has no cuMemcpy3DBatchAsync")
    assert engine.pitched_checked is True, cuda.check_memcpy_2d_batch(0)


def test_tp_cross_3d_copies_pass_their_check(engine):
    """A rank's head range of a per-layer cache is one 3D copy per block when the driver moves
    3D batches right (else each is cut into 2D copies: right, but more driver work)."""
    from kvpool.daemon import cuda
    if not cuda.has_memcpy_2d_batch():
        pytest.skip("driver has no cuMemcpy3DBatchAsync")
    assert cuda.check_memcpy_3d_batch(0) == "" and engine.pitched_3d is True


@pytest.mark.parametrize("backend", ["dma", "dma2d", "kernel"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_bit_exact(engine, pool, layout, backend):
    from kvpool.daemon import cuda
    if backend == "dma2d" and not cuda.has_memcpy_2d_batch():
        pytest.skip("driver has no cuMemcpy3DBatchAsync")
    w = Worker(0, layout, NUM_BLOCKS)
    try:
        reg = w.register_request()
        engine.backend = backend.replace("dma2d", "dma")
        engine.pitched = backend == "dma2d"
        m = engine.attach(reg)
        # a layout whose block is one contiguous run once segments merge (block_outer, or
        # block_heads holding every head) has nothing for pitched copies to cut
        if backend == "dma2d" and m.mean_chunk_bytes < reg.layout.shard_bytes:
            assert m.pitched_ok, "strided segments should make pitched runs"
        rng = np.random.default_rng(hash((layout, backend)) & 0xFFFF)
        src = rng.choice(NUM_BLOCKS, 40, replace=False)
        dst = rng.choice(NUM_BLOCKS, 40, replace=False)
        slots = rng.choice(200 if reg.layout.slot_bytes * 200 < pool.nbytes else 40, 40,
                           replace=False)
        offs = _shard_offsets(reg, slots)
        pool.array()[:] = POISON ^ 0xFF
        w.call("fill", int(rng.integers(1 << 30)))
        want = w.call("blocks", src.tolist())
        r = engine.submit_store(m, src, offs, w.call("event")).result(60)
        assert r.nbytes == len(src) * reg.layout.shard_bytes
        got = _pool_shards(pool, reg, offs)
        assert np.array_equal(got, want), f"{layout}/{backend}: pool differs after store"
        _load_back(engine, m, w, offs, dst, want, f"{layout}/{backend}")
        engine.detach(m, wait_s=10)
        assert m.released.is_set()
    finally:
        engine.backend = "auto"
        engine.pitched = engine.pitched_checked
        w.close()


def test_auto_backend_choice(engine):
    w = Worker(0, "per_head", 8)
    w2 = Worker(0, "block_outer", 8)
    try:
        m, m2 = engine.attach(w.register_request()), engine.attach(w2.register_request())
        # 4 KiB copies: pitched DMA where the driver has it (strided runs), else the kernel
        assert engine.backend_for(m) == ("dma" if engine.pitched_checked else "kernel")
        assert engine.backend_for(m2) == "dma"        # 2 MiB copies
        engine.detach(m, wait_s=10)
        engine.detach(m2, wait_s=10)
    finally:
        w.close()
        w2.close()


def test_killed_worker_releases_gpu_memory(engine, pool):
    from kvpool.daemon import cuda
    probe = Worker(0, "block_outer", 4)
    try:
        free_before = probe.call("mem_free")
        w = Worker(0, "block_outer", 1024)              # 2 GiB of KV
        reg = w.register_request()
        m = engine.attach(reg)
        w.call("fill", 7)
        slots = np.arange(200)
        futs = [engine.submit_store(m, np.arange(i, i + 200) % 1024, _shard_offsets(reg, slots),
                                    w.call("event")) for i in range(0, 1000, 200)]
        w.kill()                                          # mid-transfer
        for f in futs:
            try:
                f.result(60)
            except Exception:
                pass                                      # a failed job is fine, a hang is not
        engine.detach(m, wait_s=30)
        assert m.released.is_set(), "IPC mappings of the dead worker were not released"
        deadline = time.monotonic() + 30
        while probe.call("mem_free") < free_before - (512 << 20):
            assert time.monotonic() < deadline, \
                f"GPU memory not freed: {probe.call('mem_free') >> 20} MiB free, " \
                f"{free_before >> 20} MiB before"
            time.sleep(0.2)
        # the engine still serves
        w3 = Worker(0, "per_layer", 16)
        try:
            reg3 = w3.register_request()
            m3 = engine.attach(reg3)
            w3.call("fill", 3)
            want = w3.call("blocks", [1, 2])
            offs = _shard_offsets(reg3, [5, 6])
            engine.submit_store(m3, np.array([1, 2]), offs).result(60)
            w3.call("poison", POISON)
            engine.submit_load(m3, offs, np.array([3, 4])).result(60)
            assert np.array_equal(w3.call("blocks", [3, 4]), want)
            engine.detach(m3, wait_s=10)
        finally:
            w3.close()
        assert cuda.driver() is not None
    finally:
        probe.close()


@pytest.mark.parametrize("nblocks,inline,chunk,recorded_by", [
    (1, True, 128, "torch"), (1, False, 128, "torch"), (48, False, 128, "torch"),
    (48, False, 16, "torch"), (1, True, 128, "driver"), (48, False, 16, "driver")])
def test_a_store_copies_only_after_the_workers_pending_kernels(engine, pool, nblocks, inline,
                                                               chunk, recorded_by):
    """The daemon polls the worker's event on the host rather than waiting on it on the GPU: a
    store sent while the step's kernels still run copies what they wrote, not what was there
    before (and a job small enough to launch on the caller's thread, or a big one's first
    chunk, leaves the wait to the lane's thread). ``driver``: the event's ring has gone round
    once, so the worker records it through the driver on the raw current stream
    (``StoreEvents``), not through torch."""
    w = Worker(0, "per_layer", NUM_BLOCKS)
    inline_before = engine.inline_max_ops
    try:
        reg = w.register_request()
        m = engine.attach(reg)
        engine.inline_max_ops = 1 << 20 if inline else 0
        engine.chunk_blocks = chunk
        w.call("fill", 1)
        if recorded_by == "driver":
            assert w.call("events_round") == "driver"
        blocks = np.arange(nblocks)
        offs = _shard_offsets(reg, np.arange(nblocks) + 3)
        fut = engine.submit_store(m, blocks, offs, w.call("late_fill", 2, 300))
        assert not w.call("event_done"), \
            "the worker's kernels finished before the store was sent: nothing was waited for"
        want = w.call("blocks", blocks.tolist())     # after the late fill, on its stream
        fut.result(60)
        assert np.array_equal(_pool_shards(pool, reg, offs), want), \
            "the store copied the KV before the worker's kernels had written it"
        engine.detach(m, wait_s=10)
    finally:
        engine.inline_max_ops = inline_before
        engine.chunk_blocks = 128
        w.close()


def test_a_store_waiting_on_a_killed_workers_kernels_ends(engine, pool):
    """A worker killed while its step's kernels run: its store, waiting on its event, ends
    (failed or done) once the registration is detached, as the daemon does for a dead peer,
    and the lane goes on serving others."""
    w = Worker(0, "block_outer", 16)
    try:
        reg = w.register_request()
        m = engine.attach(reg)
        fut = engine.submit_store(m, np.arange(8), _shard_offsets(reg, range(8)),
                                  w.call("late_fill", 3, 5000))
        w.kill()
        engine.detach(m)
        try:
            fut.result(30)
        except Exception as e:  # noqa: BLE001 - failing is fine, hanging is not
            assert not isinstance(e, TimeoutError), "the store hung on a dead worker's event"
        assert m.released.wait(30), "the dead worker's IPC mappings were not released"
    finally:
        w.close()
    w2 = Worker(0, "block_outer", 16)
    try:
        reg2 = w2.register_request()
        m2 = engine.attach(reg2)
        w2.call("fill", 4)
        want = w2.call("blocks", [1, 2])
        offs = _shard_offsets(reg2, [9, 10])
        engine.submit_store(m2, np.array([1, 2]), offs, w2.call("event")).result(60)
        assert np.array_equal(_pool_shards(pool, reg2, offs), want)
        engine.detach(m2, wait_s=10)
    finally:
        w2.close()


@pytest.mark.skipif(GPUS < 2, reason="TP=2 needs two GPUs")
def test_tp2_two_gpus_one_slot(engine, pool):
    ws = [Worker(r, "per_layer", 32) for r in range(2)]
    try:
        regs = [w.register_request(tp_rank=r, tp_size=2) for r, w in enumerate(ws)]
        ms = [engine.attach(reg) for reg in regs]
        assert ms[0].ordinal != ms[1].ordinal
        wants = []
        for r, w in enumerate(ws):
            w.call("fill", 100 + r)
            wants.append(w.call("blocks", list(range(8))))
        futs = [engine.submit_store(ms[r], np.arange(8), _shard_offsets(regs[r], range(8)),
                                    ws[r].call("event")) for r in range(2)]
        for f in futs:
            f.result(60)
        for r, w in enumerate(ws):
            w.call("poison", POISON)
            engine.submit_load(ms[r], _shard_offsets(regs[r], range(8)),
                               np.arange(8, 16)).result(60)
            assert np.array_equal(w.call("blocks", list(range(8, 16))), wants[r])
        for m in ms:
            engine.detach(m, wait_s=10)
    finally:
        for w in ws:
            w.close()


@pytest.mark.parametrize("backend", ["dma", "dma2d", "dma3d", "kernel"])
@pytest.mark.parametrize("layout", sorted(HEADS))
def test_tp_cross_rank_part_round_trip(engine, pool, layout, backend):
    """Rank 1 of TP=2 (heads 4-7 of 8; MLA: the whole latent) on one GPU, head-split layout:
    a store writes exactly its head range of every row of slots that hold every head, and
    nothing else of them; a load brings exactly that back. ``dma2d`` cuts 3D copies into 2D
    ones, ``dma3d`` uses them (where the driver passed the check)."""
    from kvpool.daemon import cuda
    if backend.startswith("dma") and backend != "dma" and not cuda.has_memcpy_2d_batch():
        pytest.skip("driver has no cuMemcpy3DBatchAsync")
    w = Worker(0, layout, NUM_BLOCKS, tp_size=2)
    saved = (engine.pitched, engine.pitched_3d)
    try:
        reg = w.register_request(tp_rank=1, tp_size=2, heads=True)
        engine.backend = "kernel" if backend == "kernel" else "dma"
        engine.pitched = backend in ("dma2d", "dma3d")
        engine.pitched_3d = backend == "dma3d"
        if backend == "dma3d" and not cuda.check_memcpy_3d_batch(0) == "":
            pytest.skip(f"3D copies unusable here: {cuda.check_memcpy_3d_batch(0)}")
        m = engine.attach(reg)
        lay = reg.layout
        heads, cell, _ = HEADS[layout]
        rng = np.random.default_rng(hash((layout, backend, "tp")) & 0xFFFF)
        src = rng.choice(NUM_BLOCKS, 24, replace=False)
        dst = rng.choice(NUM_BLOCKS, 24, replace=False)
        slots = rng.choice(min(120, pool.nbytes // lay.slot_bytes), 24, replace=False)
        offs = _shard_offsets(reg, slots)
        background = POISON ^ 0xFF
        pool.array()[:] = background
        w.call("fill", int(rng.integers(1 << 30)))
        want = w.call("blocks", src.tolist())               # [blocks, rank's shard]
        r = engine.submit_store(m, src, offs, w.call("event")).result(60)
        assert r.nbytes == len(src) * lay.shard_bytes
        a = pool.array()
        h0, h1 = head_range(layout, 2, 1)
        cell = cell if heads > 1 else lay.shard_bytes
        for i, o in enumerate(offs):
            rows = a[o:o + lay.slot_bytes][:lay.rows * heads * cell].reshape(lay.rows, heads, cell)
            mine = rows[:, h0:h1, :]
            assert np.array_equal(mine.reshape(-1), want[i]), \
                f"{layout}/{backend}: slot {slots[i]} does not hold the rank's heads"
            others = np.delete(rows, np.s_[h0:h1], axis=1)
            assert (others == background).all(), f"{layout}/{backend}: other heads written"
            assert (a[o + lay.rows * heads * cell:o + lay.slot_bytes] == background).all()
        _load_back(engine, m, w, offs, dst, want, f"{layout}/{backend}")
        engine.detach(m, wait_s=10)
    finally:
        engine.backend = "auto"
        engine.pitched, engine.pitched_3d = saved
        w.close()


@pytest.mark.parametrize("layout", ["block_outer", "per_layer", "per_head"])
def test_a_chunked_job_reports_landed_chunks_in_order_and_moves_exact_bytes(engine, pool,
                                                                            layout):
    """A job cut into chunks (the first launched on the caller's thread, the rest on the
    lane's) tells its store's ``progress`` of every chunk but the last, in order, once those
    bytes are in the pool; stores and loads stay bit-exact."""
    w = Worker(0, layout, NUM_BLOCKS)
    old = engine.chunk_blocks
    try:
        engine.chunk_blocks = 7
        reg = w.register_request()
        m = engine.attach(reg)
        rng = np.random.default_rng(7)
        src = rng.choice(NUM_BLOCKS, 40, replace=False)
        slots = rng.choice(200 if reg.layout.slot_bytes * 200 < pool.nbytes else 40, 40,
                           replace=False)
        offs = _shard_offsets(reg, slots)
        pool.array()[:] = POISON ^ 0xFF
        w.call("fill", 11)
        want = w.call("blocks", src.tolist())
        seen = []

        def progress(n):
            # (an assert here would only be logged by the engine: record, check below)
            seen.append((n, np.array_equal(_pool_shards(pool, reg, offs[:n]), want[:n])))

        engine.submit_store(m, src, offs, w.call("event"), progress).result(60)
        assert [n for n, _ in seen] == [6, 13, 20, 26, 33]      # 40 items in 6 chunks
        assert all(ok for _, ok in seen), f"{layout}: a chunk was reported before it landed"
        assert np.array_equal(_pool_shards(pool, reg, offs), want)
        dst = rng.choice(NUM_BLOCKS, 40, replace=False)
        _load_back(engine, m, w, offs, dst, want, f"{layout} chunked")
        engine.detach(m, wait_s=10)
    finally:
        engine.chunk_blocks = old
        w.close()


@pytest.mark.parametrize("pending", [False, True])
@pytest.mark.parametrize("layout", ["block_outer", "per_layer"])
def test_a_store_with_late_offsets_copies_its_head_then_waits_for_the_rest(engine, pool, layout,
                                                                         pending):
    """``late``: the head (the first chunk, launched on the caller's thread when the worker's
    event is done already) copies with the offsets given at submission; the engine then asks
    for the next chunk's offsets first (``step``) and launches it on the caller's thread once
    they are written (``advance``); nothing past them is read until the caller writes the rest
    and says so (decoy offsets there stay untouched); then every block lands where the late
    offsets say, its chunks reported in order. A store whose rest never comes ends with the
    caller's error after what went out. ``pending``: the worker's event is not done yet, so
    the lane's thread launches everything, head included, once the rest is written."""
    from kvpool.daemon.copy_engine import HEAD_BLOCKS, TAIL_BLOCKS, LateOffsets, chunk_bounds
    from kvpool.shared.errors import Aborted
    from tests.conftest import wait_for

    w = Worker(0, layout, NUM_BLOCKS)
    old = engine.chunk_blocks
    try:
        engine.chunk_blocks = 40
        engine.backend = "dma"          # the kernel path is never launched on the caller's thread
        reg = w.register_request()
        m = engine.attach(reg)
        n = 80
        head = engine.store_head(n)
        # chunks [0, HEAD_BLOCKS, second, 80]: the last at most TAIL_BLOCKS
        bounds = chunk_bounds(n, 40, TAIL_BLOCKS, HEAD_BLOCKS)
        assert len(bounds) == 4 and head == bounds[1] and engine.store_head(40) == 0, bounds
        second = bounds[2]
        # (a launch on the caller's thread also waits for nothing: not for the pool's pinning)
        wait_for(lambda: engine.registration is None or engine.registration.is_finished, 120,
                 "the pool's registration")
        cap = 200 if reg.layout.slot_bytes * 200 < pool.nbytes else 2 * n
        rng = np.random.default_rng(5)
        slots = rng.choice(cap, 2 * n, replace=False)
        offs, decoys = _shard_offsets(reg, slots[:n]), _shard_offsets(reg, slots[n:])
        src = rng.choice(NUM_BLOCKS, n, replace=False)
        for fails in (False, True):
            pool.array()[:] = POISON ^ 0xFF
            if pending:
                # (the worker's blocks are read once the job is over: a read now would wait for
                # its GPU, and the event with it)
                ev, want = w.call("late_fill", 13 + fails, 200), None
            else:
                w.call("fill", 13 + fails)
                ev = w.call("event")
                wait_for(lambda: w.call("event_done"), 30, "the worker's event")
                want = w.call("blocks", src.tolist())
            late = LateOffsets(np.empty(n, np.int64), head)
            late.offsets[:head] = offs[:head]
            late.offsets[head:] = decoys[head:]
            seen = []
            fut = engine.submit_store(m, src, late.offsets, ev, seen.append, late)
            inline = late.step != 0             # the head went out on this thread
            print(f"{layout} pending={pending} fails={fails}: head launched inline: {inline}")
            try:
                if not pending:
                    # the head went out on this thread: it lands with nothing more from us
                    wait_for(lambda: np.array_equal(_pool_shards(pool, reg, offs[:head]),
                                                    want[:head]), 30,
                             "the head's bytes in the pool before the rest is written")
                    assert late.step == second, "the engine should ask for its next chunk first"
                    late.offsets[head:second] = offs[head:second]
                    late.advance(second)
                    wait_for(lambda: np.array_equal(_pool_shards(pool, reg, offs[:second]),
                                                    want[:second]), 30,
                             "the advanced chunk's bytes in the pool before the rest is written")
                    assert not fut.done()
                else:
                    # (a fresh worker's first kernels can be done before its call returns, so
                    # the event may be done already: then the head went out here)
                    assert not inline or w.call("event_done"), \
                        "the head was launched before the worker's kernels were done"
            finally:
                if fails:
                    late.fail(Aborted("no room for the rest"))
                else:
                    late.offsets[head:] = offs[head:]
                    late.ready()
            if fails:
                with pytest.raises(Aborted, match="no room for the rest"):
                    fut.result(60)
                assert seen == ([head] if inline and pending else [] if pending
                                else [head, second])
            else:
                fut.result(60)
                want = w.call("blocks", src.tolist()) if want is None else want
                assert seen == [head, second]
                assert np.array_equal(_pool_shards(pool, reg, offs), want), \
                    f"{layout}: late offsets not copied exactly"
            assert (_pool_shards(pool, reg, decoys) == POISON ^ 0xFF).all(), \
                "the engine read offsets past the head before they were written"
        engine.detach(m, wait_s=10)
    finally:
        engine.backend = "auto"
        engine.chunk_blocks = old
        w.close()


def test_a_chunked_store_whose_launch_fails_halfway_reports_only_what_landed(engine, pool,
                                                                             monkeypatch):
    from kvpool.daemon.cuda_lane import Lane
    w = Worker(0, "block_outer", NUM_BLOCKS)
    old = engine.chunk_blocks
    enqueue = Lane._enqueue_dma
    calls = []

    def failing_third(self, job, blocks, shards):
        calls.append(len(blocks))
        if len(calls) == 3:
            raise RuntimeError("the driver refused the batch")
        return enqueue(self, job, blocks, shards)

    try:
        engine.chunk_blocks = 8
        reg = w.register_request()
        m = engine.attach(reg)
        monkeypatch.setattr(Lane, "_enqueue_dma", failing_third)
        src = np.arange(32)
        offs = _shard_offsets(reg, np.arange(32))
        pool.array()[:] = POISON ^ 0xFF
        w.call("fill", 12)
        want = w.call("blocks", src.tolist())
        seen = []
        fut = engine.submit_store(m, src, offs, w.call("event"), seen.append)
        with pytest.raises(Exception, match="refused"):
            fut.result(60)
        assert calls == [8, 8, 8] and seen == [8, 16]
        assert np.array_equal(_pool_shards(pool, reg, offs[:16]), want[:16])
        monkeypatch.undo()
        engine.detach(m, wait_s=10)
        assert m.released.is_set()       # the failed job counted as finished
    finally:
        engine.chunk_blocks = old
        w.close()


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_small_jobs_move_exact_bytes_also_across_a_pool_piece(engine, pool, layout, inline):
    """Jobs of a few blocks build their copies in Python from the registration's templates
    (1D runs, pitched records); one whose slot spans two registered pieces of the pool (64
    MiB here) goes through the full tables, cut at the boundary. Every path is bit-exact, on
    the caller's thread and on the lane's."""
    w = Worker(0, layout, NUM_BLOCKS)
    inline_before = engine.inline_max_ops
    try:
        engine.inline_max_ops = 1 << 20 if inline else 0
        reg = w.register_request()
        m = engine.attach(reg)
        n = reg.layout.slot_bytes
        piece = engine.registration.piece_bytes
        # half a slot before the boundary, then two slots well inside a piece
        offs = np.array([piece - n // 2, 3 * n, 5 * n], dtype=np.int64)
        pool.array()[:] = POISON ^ 0xFF
        w.call("fill", 21)
        src = np.array([17, 4, 30])
        want = w.call("blocks", src.tolist())
        for i in range(3):                                # single-block jobs
            engine.submit_store(m, src[i:i + 1], offs[i:i + 1], w.call("event")).result(60)
        assert np.array_equal(_pool_shards(pool, reg, offs), want), f"{layout}: 1-block stores"
        for i in range(3):
            _load_back(engine, m, w, offs[i:i + 1], np.array([40 + i]), want[i:i + 1],
                       f"{layout} 1-block load {i}")
        pool.array()[:] = POISON ^ 0xFF
        w.call("fill", 21)                                # the loads above poisoned it
        engine.submit_store(m, src, offs, w.call("event")).result(60)   # one 3-block job
        assert np.array_equal(_pool_shards(pool, reg, offs), want), f"{layout}: 3-block store"
        _load_back(engine, m, w, offs, np.array([50, 2, 61]), want, f"{layout} 3-block load")
        engine.detach(m, wait_s=10)
    finally:
        engine.inline_max_ops = inline_before
        w.close()


@pytest.mark.parametrize("layout", ["block_outer", "per_layer"])
def test_a_daemon_pool_is_pinned_in_pieces_that_meet_where_its_extents_meet(layout):
    """A daemon's pool (its tables, then its extents) is pinned in pieces that meet at extent
    starts, the first one its tables and what precedes a whole piece: no slot spans two, so a
    head range's copy stays pitched. The odd-sized first piece pins and serves as any other;
    slots on both sides of a boundary move bit-exact both ways."""
    import secrets

    from kvpool.daemon.cuda_copy import CudaCopyEngine
    from kvpool.daemon.pool import Pool
    from kvpool.shared.config import DaemonConfig
    cfg = DaemonConfig(pool_name=f"kvpool-gputest-pieces-{secrets.token_hex(4)}",
                       pool_size="200MiB", extent_size="8MiB")
    pool = Pool.open(cfg)
    engine = CudaCopyEngine(pool, register_piece_bytes=64 << 20)
    w = Worker(0, layout, NUM_BLOCKS)
    try:
        reg = engine.registration
        assert reg.wait(60) and reg.is_complete, reg.error
        g = pool.geometry
        starts = [a - pool.base_address for a, _ in reg.registered]
        assert len(starts) >= 3, starts
        assert starts[0] == 0 and starts[1] == g.data_offset % (64 << 20), starts
        assert all((s - g.data_offset) % g.extent_bytes == 0 for s in starts[1:]), starts
        r = w.register_request()
        m = engine.attach(r)
        assert m.slots_inside_pieces
        n = r.layout.slot_bytes
        boundary = starts[2]
        offs = np.array([boundary - n, boundary, boundary + n], dtype=np.int64)
        data = np.frombuffer(pool.buffer, np.uint8)
        data[offs[0]:offs[-1] + n] = POISON ^ 0xFF
        w.call("fill", 23)
        src = np.array([11, 3, 40])
        want = w.call("blocks", src.tolist())
        engine.submit_store(m, src, offs, w.call("event")).result(60)
        got = np.stack([data[o:o + r.layout.shard_bytes] for o in offs])
        assert np.array_equal(got, want), f"{layout}: store across a piece boundary"
        _load_back(engine, m, w, offs, np.array([60, 61, 62]), want,
                   f"{layout}: load across a piece boundary")
        engine.detach(m, wait_s=10)
    finally:
        w.close()
        engine.close()
        pool.close(unlink=True)      # (a view still held: the mapping goes with the process)
