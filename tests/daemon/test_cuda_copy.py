"""The CUDA engine's job flow on CPU: lanes, chunks, their events and progress, failures, driven
through a stand-in for the driver whose batched copies are host memmoves and whose events are
always complete. What it cannot show (copies that overlap their launch, real events) is for
tests/gpu; what it shows is which thread launches which chunk, what is reported when, and
that a failure reports only the chunks that went out whole."""

from __future__ import annotations

import ctypes
import itertools
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvpool.client.kv_layout import plan_kv_memory
from kvpool.daemon import cuda as real_cuda
from kvpool.daemon import copy_plan, cuda_copy, cuda_lane
from kvpool.daemon.pool import Geometry
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import CudaRegion, RegisterRequest

BLOCKS = 24
BLOCK_BYTES = 4096

# The engine's modules that call ``kvpool.daemon.cuda``: a stand-in driver replaces it in each.
DRIVER_USERS = (cuda_copy, cuda_lane, copy_plan)


class FakeDriver:
    """What the engine (``DRIVER_USERS``) calls of ``kvpool.daemon.cuda`` on the DMA path, on
    host memory."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.memory: dict[bytes, np.ndarray] = {}     # IPC handle -> "device" memory
        self.copies: list[tuple[str, int]] = []       # (thread name, copies in the call)
        self.fail_copy_call = 0                       # n: the n-th batched call raises
        self.fail_sync_call = 0                       # n: the n-th event wait raises
        self.syncs = 0
        self.spans: list[tuple[int, int, int]] = []   # every (dst, src, bytes) moved
        self.single_copies = 0                        # calls of memcpy_async

    def __getattr__(self, name):
        if name in ("use_device", "stream_synchronize", "stream_wait_event", "event_destroy",
                    "ipc_close_mem"):
            return lambda *a: None
        raise AttributeError(name)

    def driver(self):
        return self

    def _new(self, *_a) -> int:
        return next(self._ids)

    stream_create = event_create = event_open_ipc = _new

    @staticmethod
    def has_memcpy_batch() -> bool:
        return True

    pitched = False            # True: pitched batches too (the per-layer layouts' path)

    def has_memcpy_2d_batch(self) -> bool:
        return self.pitched

    @staticmethod
    def check_memcpy_2d_batch(_ordinal: int) -> str:
        return ""

    check_memcpy_3d_batch = check_memcpy_2d_batch

    pitched_ops = staticmethod(real_cuda.pitched_ops)

    @staticmethod
    def normalize_uuid(u: str) -> str:
        return u.lower()

    @staticmethod
    def device_by_uuid(_u: str) -> int:
        return 0

    def ipc_open_mem(self, handle: bytes) -> int:
        return self.memory[handle].ctypes.data

    def address_range(self, ptr: int) -> tuple[int, int]:
        for a in self.memory.values():
            if a.ctypes.data == ptr:
                return ptr, a.nbytes
        raise KeyError(ptr)

    @staticmethod
    def event_record(_ev: int, _stream: int) -> None:
        pass

    events_done = True         # False: the worker's kernels are still running

    def event_query(self, _ev: int) -> bool:
        return self.events_done

    def event_synchronize(self, _ev: int) -> None:
        self.syncs += 1
        if self.syncs == self.fail_sync_call:
            raise RuntimeError("an illegal address was encountered")

    def memcpy_batch_async(self, dst, src, size, _stream) -> None:
        self.copies.append((threading.current_thread().name, len(size)))
        if len(self.copies) == self.fail_copy_call:
            raise RuntimeError("the driver refused the batch")
        for d, s, n in zip(dst.tolist(), src.tolist(), size.tolist()):
            ctypes.memmove(d, s, n)
            self.spans.append((d, s, n))

    def memcpy_async(self, dst: int, src: int, size: int, stream) -> None:
        self.single_copies += 1
        self.memcpy_batch_async(*(np.array([x], np.uint64) for x in (dst, src, size)), stream)

    def memcpy_batch_at(self, dst: int, src: int, size: int, count: int, stream) -> None:
        def col(addr: int) -> np.ndarray:
            return np.frombuffer((ctypes.c_uint64 * count).from_address(addr), np.uint64)
        self.memcpy_batch_async(col(dst), col(src), col(size), stream)

    def memcpy_2d_batch_at(self, ops: int, count: int, stream) -> None:
        size = count * real_cuda.BATCH3D_OP_DTYPE.itemsize
        self.memcpy_2d_batch_async(np.frombuffer((ctypes.c_char * size).from_address(ops),
                                                 real_cuda.BATCH3D_OP_DTYPE), stream)

    def memcpy_2d_batch_async(self, ops, _stream) -> None:
        """Pitched copies by the driver's addressing: byte x of row y of layer z at
        ptr + (z * layer + y) * row + x."""
        self.copies.append((threading.current_thread().name, len(ops)))
        if len(self.copies) == self.fail_copy_call:
            raise RuntimeError("the driver refused the batch")
        for o in ops.tolist():
            f = dict(zip(ops.dtype.names, o))
            for z in range(f["depth"]):
                for y in range(f["height"]):
                    d = f["dst_ptr"] + (z * f["dst_layer"] + y) * f["dst_row"]
                    s = f["src_ptr"] + (z * f["src_layer"] + y) * f["src_row"]
                    ctypes.memmove(d, s, f["width"])
                    self.spans.append((d, s, f["width"]))


class HostPool:
    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, np.uint8)
        self.base_address = self.array.ctypes.data
        self.nbytes = nbytes


def use_driver(monkeypatch, drv: FakeDriver) -> FakeDriver:
    for module in DRIVER_USERS:
        monkeypatch.setattr(module, "cuda", drv)
    return drv


@pytest.fixture
def fake(monkeypatch):
    return use_driver(monkeypatch, FakeDriver())


@pytest.fixture
def engine(fake):
    pool = HostPool(2 * BLOCKS * BLOCK_BYTES)
    eng = cuda_copy.CudaCopyEngine(pool, backend="dma", register_pool=False, dma_2d=False,
                                   chunk_blocks=4)
    eng.test_pool = pool
    yield eng
    eng.close()


@pytest.fixture
def mapped(engine, fake):
    """A block-outermost KV cache of BLOCKS blocks in fake device memory, random bytes."""
    kv = np.random.default_rng(1).integers(0, 255, BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    fake.memory[b"h" * 64] = kv
    t = torch.from_numpy(kv).view(BLOCKS, BLOCK_BYTES)
    plan = plan_kv_memory([t], [0], [(kv.ctypes.data, kv.nbytes)])
    reg = RegisterRequest(1, b"n" * 16, Layout(16, 1, "uint8", plan.segment_bytes), 0,
                          plan.num_blocks, [CudaRegion("GPU-0", b"h" * 64, kv.nbytes)],
                          plan.placement)
    m = engine.attach(reg)
    yield m, kv
    engine.detach(m, wait_s=10)


def _pool_blocks(engine, offsets) -> np.ndarray:
    a = engine.test_pool.array
    return np.stack([a[o:o + BLOCK_BYTES] for o in offsets])


def test_a_big_store_goes_in_chunks_the_first_from_the_callers_thread(engine, fake, mapped):
    m, kv = mapped
    blocks = np.arange(10)[::-1].copy()
    offs = (np.arange(10) + 3) * BLOCK_BYTES
    seen = []
    engine.submit_store(m, blocks, offs, b"", seen.append).result(10)
    assert seen == [3, 6]                  # 10 items in chunks [0, 3, 6, 10]: not the last
    assert [n for _, n in fake.copies] == [3, 3, 4]
    lanes = [name for name, _ in fake.copies]
    assert lanes[0] == threading.current_thread().name      # no thread hop before the copy
    assert all(name.endswith("store-submit") for name in lanes[1:])
    assert np.array_equal(_pool_blocks(engine, offs), kv.reshape(BLOCKS, -1)[blocks])
    # a load in chunks brings them back (no progress: a load reports only its end)
    kv[:] = 0
    engine.submit_load(m, offs, blocks).result(10)
    assert np.array_equal(kv.reshape(BLOCKS, -1)[blocks], _pool_blocks(engine, offs))


def test_a_store_that_reports_chunks_ends_with_a_small_one_and_a_load_does_not(
        engine, fake, mapped, monkeypatch):
    """TAIL_BLOCKS: after a store's last copy only a small chunk is left to commit; a store
    nobody follows and a load keep near-equal chunks."""
    m, kv = mapped
    monkeypatch.setattr(cuda_lane, "TAIL_BLOCKS", 1)
    offs = (2 * np.arange(10) + 3) * BLOCK_BYTES     # apart: a copy per block (no joins)
    seen = []
    engine.submit_store(m, np.arange(10), offs, b"", seen.append).result(10)
    assert seen == [3, 6, 9]               # [0, 3, 6, 9] + the tail [9, 10)
    assert [n for _, n in fake.copies] == [3, 3, 3, 1]
    assert np.array_equal(_pool_blocks(engine, offs), kv.reshape(BLOCKS, -1)[:10])
    fake.copies.clear()
    engine.submit_store(m, np.arange(10), offs).result(10)
    engine.submit_load(m, offs, np.arange(10)).result(10)
    assert [n for _, n in fake.copies] == [3, 3, 4] * 2


def test_without_the_inline_first_chunk_every_chunk_goes_from_the_lane(engine, fake, mapped):
    m, _ = mapped
    engine.inline_first_chunk = False
    engine.submit_store(m, np.arange(10), np.arange(10) * BLOCK_BYTES).result(10)
    assert all(name.endswith("store-submit") for name, _ in fake.copies)
    assert len(fake.copies) == 3


@pytest.mark.parametrize("pinned", [False, True], ids=["batch_call", "one_copy_call"])
def test_a_launch_that_fails_halfway_reports_only_the_chunks_that_went_out(engine, fake,
                                                                            mapped, pinned):
    m, kv = mapped
    if pinned:      # a registered pool: each chunk, one copy, goes through cuMemcpyAsync
        pool = engine.test_pool
        engine.registration = PiecesRegistration(pool.base_address, pool.nbytes, pool.nbytes)
    fake.fail_copy_call = 3
    seen = []
    offs = np.arange(10) * BLOCK_BYTES
    fut = engine.submit_store(m, np.arange(10), offs, b"", seen.append)
    with pytest.raises(Exception, match="refused"):
        fut.result(10)
    assert seen == [3, 6] and len(fake.copies) == 3
    assert fake.single_copies == (3 if pinned else 0)
    assert np.array_equal(_pool_blocks(engine, offs[:6]), kv.reshape(BLOCKS, -1)[:6])
    # the lane goes on serving
    fake.fail_copy_call = 0
    assert engine.submit_store(m, np.arange(2), offs[:2]).result(10).nbytes == 2 * BLOCK_BYTES


def test_a_chunk_whose_copy_fails_stops_the_reports_there(engine, fake, mapped):
    m, _ = mapped
    fake.fail_sync_call = 2                # the wait for the job's second chunk
    seen = []
    fut = engine.submit_store(m, np.arange(10), np.arange(10) * BLOCK_BYTES, b"", seen.append)
    with pytest.raises(Exception, match="illegal address"):
        fut.result(10)
    assert seen == [3]                     # chunk 1 landed; chunk 2 failed; chunk 3 unreported
    assert fake.syncs == 3                 # but still waited for, before the slots can go


def test_a_small_store_is_one_chunk_and_reports_nothing(engine, fake, mapped):
    m, _ = mapped
    seen = []
    engine.submit_store(m, np.arange(4)[::-1].copy(), np.arange(4) * BLOCK_BYTES, b"",
                        seen.append).result(10)
    assert seen == [] and [n for _, n in fake.copies] == [4]
    # at most SMALL_OPS copies: launched whole on the caller's thread, no hop to the lane
    assert fake.copies[0][0] == threading.current_thread().name


def test_a_small_job_goes_to_the_lane_when_inline_is_off_or_the_worker_is_not_done(
        engine, fake, mapped):
    m, kv = mapped
    engine.inline_max_ops = 0
    engine.submit_store(m, np.array([1]), np.array([0])).result(10)
    assert fake.copies[-1][0].endswith("store-submit")
    engine.inline_max_ops = cuda_copy.SMALL_OPS
    # the worker's kernels still run: the loop's thread must not wait, the lane polls
    fake.events_done = False
    fut = engine.submit_store(m, np.array([2]), np.array([BLOCK_BYTES]), b"e" * 64)
    assert not fut.done() and len(fake.copies) == 1
    fake.events_done = True
    fut.result(10)
    assert fake.copies[-1][0].endswith("store-submit")
    assert np.array_equal(_pool_blocks(engine, [BLOCK_BYTES])[0], kv.reshape(BLOCKS, -1)[2])


def test_a_small_job_never_overtakes_one_queued_on_its_lane(engine, fake, mapped):
    """Jobs of one lane run in submission order: with a job waiting for the submit thread, a
    small one behind it is queued too rather than launched at once."""
    m, _ = mapped
    fake.events_done = False
    first = engine.submit_store(m, np.arange(10), 2 * np.arange(10) * BLOCK_BYTES, b"e" * 64)
    second = engine.submit_store(m, np.array([3]), np.array([20 * BLOCK_BYTES]))
    assert fake.copies == []
    fake.events_done = True
    first.result(10)
    second.result(10)
    assert [n for _, n in fake.copies] == [3, 3, 4, 1]
    assert all(name.endswith("store-submit") for name, _ in fake.copies)


# ---- small jobs: tables from the registration's templates; the pool in registered pieces ----

LAYERS = 6
LAYER_BYTES = 512


class PiecesRegistration:
    """A pool registered in pieces of ``piece_bytes`` (as ``cuda.HostRegistration`` leaves a
    pool over 1 GiB): no DMA copy may span two pieces."""

    is_finished = is_complete = True
    is_uva_identity = False

    def __init__(self, base: int, nbytes: int, piece_bytes: int, phase: int = 0) -> None:
        self.piece_bytes = piece_bytes
        self.phase = phase
        cuts = [base] + list(range(base + (phase or piece_bytes), base + nbytes, piece_bytes))
        self.registered = [(a, min(b, base + nbytes) - a)
                           for a, b in zip(cuts, cuts[1:] + [base + nbytes])]
        self.registered_end = base + nbytes

    def wait_until(self, _end: int, _timeout_s=None) -> bool:
        return True

    def unregister(self) -> None:
        pass


@pytest.fixture
def pitched_engine(fake):
    fake.pitched = True
    pool = HostPool(2 * BLOCKS * LAYERS * LAYER_BYTES)
    eng = cuda_copy.CudaCopyEngine(pool, backend="dma", register_pool=False, chunk_blocks=4)
    eng.test_pool = pool
    yield eng
    eng.close()


@pytest.fixture
def per_layer(pitched_engine, fake):
    """A per-layer KV cache (LAYERS tensors of [BLOCKS, LAYER_BYTES]) in fake device memory."""
    kv = np.random.default_rng(2).integers(0, 255, LAYERS * BLOCKS * LAYER_BYTES,
                                            dtype=np.uint8)
    fake.memory[b"p" * 64] = kv
    t = torch.from_numpy(kv).view(LAYERS, BLOCKS, LAYER_BYTES)
    plan = plan_kv_memory(list(t), [0] * LAYERS, [(kv.ctypes.data, kv.nbytes)])
    reg = RegisterRequest(1, b"p" * 16, Layout(16, 1, "uint8", plan.segment_bytes), 0,
                          plan.num_blocks, [CudaRegion("GPU-0", b"p" * 64, kv.nbytes)],
                          plan.placement)
    m = pitched_engine.attach(reg)
    yield m, kv.reshape(LAYERS, BLOCKS, LAYER_BYTES)
    pitched_engine.detach(m, wait_s=10)


def _slot(pool: HostPool, offset: int) -> np.ndarray:
    return pool.array[offset:offset + LAYERS * LAYER_BYTES].reshape(LAYERS, LAYER_BYTES)


def test_per_layer_jobs_of_any_size_move_the_right_bytes(pitched_engine, fake, per_layer):
    m, kv = per_layer
    pool = pitched_engine.test_pool
    slot = LAYERS * LAYER_BYTES
    pitched_engine.submit_store(m, np.array([5]), np.array([3 * slot])).result(10)
    assert np.array_equal(_slot(pool, 3 * slot), kv[:, 5])
    assert len(fake.copies) == 1 and fake.copies[0][1] == 1     # one pitched record, no numpy
    blocks = np.array([9, 2, 7, 0, 11, 4, 1, 8, 3, 6])
    offs = (np.arange(10) + 5) * slot
    pitched_engine.submit_store(m, blocks, offs).result(10)     # chunks of 4, 3, 3 items
    for b, o in zip(blocks, offs):
        assert np.array_equal(_slot(pool, o), kv[:, b])
    kv[:] = 0
    pitched_engine.submit_load(m, np.array([3 * slot]), np.array([2])).result(10)
    assert np.array_equal(kv[:, 2], _slot(pool, 3 * slot))
    pitched_engine.submit_load(m, offs, blocks).result(10)
    for b, o in zip(blocks, offs):
        assert np.array_equal(kv[:, b], _slot(pool, o))


@pytest.mark.parametrize("layout", ["block_outer", "per_layer"])
def test_a_small_job_whose_slot_spans_two_pool_pieces_is_cut_at_the_boundary(
        request, fake, layout):
    eng = request.getfixturevalue("engine" if layout == "block_outer" else "pitched_engine")
    m, kv = request.getfixturevalue("mapped" if layout == "block_outer" else "per_layer")
    kv = kv.reshape(BLOCKS, 1, -1).transpose(1, 0, 2) if layout == "block_outer" else kv

    def block(b: int) -> np.ndarray:
        return kv[:, b].ravel()

    pool = eng.test_pool
    slot = len(block(0))
    eng.registration = PiecesRegistration(pool.base_address, pool.nbytes, 3 * slot // 2 + 256)
    # slot 0 lies inside the first piece (one copy); slot 1 spans the first two (cut in two)
    eng.submit_store(m, np.array([4]), np.array([0])).result(10)
    eng.submit_store(m, np.array([6]), np.array([slot])).result(10)
    kv[:, 1] = 0
    eng.submit_load(m, np.array([slot]), np.array([1])).result(10)
    assert np.array_equal(pool.array[:slot], block(4))
    assert np.array_equal(pool.array[slot:2 * slot], block(6))
    assert np.array_equal(block(1), block(6))
    lo = pool.base_address
    pieces = [(a, a + n) for a, n in eng.registration.registered]
    pool_side = [(d if lo <= d < lo + pool.nbytes else s, n) for d, s, n in fake.spans]
    assert all(any(a <= h and h + n <= b for a, b in pieces) for h, n in pool_side), \
        "a copy spans two registered pieces"
    if layout == "block_outer":
        assert [n for _, n in fake.copies] == [1, 2, 2]


def test_a_daemon_pool_is_registered_in_pieces_that_meet_where_its_extents_meet(fake):
    """The engine registers a pool that has a geometry (the daemon's) in whole extents from
    its first extent on; a bare buffer from its base, in the pieces asked for."""
    made = []

    class Registration:
        def __init__(self, addr, nbytes, piece_bytes, phase=0):
            made.append((piece_bytes, phase))

        def start(self, _ordinal):
            return self

        def unregister(self):
            pass

    fake.HostRegistration = Registration
    g = Geometry.plan(6 << 30, 32 << 20)
    daemon_pool = SimpleNamespace(base_address=1 << 40, nbytes=g.pool_bytes, geometry=g)
    for pool in (daemon_pool, HostPool(1 << 20)):
        cuda_copy.CudaCopyEngine(pool, backend="dma", register_piece_bytes=128 << 20).close()
    (piece, phase), bare = made
    assert piece == 128 << 20 and bare == (128 << 20, 0)
    assert phase == g.data_offset % piece != 0     # the tables before the first extent
    assert (g.data_offset - phase) % g.extent_bytes == 0


def test_pool_pieces_that_meet_where_slots_meet_leave_every_slot_one_pitched_copy(
        pitched_engine, fake, per_layer):
    """Where registered pieces meet between slots (as a daemon's pool registers them), every
    slot of a per-layer job goes as its one pitched copy; where they meet inside slots, those
    slots fall apart into 1D copies cut at the boundary."""
    m, kv = per_layer
    pool = pitched_engine.test_pool
    slot = LAYERS * LAYER_BYTES
    blocks, offs = np.arange(8), (np.arange(8) + 1) * slot
    calls = {}
    for phase in (slot, slot // 2):
        pitched_engine.registration = PiecesRegistration(pool.base_address, pool.nbytes,
                                                         3 * slot, phase)
        fake.copies.clear()
        fake.spans.clear()
        pitched_engine.submit_store(m, blocks, offs).result(10)
        for b, o in zip(blocks, offs):
            assert np.array_equal(_slot(pool, o), kv[:, b]), f"phase {phase}: block {b}"
        pieces = [(a, a + n) for a, n in pitched_engine.registration.registered]
        lo = pool.base_address
        assert all(any(a <= d and d + n <= e for a, e in pieces) for d, _, n in fake.spans
                   if lo <= d < lo + pool.nbytes), f"phase {phase}: a copy spans two pieces"
        calls[phase] = [n for _, n in fake.copies]
    assert calls[slot] == [4, 4], "a slot inside one piece was not one pitched copy"
    assert len(calls[slot // 2]) > 2, "slots cut by a piece boundary went pitched"


def test_a_registration_whose_slots_lie_inside_pieces_never_looks_for_cut_slots(
        pitched_engine, fake, per_layer, monkeypatch):
    """A daemon's pool is registered where its slots meet (for most slot sizes: the engine
    tells each registration, ``attach``): the lanes then spend no numpy calls per chunk on
    looking for slots that span two pieces (they run on the GIL the event loop needs), small
    chunks or big, and every slot still goes as its one pitched copy."""
    m, kv = per_layer
    pool = pitched_engine.test_pool
    slot = LAYERS * LAYER_BYTES
    pitched_engine.registration = PiecesRegistration(pool.base_address, pool.nbytes,
                                                     4 * slot, slot)
    m.slots_inside_pieces = True
    looks = []
    monkeypatch.setattr(cuda_lane, "split_items", lambda *a: looks.append(a))
    monkeypatch.setattr(cuda_copy.CudaMapped, "inside_pieces", lambda *a: looks.append(a))
    blocks = np.arange(20)
    offs = (np.arange(20) + 1) * slot
    for chunk in (4, 128):                     # 4 x 1 ops: the Python table; 20: numpy's
        pitched_engine.chunk_blocks = chunk
        fake.copies.clear()
        pitched_engine.submit_store(m, blocks, offs).result(10)
        assert sum(n for _, n in fake.copies) == 20, f"chunks of {chunk}: {fake.copies}"
        for b, o in zip(blocks, offs):
            assert np.array_equal(_slot(pool, o), kv[:, b]), f"chunks of {chunk}: block {b}"
    assert looks == []


def test_a_chunk_of_up_to_small_table_ops_copies_gets_its_table_in_python(
        engine, fake, mapped, monkeypatch):
    """Numpy's table costs ~4x the Python one when the daemon meets a job cold (its caches
    evicted by the copy before): up to ``SMALL_TABLE_OPS`` copies a chunk's table is built in
    Python, unless a slot spans two registered pieces of the pool (numpy cuts it there)."""
    m, kv = mapped
    built: list[int] = []
    real = cuda_lane.chunk_table

    def spy(*a):
        built.append(len(a[4]))
        return real(*a)

    monkeypatch.setattr(cuda_lane, "chunk_table", spy)
    engine.chunk_blocks = 128
    assert copy_plan.SMALL_OPS < 20 <= copy_plan.SMALL_TABLE_OPS
    blocks = np.arange(20)[::-1].copy()
    offs = (np.arange(20) + 2) * BLOCK_BYTES
    engine.submit_store(m, blocks, offs).result(10)           # one chunk of 20 copies
    assert built == [] and [n for _, n in fake.copies] == [20]
    assert np.array_equal(_pool_blocks(engine, offs), kv.reshape(BLOCKS, -1)[blocks])
    pool = engine.test_pool
    engine.registration = PiecesRegistration(pool.base_address, pool.nbytes,
                                             5 * BLOCK_BYTES + BLOCK_BYTES // 2)
    fake.spans.clear()
    engine.submit_store(m, blocks, offs).result(10)           # slot 4 spans pieces 0 and 1
    assert built == [20]
    lo = pool.base_address
    pieces = [(a, a + n) for a, n in engine.registration.registered]
    assert all(any(a <= d and d + n <= b for a, b in pieces) for d, _, n in fake.spans
               if lo <= d < lo + pool.nbytes), "a copy spans two registered pieces"
    assert np.array_equal(_pool_blocks(engine, offs), kv.reshape(BLOCKS, -1)[blocks])


def test_blocks_into_slots_that_follow_go_as_one_copy_cut_where_two_pool_pieces_meet(
        engine, fake, mapped):
    """A chunk's consecutive blocks into consecutive slots join into one copy (the driver
    costs per copy, most when the daemon meets the job cold); where two registered pieces of
    the pool meet between two slots, the copy is cut there."""
    m, kv = mapped
    engine.chunk_blocks = 128
    offs = (np.arange(12) + 2) * BLOCK_BYTES
    engine.submit_store(m, np.arange(12), offs).result(10)
    assert [n for _, n in fake.copies] == [1]
    assert fake.single_copies == 0         # the pool is not page-locked: the batch call
    assert np.array_equal(_pool_blocks(engine, offs), kv.reshape(BLOCKS, -1)[:12])
    pool = engine.test_pool
    engine.registration = PiecesRegistration(pool.base_address, pool.nbytes, 5 * BLOCK_BYTES)
    fake.copies.clear()
    fake.spans.clear()
    kv[:] = 0
    engine.submit_load(m, offs, np.arange(12)).result(10)   # pieces meet at slots 5 and 10
    assert [n for _, n in fake.copies] == [3]
    lo = pool.base_address
    pieces = [(a, a + n) for a, n in engine.registration.registered]
    assert all(any(a <= h and h + n <= b for a, b in pieces) for _, h, n in fake.spans), \
        "a copy spans two registered pieces"
    assert sorted(n for *_, n in fake.spans) == [3 * BLOCK_BYTES, 4 * BLOCK_BYTES,
                                                  5 * BLOCK_BYTES]
    assert np.array_equal(kv.reshape(BLOCKS, -1)[:12], _pool_blocks(engine, offs))
    assert all(lo <= h < lo + pool.nbytes for _, h, _ in fake.spans)
    assert fake.single_copies == 0
    # inside one registered piece, one copy goes through cuMemcpyAsync (cheaper cold)
    engine.submit_store(m, np.arange(4) + 7, offs[3:7]).result(10)
    assert fake.single_copies == 1 and [n for _, n in fake.copies[-1:]] == [1]
    assert np.array_equal(_pool_blocks(engine, offs[3:7]), kv.reshape(BLOCKS, -1)[7:11])


class TwoGpus(FakeDriver):
    """Registrations on GPU-0 and GPU-1, and worker events that stay pending until let go."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: set[bytes] = set()      # worker event handles not complete yet
        self.handles: dict[int, bytes] = {}

    @staticmethod
    def device_by_uuid(u: str) -> int:
        return int(u.rsplit("-", 1)[1])

    def event_open_ipc(self, handle: bytes) -> int:
        ev = self._new()
        self.handles[ev] = handle
        return ev

    def event_query(self, ev: int) -> bool:
        return self.handles.get(ev) not in self.pending


def _register_on(engine, fake, gpu: int):
    kv = np.random.default_rng(gpu).integers(0, 255, BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    handle = bytes([gpu + 1]) * 64
    fake.memory[handle] = kv
    t = torch.from_numpy(kv).view(BLOCKS, BLOCK_BYTES)
    plan = plan_kv_memory([t], [0], [(kv.ctypes.data, kv.nbytes)])
    reg = RegisterRequest(1, b"n" * 16, Layout(16, 1, "uint8", plan.segment_bytes), 0,
                          plan.num_blocks, [CudaRegion(f"GPU-{gpu}", handle, kv.nbytes)],
                          plan.placement)
    return engine.attach(reg), kv


def test_each_gpu_has_its_own_lanes_and_a_stalled_one_holds_no_other_gpu(monkeypatch):
    """One daemon for every GPU of a host (issue 28): a registration on GPU k copies on GPU k's
    own store and load lanes, so a store waiting for one engine's step never delays another
    GPU's copies (eight engines must not queue behind one)."""
    fake = use_driver(monkeypatch, TwoGpus())
    pool = HostPool(4 * BLOCKS * BLOCK_BYTES)
    eng = cuda_copy.CudaCopyEngine(pool, backend="dma", register_pool=False, dma_2d=False)
    eng.test_pool = pool
    try:
        (m0, kv0), (m1, kv1) = _register_on(eng, fake, 0), _register_on(eng, fake, 1)
        assert (m0.ordinal, m1.ordinal) == (0, 1)
        g0, g1 = eng._gpus[0], eng._gpus[1]
        lanes = [g0.store, g0.load, g1.store, g1.load]
        assert len({lane.stream for lane in lanes}) == 4
        assert len({lane.submitter.name for lane in lanes}) == 4
        blocks = np.arange(4)
        fake.pending.add(b"w" * 64)
        held = eng.submit_store(m0, blocks, blocks * BLOCK_BYTES, b"w" * 64)
        offs1 = (blocks + 8) * BLOCK_BYTES
        eng.submit_store(m1, blocks, offs1, b"v" * 64).result(10)
        eng.submit_load(m1, offs1, blocks + 4).result(10)
        assert np.array_equal(kv1.reshape(BLOCKS, -1)[4:8], kv1.reshape(BLOCKS, -1)[:4])
        assert not held.done(), "GPU 0's store went before its worker's step was done"
        fake.pending.clear()
        held.result(10)
        assert np.array_equal(_pool_blocks(eng, blocks * BLOCK_BYTES), kv0.reshape(BLOCKS, -1)[:4])
        # GPU 0's held store went from its own lane's thread, never from GPU 1's
        names = {name for name, _ in fake.copies}
        assert "kvpool-cuda0-store-submit" in names
        for m in (m0, m1):
            eng.detach(m, wait_s=10)
    finally:
        eng.close()
