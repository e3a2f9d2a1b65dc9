"""The host copy engine on its own: exact bytes for several layouts, ordering, bad regions."""

import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from kvpool.client.host_memory import SharedHostMemory
from kvpool.client.kv_layout import plan_kv_memory
from kvpool.daemon.copy_engine import LateOffsets
from kvpool.daemon.host_copy import HostCopyEngine
from kvpool.daemon.peer import Peer
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import (Aborted, LayoutMismatch, OutOfRange, PermissionDenied, ProtocolError,
                                  UnknownId)
from kvpool.shared.layout import Layout, SegmentPlacement
from kvpool.shared.protocol import HostRegion, RegisterRequest
from tests.conftest import wait_for


def make(shape, block_dim, dtype=torch.float16, split=1):
    """KV tensors: ``split`` views of one shm allocation, the block index on ``block_dim``."""
    n = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size() * split
    mem = SharedHostMemory(n)
    whole = mem.tensor.view(dtype).view(split, *shape)
    tensors = [whole[i] for i in range(split)]
    plan = plan_kv_memory(tensors, [block_dim] * split, [(mem.base_address, n)])
    layout = Layout(16, 1, str(dtype), plan.segment_bytes)
    reg = RegisterRequest(1, b"n" * 16, layout, 0, plan.num_blocks, [mem.region], plan.placement)
    return mem, tensors, reg


CASES = {
    "per-layer NHD (flash)": ((2, 40, 16, 4, 32), 1, 3),     # [2, blocks, tokens, heads, dim]
    "block-outermost": ((40, 3, 2, 16, 4, 32), 0, 1),       # [blocks, layers, 2, ...]
    "MLA latent": ((40, 16, 96), 0, 4),                      # [blocks, tokens, latent]
    "odd sizes (uint8)": ((40, 3, 7), 0, 2),                 # 21-byte segments
}


@pytest.mark.parametrize("name", list(CASES))
def test_store_then_load_is_bit_exact(pool, name):
    shape, bdim, split = CASES[name]
    dtype = torch.uint8 if "uint8" in name else torch.float16
    mem, tensors, reg = make(shape, bdim, dtype, split)
    engine = HostCopyEngine(pool)
    mapped = engine.attach(reg)
    try:
        for t in tensors:
            t.copy_(torch.randint(0, 120, t.shape).to(dtype))
        stride = reg.layout.slot_bytes
        src = np.array([3, 0, 39, 17], np.int64)
        slots = np.array([5, 1, 2, 9], np.int64) * stride + pool.geometry.data_offset
        before = [t.select(bdim, int(b)).clone() for t in tensors for b in src]
        engine.submit_store(mapped, src, slots).result(10)
        dst = np.array([20, 21, 22, 23], np.int64)
        for t in tensors:
            t.index_fill_(bdim, torch.from_numpy(dst), 255 if dtype == torch.uint8 else float("nan"))
        res = engine.submit_load(mapped, slots, dst).result(10)
        assert res.nbytes == reg.layout.shard_bytes * 4
        after = [t.select(bdim, int(b)).clone() for t in tensors for b in dst]
        for a, b in zip(before, after):
            assert torch.equal(a, b)
    finally:
        engine.detach(mapped)
        mem.close()


def test_jobs_of_one_registration_run_in_order(pool):
    mem, (t,), reg = make((2, 8, 16, 4, 32), 1)
    engine = HostCopyEngine(pool)
    mapped = engine.attach(reg)
    off = np.array([pool.geometry.data_offset], np.int64)
    try:
        futs = []
        for value in range(1, 30):
            t[:, 0].fill_(value)
            # store then load into block 1: if jobs reordered, block 1 would see another value
            futs.append(engine.submit_store(mapped, np.array([0]), off))
            futs[-1].result(10)
            futs.append(engine.submit_load(mapped, off, np.array([1])))
        for f in futs:
            f.result(10)
        assert torch.equal(t[:, 1], t[:, 0])
    finally:
        engine.detach(mapped)
        mem.close()


def test_attach_refuses_bad_regions(pool):
    engine = HostCopyEngine(pool)
    layout = Layout(16, 1, "f16", (64,))
    place = [SegmentPlacement(0, 0, 64)]
    with pytest.raises(UnknownId, match="does not exist"):
        engine.attach(RegisterRequest(1, b"n" * 16, layout, 0, 4,
                                      [HostRegion("kvpool-engine-no-such", 256)], place))
    mem = SharedHostMemory(256)
    try:
        with pytest.raises(OutOfRange):
            engine.attach(RegisterRequest(1, b"n" * 16, layout, 0, 5, [mem.region], place))
        with pytest.raises(LayoutMismatch, match="exceeds"):
            engine.attach(RegisterRequest(1, b"n" * 16, layout, 0, 4,
                                          [HostRegion(mem.name, 256, 128)], place))
    finally:
        mem.close()


@pytest.mark.parametrize("slot_order", ["adjacent runs", "adjacent, descending", "scattered"])
def test_both_copy_paths_are_bit_exact(pool, slot_order):
    """Adjacent shards take the one-pass path, scattered ones the gather/scatter path."""
    mem, (t,), reg = make((2, 40, 16, 4, 32), 1)
    engine = HostCopyEngine(pool)
    mapped = engine.attach(reg)
    try:
        t.copy_(torch.randn(t.shape).half())
        n = 24
        order = {"adjacent runs": np.arange(n), "adjacent, descending": np.arange(n)[::-1],
                 "scattered": np.random.permutation(n) * 2}[slot_order]
        slots = order.astype(np.int64) * reg.layout.slot_bytes + pool.geometry.data_offset
        src = np.random.permutation(40)[:n].astype(np.int64)
        expected = t[:, torch.from_numpy(src)].clone()
        engine.submit_store(mapped, src, slots).result(10)
        t.fill_(float("nan"))
        dst = np.random.permutation(40)[:n].astype(np.int64)
        engine.submit_load(mapped, slots, dst).result(10)
        assert torch.equal(t[:, torch.from_numpy(dst)], expected)
    finally:
        engine.detach(mapped)
        mem.close()


def test_attach_opens_only_engine_segments_the_peer_could_open(pool_config):
    """Regression (soak fuzz): a NUL byte in a name crashed the daemon inside the shm library,
    and any name at all (another daemon's pool, its own) was opened for any client."""
    own = msgspec.structs.replace(pool_config, pool_name="kvpool-engine-pool-" + pool_config.pool_name)
    pool = Pool.open(own)
    engine = HostCopyEngine(pool)
    layout = Layout(16, 1, "f16", (64,))
    place = [SegmentPlacement(0, 0, 64)]
    mem = SharedHostMemory(256)
    try:
        for name in ("x\0y", "kvpool-kv-\0", "../" + mem.name, "kvpool-engine-a/b", own.pool_name,
                     "/" + own.pool_name, "kvpool-kv-" + "a" * 300, "other-" + mem.name):
            with pytest.raises(ProtocolError, match="refused"):
                engine.attach(RegisterRequest(1, b"n" * 16, layout, 0, 4,
                                              [HostRegion(name, 256)], place))
        os.chmod("/dev/shm/" + mem.name, 0o600)
        stranger = Peer(uid=os.geteuid() + 4242, gid=4242, pid=1)
        with pytest.raises(PermissionDenied, match="could not open it itself"):
            engine.attach(RegisterRequest(1, b"n" * 16, layout, 0, 4, [mem.region], place),
                          stranger)
        mapped = engine.attach(RegisterRequest(1, b"n" * 16, layout, 0, 4, [mem.region], place),
                               Peer(os.geteuid(), os.getegid(), os.getpid()))
        engine.detach(mapped)
    finally:
        mem.close()
        pool.close(unlink=True)


@pytest.mark.parametrize("order", ["LBNHC", "BLHNC", "LHBNC"])
@pytest.mark.parametrize("slot_order", ["adjacent runs", "scattered"])
def test_tp_cross_rank_rows_paths_are_bit_exact(pool, order, slot_order):
    """A TP=2 rank's head range: the strided one-pass path (adjacent slots; per-layer caches
    load their rows a segment at a time) and the gather/scatter path move exactly its heads of
    each slot, and leave the other rank's heads alone."""
    from bench.kvtest import HeadKv
    kv = HeadKv(2, 1, heads=4, layers=4, blocks=40, block_tokens=8, cell=32, order=order)
    engine = HostCopyEngine(pool)
    reg = RegisterRequest(1, kv.namespace, kv.layout, 1, kv.blocks, [kv.mem.region],
                          kv.placement)
    mapped = engine.attach(reg)
    try:
        if order != "LHBNC":     # one cell per segment there: no uniform rows, generic path
            assert mapped.rows is not None
        n = 12
        idx = {"adjacent runs": np.arange(n), "scattered": np.random.permutation(n) * 3}
        slots = (idx[slot_order].astype(np.int64) * kv.layout.slot_bytes
                 + pool.geometry.data_offset)
        a = pool.view()
        for o in slots:
            a[o:o + kv.layout.slot_bytes] = 0x77
        src = np.random.permutation(kv.blocks)[:n]
        kv.fill(src.tolist(), seed=3)
        engine.submit_store(mapped, src.astype(np.int64), slots).result(10)
        heads, cell = 4, kv.layout.head_bytes
        for o in slots:         # the other rank's heads (0-1) untouched
            rows = a[o:o + kv.layout.slot_bytes].reshape(kv.layout.rows, heads, cell)
            assert (rows[:, :2] == 0x77).all() and not (rows[:, 2:] == 0x77).all()
        dst = np.random.permutation(kv.blocks)[:n]
        kv.poison(dst.tolist())
        engine.submit_load(mapped, slots, dst.astype(np.int64)).result(10)
        kv.check(dst.tolist(), 3, stored_as=src.tolist())
    finally:
        engine.detach(mapped)
        engine.close()
        kv.close()


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" in span and not span.endswith(":") and int(span.split("-")[0], 16) == address:
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:#x}")


def test_the_pool_pages_are_mapped_ahead_and_a_close_stops_it():
    """``_populate`` maps every page of a (reserved, never touched) shm segment into the
    process, so the first copies do not fault page by page; it stops when told to."""
    import mmap

    import posix_ipc

    from kvpool.daemon import host_copy
    nbytes = 3 * host_copy._POPULATE_CHUNK // 2
    shm = posix_ipc.SharedMemory(f"/kvpool-test-populate-{os.getpid()}", posix_ipc.O_CREX,
                                 size=nbytes)
    try:
        os.posix_fallocate(shm.fd, 0, nbytes)
        maps = [mmap.mmap(shm.fd, nbytes) for _ in range(2)]
        views = [np.frombuffer(m, np.uint8) for m in maps]
        host_copy._populate(views[0], lambda: True)            # closed before it began
        assert _rss_kib(views[0].ctypes.data) == 0
        host_copy._populate(views[0], lambda: False)
        assert _rss_kib(views[0].ctypes.data) == nbytes // 1024
        assert _rss_kib(views[1].ctypes.data) == 0               # per mapping, as faults are
        del views
        for m in maps:
            m.close()
    finally:
        shm.close_fd()
        shm.unlink()


def test_the_pool_is_populated_in_short_calls_with_rests_at_the_daemons_priority(monkeypatch):
    """The daemon answers within milliseconds while it populates a big pool: every madvise
    holds the mmap lock its loop's allocations wait behind, so each call is small; the thread
    keeps its priority (at nice 19 a loaded host took it off the CPU mid-call, lock held, for
    hundreds of milliseconds) and rests after each call as long as the call took."""
    import threading
    import time

    from kvpool.daemon import host_copy
    calls = []

    def madvise(at, n, advice):
        t0 = time.monotonic()
        time.sleep(0.002)                   # the call's own time: the thread rests as long
        calls.append((n, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                      t0, time.monotonic()))
        return 0

    monkeypatch.setattr(host_copy, "_madvise", madvise)
    u8 = np.zeros(32 << 20, np.uint8)        # only its address range is used
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=host_copy._populate, args=(u8, lambda: False))
    t.start()
    t.join(30)
    assert not t.is_alive(), "population did not end"
    assert len(calls) >= 16 and max(c[0] for c in calls) <= 2 << 20, calls[:3]
    assert {c[1] for c in calls} == {nice}, "the thread must keep the daemon's priority"
    rests = [nxt[2] - cur[3] for cur, nxt in zip(calls, calls[1:])]
    took = [c[3] - c[2] for c in calls[:-1]]
    assert sum(rests) >= 0.9 * sum(took), (f"rested {sum(rests) * 1e3:.1f} ms after calls "
                                            f"that took {sum(took) * 1e3:.1f} ms")


def _one_block(pool):
    mem, tensors, reg = make((2, 8, 16, 4, 32), 1, torch.float16, 2)
    for t in tensors:
        t.copy_(torch.randint(0, 120, t.shape).to(torch.float16))
    slot = np.array([pool.geometry.data_offset + 3 * reg.layout.slot_bytes], np.int64)
    return mem, tensors, reg, slot


def test_a_small_job_with_nothing_queued_is_copied_inline(pool):
    mem, tensors, reg, slot = _one_block(pool)
    engine = HostCopyEngine(pool)
    mapped = engine.attach(reg)
    try:
        engine.submit_store(mapped, np.array([0], np.int64), slot).result(30)
        before = [t[:, 2].clone() for t in tensors]
        fut = engine.submit_store(mapped, np.array([2], np.int64), slot)
        assert fut.done() and fut.result().nbytes == reg.layout.shard_bytes   # no thread hop
        for t in tensors:
            t[:, 5].fill_(float("nan"))
        fut = engine.submit_load(mapped, slot, np.array([5], np.int64))
        assert fut.done() and fut.result().nbytes == reg.layout.shard_bytes
        assert all(torch.equal(t[:, 5], b) for t, b in zip(tensors, before))
    finally:
        engine.detach(mapped)
        engine.close()


def test_a_small_job_never_overtakes_a_queued_one(pool):
    import threading

    mem, tensors, reg, slot = _one_block(pool)
    engine = HostCopyEngine(pool, inline_bytes=reg.layout.shard_bytes)   # one block inline
    mapped = engine.attach(reg)
    gate = threading.Event()
    try:
        engine.submit_store(mapped, np.array([0], np.int64), slot).result(30)
        mapped.last = mapped.executor.submit(gate.wait, 30)   # the thread is busy with a job
        big = engine.submit_store(mapped, np.arange(2, dtype=np.int64),
                                  slot + np.arange(2) * reg.layout.slot_bytes)
        assert not big.done()                          # over inline_bytes: queued
        tensors[0][:, 0].fill_(7)
        small = engine.submit_load(mapped, slot, np.array([1], np.int64))
        assert not small.done()                        # queued behind it, not run inline
        gate.set()
        small.result(30)
        assert big.done()
        # The load ran after the store, which ran after the gate: block 1 holds the 7s that
        # block 0 held then, not the slot's earlier contents (random values).
        assert (tensors[0][:, 1] == 7).all()
        assert engine.submit_load(mapped, slot, np.array([1], np.int64)).done()   # idle again
    finally:
        gate.set()
        engine.detach(mapped)
        engine.close()


def test_inline_copies_can_be_turned_off(pool):
    mem, tensors, reg, slot = _one_block(pool)
    engine = HostCopyEngine(pool, inline_bytes=0)
    mapped = engine.attach(reg)
    try:
        engine.submit_store(mapped, np.array([0], np.int64), slot).result(30)
        fut = engine.submit_store(mapped, np.array([0], np.int64), slot)
        assert fut.result(30).nbytes == reg.layout.shard_bytes
        assert mapped.last is fut                      # went through the registration's thread
    finally:
        engine.detach(mapped)
        engine.close()


def test_a_big_store_reports_its_chunks_as_they_land(pool):
    """A store with ``progress`` is copied in chunks and told of each one but the last, in
    order, once its bytes are in the pool; the bytes are the same as in one piece."""
    mem, tensors, reg = make(*CASES["block-outermost"][:2])
    engine = HostCopyEngine(pool)
    engine.chunk_blocks = 3
    engine.inline_bytes = 0     # small jobs copied inline are one piece
    mapped = engine.attach(reg)
    try:
        kv = tensors[0]
        kv.copy_(torch.randn(kv.shape).half())
        stride = reg.layout.slot_bytes
        src = np.arange(10, dtype=np.int64)
        slots = np.arange(10, dtype=np.int64)[::-1].copy() * stride + pool.geometry.data_offset
        seen = []

        def progress(n):
            # everything before item n is in the pool by now
            for b, off in zip(src[:n], slots[:n]):
                got = torch.from_numpy(pool.view()[off:off + stride].copy()).view(torch.float16)
                assert torch.equal(got, kv[b].reshape(-1)), f"item {b} reported before it landed"
            seen.append(n)

        res = engine.submit_store(mapped, src, slots, progress=progress).result(10)
        assert res.nbytes == 10 * reg.layout.shard_bytes
        assert seen == [2, 5, 7]          # 10 items in 4 chunks of at most 3; not the last
        # without progress (a load, or a store nobody follows): one piece, nothing reported
        kv.fill_(0)
        assert engine.submit_load(mapped, slots, src).result(10).nbytes == res.nbytes
    finally:
        engine.detach(mapped)
        engine.close()
        mem.close()


def test_a_store_that_fails_halfway_reports_only_the_chunks_that_landed(pool, monkeypatch):
    mem, tensors, reg = make(*CASES["block-outermost"][:2])
    engine = HostCopyEngine(pool)
    engine.chunk_blocks = 4
    engine.inline_bytes = 0
    mapped = engine.attach(reg)
    copy = engine._copy
    calls = []

    def failing_second_chunk(*args, **kw):
        calls.append(len(args[1]))
        if len(calls) == 2:
            raise OSError("the copy failed")
        return copy(*args, **kw)

    monkeypatch.setattr(engine, "_copy", failing_second_chunk)
    try:
        seen = []
        stride = reg.layout.slot_bytes
        slots = np.arange(12, dtype=np.int64) * stride + pool.geometry.data_offset
        fut = engine.submit_store(mapped, np.arange(12, dtype=np.int64), slots,
                                  progress=seen.append)
        with pytest.raises(OSError):
            fut.result(10)
        assert seen == [4] and calls == [4, 4]   # chunk 2 failed, chunk 3 never started
    finally:
        engine.detach(mapped)
        engine.close()
        mem.close()


def _late_store(pool):
    """An engine of 4-item chunks, a registration of random blocks, and a 12-item store's
    source blocks and slot offsets (slots in reverse pool order)."""
    mem, tensors, reg = make(*CASES["block-outermost"][:2])
    engine = HostCopyEngine(pool)
    engine.chunk_blocks = 4
    mapped = engine.attach(reg)
    tensors[0].copy_(torch.randn(tensors[0].shape).half())
    stride = reg.layout.slot_bytes
    offsets = np.arange(12, dtype=np.int64)[::-1].copy() * stride + pool.geometry.data_offset
    return mem, tensors[0], reg, engine, mapped, np.arange(12, dtype=np.int64), offsets


def _in_pool(pool, kv, reg, block, offset) -> bool:
    stride = reg.layout.slot_bytes
    got = torch.from_numpy(pool.view()[offset:offset + stride].copy()).view(torch.float16)
    return torch.equal(got, kv[block].reshape(-1))


def test_a_store_with_late_offsets_copies_its_head_then_waits_for_the_rest(pool):
    """``late``: the engine copies the head whose offsets it was given, and nothing past it
    until the caller has written the rest and said so; then every block lands where the
    offsets written late say."""
    mem, kv, reg, engine, mapped, src, want = _late_store(pool)
    try:
        head = engine.store_head(len(src))
        assert head == 4 and engine.store_head(4) == 0     # no split of a one-chunk store
        late = LateOffsets(np.full(len(src), -1, np.int64), head)
        late.offsets[:head] = want[:head]
        seen = []
        fut = engine.submit_store(mapped, src, late.offsets, progress=seen.append, late=late)
        wait_for(lambda: seen == [4], 10, "the head's chunk to land")
        assert not fut.done(), "the engine went past the head before the rest was written"
        assert all(_in_pool(pool, kv, reg, b, o) for b, o in zip(src[:head], want[:head]))
        late.offsets[head:] = want[head:]
        late.ready()
        assert fut.result(10).nbytes == 12 * reg.layout.shard_bytes
        assert seen == [4, 8]
        assert all(_in_pool(pool, kv, reg, b, o) for b, o in zip(src, want))
    finally:
        engine.detach(mapped)
        engine.close()
        mem.close()


def test_a_store_whose_late_offsets_never_come_ends_with_their_error_after_its_head(pool):
    mem, kv, reg, engine, mapped, src, want = _late_store(pool)
    try:
        late = LateOffsets(np.zeros(len(src), np.int64), 4)
        late.offsets[:4] = want[:4]
        before = pool.view()[want[4]:want[4] + reg.layout.slot_bytes].copy()
        seen = []
        fut = engine.submit_store(mapped, src, late.offsets, progress=seen.append, late=late)
        late.fail(Aborted("no room for the rest"))
        with pytest.raises(Aborted, match="no room for the rest"):
            fut.result(10)
        assert seen == [4]                  # the head landed and was reported; nothing else
        assert np.array_equal(pool.view()[want[4]:want[4] + reg.layout.slot_bytes], before)
    finally:
        engine.detach(mapped)
        engine.close()
        mem.close()


def test_a_load_with_late_offsets_copies_its_head_then_waits_for_the_rest(pool):
    """A load's ``late``, as a store's: the head's blocks come in from the offsets given at
    submission, nothing past them until the rest is written and said to be; a rest that never
    comes ends the job with the caller's error after its head, the other blocks untouched."""
    mem, kv, reg, engine, mapped, src, offsets = _late_store(pool)
    try:
        engine.submit_store(mapped, src, offsets).result(10)
        stored = kv.clone()
        head = engine.load_head(len(src))
        assert head == 4 and engine.load_head(4) == 0
        for fails in (False, True):
            kv.zero_()
            late = LateOffsets(np.full(len(src), -1, np.int64), head)
            late.offsets[:head] = offsets[:head]
            fut = engine.submit_load(mapped, late.offsets, src, late)
            wait_for(lambda: torch.equal(kv[src[:head]], stored[src[:head]]), 10,
                     "the head's blocks to land")
            assert not fut.done(), "the engine went past the head before the rest was written"
            assert not kv[src[head:]].any(), "a block past the head moved before its offset came"
            if fails:
                late.fail(Aborted("the rest is elsewhere"))
                with pytest.raises(Aborted, match="the rest is elsewhere"):
                    fut.result(10)
                assert not kv[src[head:]].any()
            else:
                late.offsets[head:] = offsets[head:]
                late.ready()
                assert fut.result(10).nbytes == 12 * reg.layout.shard_bytes
                assert torch.equal(kv[src], stored[src])
    finally:
        engine.detach(mapped)
        engine.close()
        mem.close()


def test_the_host_engine_copies_without_torch(tmp_path):
    """In a fresh interpreter where ``import torch`` fails, the host engine stores and loads
    every path (runs of slots, scattered slots, a block inline) bit-exact: the daemon never
    imports torch, whose import held the GIL for seconds after a restart (issue 36)."""
    code = """
import os, sys, mmap, secrets
import numpy as np, posix_ipc
sys.modules["torch"] = None                      # any import of torch now raises
from kvpool.daemon.copy_engine import LateOffsets
from kvpool.daemon.host_copy import HostCopyEngine
from kvpool.daemon.pool import Pool
from kvpool.shared.config import DaemonConfig
from kvpool.shared.layout import Layout, SegmentPlacement
from kvpool.shared.protocol import ENGINE_SHM_PREFIX, HostRegion, RegisterRequest
name = ENGINE_SHM_PREFIX + f"{os.getpid()}-" + secrets.token_hex(4)
blocks, seg, segs = 64, 4096, 6                  # per-layer style: segment i of block b at
nbytes = blocks * seg * segs                     # (i * blocks + b) * seg
shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
kv = np.frombuffer(mmap.mmap(shm.fd, nbytes), np.uint8)
kv[:] = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
layout = Layout(16, 1, "uint8", (seg,) * segs)
placement = [SegmentPlacement(0, i * blocks * seg, seg) for i in range(segs)]
reg = RegisterRequest(1, b"n" * 16, layout, 0, blocks, [HostRegion(name, nbytes)], placement)
pool = Pool.open(DaemonConfig(pool_name="kvpool-unit-notorch-" + secrets.token_hex(4),
                              pool_size="8MiB", extent_size="1MiB"))
engine = HostCopyEngine(pool)
engine.start()
m = engine.attach(reg)
view = kv.reshape(segs, blocks, seg)
base, slot = pool.geometry.data_offset, layout.slot_bytes
# runs of adjacent slots (one pass), 20 scattered ones (gather + scatter), one block (inline)
for slots in (np.arange(10), np.random.default_rng(2).permutation(60)[:20], np.array([7])):
    src = np.arange(len(slots), dtype=np.int64)
    offs = base + slots.astype(np.int64) * slot
    want = view[:, src].copy()
    engine.submit_store(m, src, offs).result(30)
    dst = src + 32
    view[:, dst] = 0
    engine.submit_load(m, offs, dst).result(30)
    assert (view[:, dst] == want).all(), slots
engine.detach(m)
engine.close()
pool.close(unlink=True)
shm.unlink()
assert "torch" not in sys.modules or sys.modules["torch"] is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
