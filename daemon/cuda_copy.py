"""The CUDA copy engine: moves KV blocks between workers' GPU memory (CUDA IPC) and the pool.

Owns, per GPU: a store lane and a load lane, each a CUDA stream with a submitting thread and a
waiting thread, so a long store never delays a load's completion. Owns the pool's host
registration (``cuda.HostRegistration``, started at construction, background) and each
registration's IPC mappings, reference-counted by handle.

Per job (per chunk of a big job: ``chunk_blocks``, one event after each, so the first chunk copies
while the next is enqueued and each chunk's slots can commit as it lands), exactly one batched
operation runs on the lane's stream, chosen per job:

- ``dma``: one ``cuMemcpyBatchAsync`` over the job's chunk table: copy engines only, no SMs, so
  the model runs at full speed beside it. Best for large chunks (block-outermost layouts).
- ``kernel``: one launch of a Triton gather/scatter kernel on at most ``max_ctas`` CTAs that
  reads or writes the registered pool over UVA. Best for many small chunks (per-layer layouts),
  where the DMA engines' per-copy cost dominates.

The address tables a job sends come from ``copy_plan`` (pitched copies where a registration's
segments form strided runs). Pitched copies are trusted only once a round trip has been
checked, once per engine (``cuda.check_memcpy_2d_batch``).

Small jobs (at most ``inline_max_ops`` copies, ``SMALL_OPS`` by default: those whose tables are
built in Python) are launched on the caller's thread (the event loop) when the lane has nothing
queued, saving the hop to the submit thread (H100 run 20: ~75 us from dispatch to launch start
of a single block). It was off by default while a single block's launch cost 40-150 us of
Python on the loop (runs 4-5: no gain); the templates cut that to ~15 us on CPU.
With ``trace`` (the daemon's ``trace`` setting) every job carries monotonic timestamps of its
hops (``Future.kvpool_trace``) for latency breakdowns.

Ordering: a store must not copy before the worker's step has written the KV: the worker sends
the handle of an interprocess event it recorded on its compute stream, and the lane's thread
polls that event on the host (``cuEventQuery``) before it enqueues the copy. It never makes the
lane's stream wait on it on the GPU: such a wait slows the engine's kernels in the other process
as much as a kernel would (bench/investigations/gemm_probe.py: a GEMM 1.16x slower beside copies that each wait
on one, 1.00x beside the same copies without). A load is reported done (``JobDone``) only after
the lane's thread saw its copy finish, so the engine reads loaded blocks without waiting on
anything either. Jobs of one lane run in submission order; stores and loads run concurrently
(the index never loads into a block that is being stored, nor loads a slot that is not
committed).

Must never: block the event loop (``submit_*`` only enqueue; completion resolves a
``concurrent.futures.Future`` from the waiting thread), unmap a worker's memory while a copy
that touches it is in flight, or run a Python call per block.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvpool.daemon import cuda
from kvpool.daemon.copy_engine import (TAIL_BLOCKS, CopyEngine, JobResult, Mapped,
                                       Progress, chunk_bounds, part_span,
                                       segment_address_table)
from kvpool.daemon.copy_plan import (SMALL_OPS, PitchedOps, block_runs, chunk_table,
                                     flatten_plan, pitched_plan, small_table,
                                     split_at_boundaries, split_items, strided_runs)
from kvpool.shared.config import CHUNK_BLOCKS
from kvpool.shared.errors import (Aborted, InternalError, KvpoolError, LayoutMismatch,
                                  OutOfRange, UnknownId)
from kvpool.shared.layout import check_placement
from kvpool.shared.protocol import CudaRegion, RegisterRequest

log = logging.getLogger(__name__)

Backend = Literal["auto", "dma", "kernel"]

# Kernel vector alignment: every chunk address and size must be a multiple of this.
_KERNEL_ALIGN = 16
_OPENED_EVENTS_MAX = 256   # a worker's store events we keep open (it should reuse a ring)


# ---- registrations ---------------------------------------------------------------------------

class CudaMapped(Mapped):
    """One registration as this engine mapped it: IPC base pointers, per-segment tables."""

    def __init__(self, registration: RegisterRequest, ordinal: int, handles: list[bytes],
                 region_base: list[int]) -> None:
        self.registration = registration
        self.ordinal = ordinal
        self.handles = handles
        self.region_base = region_base
        table = segment_address_table(registration)
        region, offset, stride, nbytes, prefix = table
        # the bytes of a slot this rank touches (its head range may leave out both ends)
        self.part_lo, self.part_hi = part_span(table)
        base = np.asarray(region_base, dtype=np.int64)
        self.seg_dev = base[region] + offset
        self.seg_stride = stride
        self.seg_bytes = nbytes
        self.seg_prefix = prefix
        self.kernel_ok = bool(
            (self.seg_dev % _KERNEL_ALIGN == 0).all() and (stride % _KERNEL_ALIGN == 0).all()
            and (nbytes % _KERNEL_ALIGN == 0).all() and (prefix % _KERNEL_ALIGN == 0).all())
        # mean bytes per copy of one block once contiguous segments merge
        g, _, s = chunk_table(self.seg_dev, stride, nbytes, prefix, np.arange(1),
                              np.zeros(1, dtype=np.int64), 0)
        self.mean_chunk_bytes = int(s.sum()) // max(1, len(s))
        # pitched copies, worth using where they cut the operations per block at least in half
        # (counted as 2D copies: 3D ones are only used once a lane has checked them)
        self.plan = pitched_plan(self.seg_dev, stride, nbytes, prefix,
                                 strided_runs(region, self.seg_dev, stride, nbytes, prefix))
        self.plan_2d = flatten_plan(self.plan)
        self.pitched_ok = len(self.plan_2d) <= len(s) // 2
        self.runs = block_runs(self.seg_dev, stride, nbytes, prefix)
        # (to pool, 3D) -> PitchedOps, made on first use (whether 3D copies work is only
        # known once a lane has checked them)
        self.pitched_ops: dict[tuple[bool, bool], PitchedOps] = {}
        self.seg_table_gpu: Any = None      # torch int64 [4, S] on the device, for the kernel
        self.opened_events: dict[bytes, int] = {}
        self.lock = threading.Lock()
        self.pending = 0
        self.closing = False
        self.released = threading.Event()

    def copies_per_block(self, engine: CudaCopyEngine) -> int:
        """DMA operations one block of this registration takes with ``engine``'s settings."""
        if self.pitched_ok and engine.pitched:
            return len(self.plan) if engine.pitched_3d else len(self.plan_2d)
        return len(self.runs)

    def inside_pieces(self, shard_offsets: np.ndarray, piece: int) -> bool:
        """Whether no slot of a small job (a few items: in Python) spans two separately
        registered pieces of the pool; a big job says False (``split_items`` then decides)."""
        if len(shard_offsets) > SMALL_OPS:
            return False
        lo, hi = self.part_lo, self.part_hi - 1
        return all((o + lo) // piece == (o + hi) // piece for o in shard_offsets.tolist())

    def job_started(self) -> None:
        with self.lock:
            if self.closing:
                raise UnknownId("registration was unregistered")
            self.pending += 1

    def job_finished(self) -> bool:
        """True when this was the last job of a closing registration (release it now)."""
        with self.lock:
            self.pending -= 1
            return self.closing and self.pending == 0


@dataclass
class _Job:
    mapped: CudaMapped
    to_pool: bool
    block_ids: np.ndarray
    shard_offsets: np.ndarray
    wait_event: bytes
    future: Future
    nbytes: int = 0
    # (event recorded after a chunk's copies, items up to its end), in launch order: the last
    # one is the job's completion
    marks: list[tuple[int, int]] = field(default_factory=list)
    staging: Any = None
    backend: str = ""
    # monotonic ns: submitted, launch start, first chunk launched, done
    trace: list[int] | None = None
    progress: Progress | None = None
    error: BaseException | None = None   # a launch that failed after some chunks went out
    bounds: list[int] = field(default_factory=list)   # item bounds of its chunks
    launched: int = 0                    # chunks enqueued so far


class _Lane:
    """One direction on one GPU: a stream, a thread that launches, a thread that waits."""

    def __init__(self, engine: CudaCopyEngine, gpu: _Gpu, to_pool: bool) -> None:
        self.engine = engine
        self.gpu = gpu
        self.to_pool = to_pool
        name = f"kvpool-cuda{gpu.ordinal}-{'store' if to_pool else 'load'}"
        cuda.use_device(gpu.ordinal)
        self.stream = cuda.stream_create()
        self.torch_stream: Any = None
        self.aux: list[tuple[int, int]] = []       # extra DMA streams and their join events
        self._fork_event = cuda.event_create()
        self.free_events: list[int] = []
        self.staging: list[tuple[int, int, int]] = []   # (addr, capacity bytes, last event)
        self.staging_next = 0
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Held while a job's copies are enqueued on the stream (by either thread); ``queued``
        # counts jobs handed to the submit thread but not launched yet, so an inline launch
        # never overtakes one of them.
        self.launch_lock = threading.Lock()
        self.qlock = threading.Lock()
        self.queued = 0
        self.waits: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.recycled: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.submitter = threading.Thread(target=self._submit_loop, name=name + "-submit",
                                          daemon=True)
        self.waiter = threading.Thread(target=self._wait_loop, name=name + "-wait", daemon=True)
        self.submitter.start()
        self.waiter.start()

    # -- launching (caller's thread for small jobs, else the submit thread) --

    def submit(self, job: _Job) -> None:
        """Launch ``job`` now on the caller's thread where that saves a thread hop and the
        lane is idle: a small job whole, a big one's first chunk (the GPU starts on it while
        the submit thread, which takes the job next, enqueues the rest); else queue it."""
        eng = self.engine
        job.bounds = chunk_bounds(len(job.block_ids), eng.chunk_blocks,
                                  TAIL_BLOCKS if job.progress is not None else 0)
        small = (len(job.bounds) == 2 and len(job.block_ids) * job.mapped.copies_per_block(eng)
                 <= eng.inline_max_ops)
        first = eng.inline_first_chunk and len(job.bounds) > 2
        if (small or first) and self.launch_lock.acquire(blocking=False):
            try:
                with self.qlock:
                    idle = self.queued == 0
                if idle:
                    try:
                        cuda.use_device(self.gpu.ordinal)
                        launched = self._launch(job, inline=True, chunks=None if small else 1)
                    except Exception as e:  # noqa: BLE001 - failures go back through the future
                        eng._finish(job, e)
                        return
                    if launched and job.launched == len(job.bounds) - 1:
                        self.waits.put(job)
                        return
                    if launched:
                        # Queued before the lock goes: no later job overtakes its other chunks.
                        self._queue(job)
                        return
            finally:
                self.launch_lock.release()
        self._queue(job)

    def _queue(self, job: _Job) -> None:
        with self.qlock:
            self.queued += 1
        self.jobs.put(job)

    def _submit_loop(self) -> None:
        cuda.use_device(self.gpu.ordinal)
        self.engine._check_pitched(self.gpu.ordinal)
        self._warm_kernel()
        while True:
            job = self.jobs.get()
            if job is None:
                self.waits.put(None)
                return
            with self.launch_lock:
                try:
                    if job.launched:         # its first chunk went out on the caller's thread
                        self._launch_chunks(job)
                    else:
                        self._launch(job)
                except Exception as e:  # noqa: BLE001 - every failure goes back through the future
                    self.engine._finish(job, e)
                else:
                    self.waits.put(job)
                finally:
                    with self.qlock:
                        self.queued -= 1

    def _warm_kernel(self) -> None:
        """Import torch and compile this direction's kernel before the first job needs it
        (seconds, on this thread, never on the event loop)."""
        eng = self.engine
        reg = eng.registration
        if eng.backend == "dma" or reg is None or not reg.wait_until(eng.pool_base + 1):
            return
        if not reg.is_uva_identity:
            return
        try:
            import torch

            from kvpool.daemon._copy_kernel import copy_chunks_kernel
            dev = f"cuda:{self.gpu.ordinal}"
            torch.cuda.set_device(self.gpu.ordinal)
            self.torch_stream = torch.cuda.ExternalStream(self.stream, device=dev)
            seg = torch.zeros((4, 1), dtype=torch.int64, device=dev)
            with torch.cuda.stream(self.torch_stream):
                copy_chunks_kernel[(1,)](
                    seg[0], 0, seg[0], seg[1], seg[2], seg[3], 1, eng.pool_base,
                    _Ptr(eng.pool_base, torch.int32), TO_POOL=self.to_pool,
                    WORDS=eng.kernel_words, num_warps=eng.kernel_warps)
            cuda.stream_synchronize(self.stream)
        except Exception as e:  # noqa: BLE001 - the DMA path still works
            log.warning("kvpool: copy kernel unavailable on GPU %d (%s); using DMA only",
                        self.gpu.ordinal, e)
            eng.kernel_broken = True

    def _event(self) -> int:
        # Only launches take from ``recycled`` (under ``launch_lock``): what empty() says is
        # there stays there, without the cost of an exception per launch.
        recycled = self.recycled
        while not recycled.empty():
            self.free_events.append(recycled.get_nowait())
        return self.free_events.pop() if self.free_events else cuda.event_create()

    def _launch(self, job: _Job, inline: bool = False, chunks: int | None = None) -> bool:
        """Enqueue the job's copies (its first ``chunks`` chunks; None: all) and their
        events on the lane's stream; the caller holds ``launch_lock``. ``inline`` (the event
        loop's thread) must not block: it returns False, having done nothing, for a job that
        needs something that could (a pool piece still being registered, the kernel path's
        first compile, the pitched-copy check, a worker's event not complete yet)."""
        m = job.mapped
        eng = self.engine
        offs = job.shard_offsets
        top = max(offs.tolist()) if len(offs) <= SMALL_OPS else int(offs.max())
        shard_end = eng.pool_base + top + m.part_hi
        reg = eng.registration
        if reg is None:
            pinned = False
        elif inline:
            pinned = reg.registered_end >= shard_end
            if not pinned and not reg.is_finished:
                return False
        else:
            pinned = reg.wait_until(shard_end)
        backend = eng._choose(m, pinned)
        if inline and (backend == "kernel" or (m.pitched_ok and (
                eng.pitched is None or (len(m.plan) < len(m.plan_2d) and eng.pitched_3d is None)))):
            return False
        if job.trace is not None:
            del job.trace[1:]     # an inline try that gave up stamped it already
            job.trace.append(time.monotonic_ns())
        if job.wait_event:
            ev = eng._open_event(m, job.wait_event)
            if not cuda.event_query(ev):
                if inline:
                    return False
                else:
                    self._await_worker(m, ev)
        job.backend = backend
        if backend == "kernel":
            self._launch_kernel(job)
            self._mark(job, len(job.block_ids))
            job.launched = len(job.bounds) - 1
        else:
            self._launch_chunks(job, chunks, inline)
        return True

    def _launch_chunks(self, job: _Job, chunks: int | None = None,
                       inline: bool = False) -> None:
        """Enqueue the next ``chunks`` (None: all remaining) chunks of a DMA job, an event
        after each: the GPU starts on the first chunk while this thread builds the next one's
        table, and the waiting thread can report each chunk as it lands. A failure after some
        chunks went out waits (on the host) for what was enqueued, then goes back through the
        waiting thread with the chunks that did land, so no slot is dropped or reused while a
        copy into it may still run. (Not on the event loop's thread, ``inline``: there only a
        first chunk goes out, and a failure in it leaves no chunk to report.)"""
        bounds = job.bounds
        last = len(bounds) - 1
        end = last if chunks is None else min(last, job.launched + chunks)
        while job.launched < end:
            lo, hi = bounds[job.launched], bounds[job.launched + 1]
            try:
                self._enqueue_dma(job, job.block_ids[lo:hi], job.shard_offsets[lo:hi])
                self._mark(job, hi)
            except Exception as e:  # noqa: BLE001 - reported through the future
                if not inline:
                    self._drain_streams()
                if not job.marks:
                    raise
                job.error = e
                job.launched = last
                return
            job.launched += 1

    def _mark(self, job: _Job, end: int) -> None:
        """Record the event that says items [0, ``end``) of ``job`` have landed."""
        ev = self._event()
        cuda.event_record(ev, self.stream)
        job.marks.append((ev, end))
        if job.trace is not None and len(job.marks) == 1:
            job.trace.append(time.monotonic_ns())

    def _drain_streams(self) -> None:
        """Wait until nothing is in flight on this lane's streams (a failed launch)."""
        for st in [self.stream] + [s for s, _ in self.aux]:
            try:
                cuda.stream_synchronize(st)
            except Exception:  # noqa: BLE001 - the launch's own error is the one reported
                pass

    def _enqueue_dma(self, job: _Job, blocks: np.ndarray, shards: np.ndarray) -> None:
        """One chunk's batched DMA: pitched runs where the registration has them, 1D copies
        for the rest."""
        m = job.mapped
        eng = self.engine
        reg = eng.registration
        split = reg is not None and len(reg.registered) > 1
        if m.pitched_ok and eng.pitched:
            # Shards that straddle two registered pieces of the pool (a few per GiB) go
            # as 1D chunks, split at the boundary; every other one as pitched runs.
            cross = (split_items(shards + m.part_lo, m.part_hi - m.part_lo,
                                 reg.piece_bytes) if split and not m.inside_pieces(
                shards, reg.piece_bytes) else None)
            keep = slice(None) if cross is None else ~cross
            kind = (job.to_pool, bool(eng.pitched_3d))
            tmpl = m.pitched_ops.get(kind)
            if tmpl is None:
                tmpl = m.pitched_ops[kind] = PitchedOps(m.plan if kind[1] else m.plan_2d,
                                                        job.to_pool)
            job.backend = "dma2d"
            if cross is None and len(blocks) * len(tmpl.rows) <= SMALL_OPS:
                table, count = tmpl.small(blocks.tolist(), shards.tolist(), eng.pool_base)
                cuda.memcpy_2d_batch_at(ctypes.addressof(table), count, self.stream)
            else:
                ops = tmpl.for_items(blocks[keep], shards[keep], eng.pool_base)
                self._spread(len(ops), eng.dma_2d_batch_ops,
                             lambda a, b, st: cuda.memcpy_2d_batch_async(ops[a:b], st))
            if cross is None or not cross.any():
                blocks = blocks[:0]
            else:
                blocks, shards = blocks[cross], shards[cross]
        if len(blocks) and len(blocks) * len(m.runs) <= SMALL_OPS and (
                not split or m.inside_pieces(shards, reg.piece_bytes)):
            table, count = small_table(m.runs, blocks.tolist(), shards.tolist(), eng.pool_base)
            at = ctypes.addressof(table)
            dst, src = (at + 8 * count, at) if job.to_pool else (at, at + 8 * count)
            cuda.memcpy_batch_at(dst, src, at + 16 * count, count, self.stream)
        elif len(blocks):
            gpu, host, size = chunk_table(m.seg_dev, m.seg_stride, m.seg_bytes,
                                          m.seg_prefix, blocks, shards, eng.pool_base)
            if split:
                gpu, host, size = split_at_boundaries(gpu, host, size, eng.pool_base,
                                                      reg.piece_bytes)
            dst, src = (host, gpu) if job.to_pool else (gpu, host)
            self._spread(len(size), eng.dma_batch_copies,
                         lambda a, b, st: cuda.memcpy_batch_async(dst[a:b], src[a:b],
                                                                  size[a:b], st))

    def _await_worker(self, m: CudaMapped, ev: int) -> None:
        """Poll the worker's store event from this thread until its step's kernels are done
        (a GPU-side wait would slow the engine: see the module's docstring). The event of a
        worker that died mid-step may never complete: its registration closing ends the wait.
        The first ~50 us spin: an event recorded just before the request is often that close
        to done, and a sleep costs ~70 us however short it is asked to be."""
        spin_end = time.perf_counter() + 50e-6
        delay = 20e-6
        while not cuda.event_query(ev):
            if m.closing:
                raise Aborted("the worker unregistered before its step's KV was written")
            if time.perf_counter() >= spin_end:
                time.sleep(delay)
                delay = min(2 * delay, 500e-6)

    def _spread(self, n: int, per: int, call) -> None:
        """A job's batched DMA: ``call(lo, hi, stream)`` for batches of at most ``per``
        operations (the GPU starts on the first while the driver still reads the next; the
        driver's cost is per operation) spread round robin over ``dma_streams`` streams
        (several copy engines work at once), all joined back into the lane's stream."""
        eng = self.engine
        t0 = time.perf_counter()
        if n <= per or eng.dma_streams <= 1:
            for i in range(0, n, per):
                call(i, i + per, self.stream)
        else:
            while len(self.aux) < eng.dma_streams - 1:
                self.aux.append((cuda.stream_create(), cuda.event_create()))
            streams = [self.stream] + [s for s, _ in self.aux[:eng.dma_streams - 1]]
            fork = self._fork_event
            cuda.event_record(fork, self.stream)
            for s in streams[1:]:
                cuda.stream_wait_event(s, fork)
            for k, i in enumerate(range(0, n, per)):
                call(i, i + per, streams[k % len(streams)])
            for s, ev in self.aux[:eng.dma_streams - 1]:
                cuda.event_record(ev, s)
                cuda.stream_wait_event(self.stream, ev)
        eng.dma_calls_s += time.perf_counter() - t0

    def _stage_items(self, job: _Job) -> int:
        """Copy (block_id, shard_offset) pairs into a pinned ring slot the kernel reads over
        UVA; a slot is reused only after the job that last used it has finished."""
        items = np.empty((len(job.block_ids), 2), dtype=np.int64)
        items[:, 0] = job.block_ids
        items[:, 1] = job.shard_offsets
        need = max(items.nbytes, 4096)
        if len(self.staging) < 8:
            self.staging.append((0, 0, 0))
        k = self.staging_next % len(self.staging)
        self.staging_next += 1
        addr, cap, last = self.staging[k]
        if last:
            cuda.event_synchronize(last)
        if cap < need:
            if addr:
                cuda.host_free(addr)
            cap = 1 << (need - 1).bit_length()
            addr = cuda.host_alloc(cap)
        np.frombuffer((ctypes.c_int64 * items.size).from_address(addr), dtype=np.int64)[:] \
            = items.ravel()
        ev = last or cuda.event_create()
        self.staging[k] = (addr, cap, ev)
        job.staging = ev
        return addr

    def _launch_kernel(self, job: _Job) -> None:
        import torch

        from kvpool.daemon._copy_kernel import copy_chunks_kernel
        eng = self.engine
        m = job.mapped
        if self.torch_stream is None:
            torch.cuda.set_device(self.gpu.ordinal)
            self.torch_stream = torch.cuda.ExternalStream(self.stream,
                                                          device=f"cuda:{self.gpu.ordinal}")
        if m.seg_table_gpu is None:
            t = np.stack([m.seg_dev, m.seg_stride, m.seg_bytes, m.seg_prefix])
            m.seg_table_gpu = torch.from_numpy(t).to(f"cuda:{self.gpu.ordinal}")
        items = self._stage_items(job)
        seg = m.seg_table_gpu
        n_seg = seg.shape[1]
        total = len(job.block_ids) * n_seg
        grid = (max(1, min(eng.max_ctas, total)),)
        with torch.cuda.stream(self.torch_stream):
            copy_chunks_kernel[grid](
                _Ptr(items, torch.int64), len(job.block_ids), seg[0], seg[1], seg[2], seg[3],
                n_seg, eng.pool_base, _Ptr(eng.pool_base, torch.int32),
                TO_POOL=job.to_pool, WORDS=eng.kernel_words, num_warps=eng.kernel_warps)
        # the staging slot is free again once this launch is done
        cuda.event_record(job.staging, self.stream)

    # -- completing (wait thread) --

    def _wait_loop(self) -> None:
        cuda.use_device(self.gpu.ordinal)
        while True:
            job = self.waits.get()
            if job is None:
                return
            err = self._await_marks(job)
            if job.trace is not None:
                job.trace.append(time.monotonic_ns())
            for ev, _ in job.marks:
                self.recycled.put(ev)
            self.engine._finish(job, err or job.error)

    @staticmethod
    def _await_marks(job: _Job) -> BaseException | None:
        """Wait for each chunk of ``job`` in turn, telling its ``progress`` of every one but
        the last; after a failed chunk, only wait for the rest (none of it is reported)."""
        err: BaseException | None = None
        n = len(job.block_ids)
        for ev, end in job.marks:
            try:
                cuda.event_synchronize(ev)
            except Exception as e:  # noqa: BLE001
                err = err or e
                continue
            if err is None and job.progress is not None and end < n:
                try:
                    job.progress(end)
                except Exception:  # noqa: BLE001 - the job's own outcome still goes out
                    log.exception("kvpool: a job's progress callback failed")
        return err


class _Ptr:
    """A raw address Triton accepts as a pointer argument (it reads ``data_ptr`` and
    ``dtype``), so the kernel sees an aligned typed pointer rather than an integer."""

    __slots__ = ("addr", "dtype")

    def __init__(self, addr: int, dtype: Any) -> None:
        self.addr = addr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.addr


class _Gpu:
    def __init__(self, engine: CudaCopyEngine, ordinal: int) -> None:
        self.ordinal = ordinal
        self.store = _Lane(engine, self, to_pool=True)
        self.load = _Lane(engine, self, to_pool=False)


# ---- the engine ------------------------------------------------------------------------------

class CudaCopyEngine(CopyEngine):
    """Copies for ``CudaRegion`` registrations, on every GPU of the host.

    ``pool`` needs ``.base_address`` (int) and ``.nbytes``; shard offsets are byte offsets
    from ``base_address``. Construction returns at once: CUDA initialisation and pool
    registration run on a background thread (``register_pool=False`` skips registration, e.g.
    when the pool is already pinned). ``backend`` forces one path for every job ("auto"
    chooses per registration: kernel when its copies average under ``dma_min_chunk_bytes``).
    """

    name = "cuda"

    def __init__(self, pool: Any, *, backend: Backend = "auto", max_ctas: int = 32,
                 dma_min_chunk_bytes: int = 16 << 10, dma_batch_copies: int = 2048,
                 dma_streams: int = 4, register_pool: bool = True,
                 register_piece_bytes: int = 1 << 30, kernel_words: int = 4096,
                 kernel_warps: int = 16, dma_2d: bool | None = None,
                 dma_2d_batch_ops: int = 256, inline_max_ops: int = SMALL_OPS,
                 chunk_blocks: int = CHUNK_BLOCKS, trace: bool = False) -> None:
        if backend not in ("auto", "dma", "kernel"):
            raise ValueError(f"backend must be auto, dma or kernel, not {backend!r}")
        self.pool = pool
        self.pool_base = int(pool.base_address)
        self.pool_nbytes = int(pool.nbytes)
        self.backend = backend
        self.max_ctas = max_ctas
        self.dma_min_chunk_bytes = dma_min_chunk_bytes
        self.dma_batch_copies = dma_batch_copies
        self.dma_streams = dma_streams
        self.dma_calls_s = 0.0    # CPU seconds inside cuMemcpyBatchAsync (benchmarks)
        self.kernel_words = kernel_words
        self.kernel_warps = kernel_warps
        # pitched copies: True/False forced, None until the first lane has checked them
        self.pitched: bool | None = dma_2d
        # 3D pitched copies (a rank's head range of a per-layer cache in one copy per block):
        # None until checked like the 2D ones; False cuts each into its 2D layers.
        self.pitched_3d: bool | None = None if dma_2d is not False else False
        self.dma_2d_batch_ops = dma_2d_batch_ops
        self.inline_max_ops = inline_max_ops
        self.chunk_blocks = chunk_blocks
        # A big job's first chunk launched on the event loop's thread when its lane is idle:
        # the copy then starts without waiting for the submit thread to be scheduled (H100
        # run 17: 0.5 ms from submit to launch start for a 2 GiB store).
        self.inline_first_chunk = True
        self.trace = trace
        self._pitched_lock = threading.Lock()
        self.registration: cuda.HostRegistration | None = None
        self.kernel_broken = False
        self._gpus: dict[int, _Gpu] = {}
        self._ipc: dict[bytes, list[int]] = {}   # handle -> [devptr, refs]
        self._lock = threading.Lock()
        self._closed = False
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        if register_pool:
            self.registration = cuda.HostRegistration(self.pool_base, self.pool_nbytes,
                                                      register_piece_bytes)
        threading.Thread(target=self._init, name="kvpool-cuda-init", daemon=True).start()

    def _init(self) -> None:
        try:
            cuda.driver()
            if self.registration is not None:
                self.registration.start(0)
        except BaseException as e:  # noqa: BLE001 - reported on first use
            self._init_error = e
        finally:
            self._ready.set()

    def _check_pitched(self, ordinal: int) -> None:
        """Decide once, on a lane thread, whether pitched batches (2D, then 3D) move the right
        bytes."""
        with self._pitched_lock:
            if self.pitched is None:
                why = cuda.check_memcpy_2d_batch(ordinal)
                if why:
                    log.warning("kvpool: pitched batched copies unusable (%s); per-layer layouts "
                                "use one copy per chunk", why)
                self.pitched = not why
            if self.pitched_3d is None:
                why = cuda.check_memcpy_3d_batch(ordinal) if self.pitched else "no 2D copies"
                if why:
                    log.warning("kvpool: 3D pitched copies unusable (%s); a rank's head range "
                                "goes as one 2D copy per layer", why)
                self.pitched_3d = not why

    def _require_ready(self) -> None:
        self._ready.wait()
        if self._init_error is not None:
            raise InternalError(f"CUDA is not usable in the daemon: {self._init_error}")

    def _gpu(self, ordinal: int) -> _Gpu:
        with self._lock:
            g = self._gpus.get(ordinal)
            if g is None:
                g = self._gpus[ordinal] = _Gpu(self, ordinal)
            return g

    # -- attach / detach --

    def attach(self, registration: RegisterRequest, peer=None) -> CudaMapped:
        """Open every region's IPC handle on the GPU named by its UUID. Takes a few ms (IPC
        open), more on the first registration of a GPU (streams, threads)."""
        self._require_ready()
        regions = registration.regions
        if not regions or not all(isinstance(r, CudaRegion) for r in regions):
            raise LayoutMismatch("the CUDA engine takes only CudaRegion registrations")
        uuids = {cuda.normalize_uuid(r.device_uuid) for r in regions}
        if len(uuids) != 1:
            raise LayoutMismatch("one registration's regions must all be on one GPU")
        try:
            ordinal = cuda.device_by_uuid(regions[0].device_uuid)
        except KeyError:
            raise UnknownId(f"no GPU with UUID {regions[0].device_uuid} is visible to the "
                            "daemon (check its CUDA_VISIBLE_DEVICES)") from None
        check_placement(registration.layout, registration.placement,
                        [r.nbytes for r in regions], registration.num_blocks)
        cuda.use_device(ordinal)
        opened: list[bytes] = []
        bases: list[int] = []
        try:
            for r in regions:
                ptr = self._open_ipc(r.ipc_handle)
                opened.append(r.ipc_handle)
                _, size = cuda.address_range(ptr)
                if r.offset_bytes < 0 or r.offset_bytes + r.nbytes > size:
                    raise OutOfRange(f"region of {r.nbytes} bytes at offset {r.offset_bytes} "
                                     f"overruns its {size}-byte allocation")
                bases.append(ptr + r.offset_bytes)
        except cuda.CudaError as e:
            self._close_ipc(opened)
            raise LayoutMismatch(f"cannot open the CUDA IPC handle: {e}. The worker must "
                                 "export cudaMalloc memory (PYTORCH_CUDA_ALLOC_CONF without "
                                 "expandable_segments:True)") from None
        except KvpoolError:
            self._close_ipc(opened)
            raise
        self._gpu(ordinal)
        return CudaMapped(registration, ordinal, opened, bases)

    def _open_ipc(self, handle: bytes) -> int:
        # The same allocation can back several regions or registrations (re-registration
        # after a restart replaces one with an equal one): open once, count references.
        with self._lock:
            ent = self._ipc.get(handle)
            if ent is None:
                ent = self._ipc[handle] = [cuda.ipc_open_mem(handle), 0]
            ent[1] += 1
            return ent[0]

    def _close_ipc(self, handles: list[bytes]) -> None:
        with self._lock:
            for h in handles:
                ent = self._ipc.get(h)
                if ent is None:
                    continue
                ent[1] -= 1
                if ent[1] == 0:
                    del self._ipc[h]
                    try:
                        cuda.ipc_close_mem(ent[0])
                    except cuda.CudaError as e:
                        log.warning("kvpool: cuIpcCloseMemHandle failed: %s", e)

    def detach(self, mapped: Mapped, wait_s: float = 0.0) -> None:
        """Refuse new jobs for ``mapped`` and release its IPC mappings (freeing a dead worker's
        GPU memory) as soon as its in-flight jobs finish: now if none are, else from the
        engine's waiting thread. Returns at once unless ``wait_s`` > 0 asks to wait for that."""
        assert isinstance(mapped, CudaMapped)
        with mapped.lock:
            if mapped.closing:
                return
            mapped.closing = True
            idle = mapped.pending == 0
        if idle:
            self._release(mapped)
        if wait_s > 0:
            mapped.released.wait(wait_s)

    def _release(self, m: CudaMapped) -> None:
        cuda.use_device(m.ordinal)
        self._close_ipc(m.handles)
        for ev in m.opened_events.values():
            try:
                cuda.event_destroy(ev)
            except cuda.CudaError:
                pass
        m.opened_events.clear()
        m.seg_table_gpu = None
        m.released.set()

    # -- jobs --

    def submit_store(self, mapped: Mapped, block_ids: np.ndarray, shard_offsets: np.ndarray,
                     wait_event: bytes = b"", progress: Progress | None = None
                     ) -> Future[JobResult]:
        return self._submit(mapped, True, block_ids, shard_offsets, wait_event, progress)

    def submit_load(self, mapped: Mapped, shard_offsets: np.ndarray,
                    block_ids: np.ndarray) -> Future[JobResult]:
        return self._submit(mapped, False, block_ids, shard_offsets, b"")

    def _submit(self, mapped: Mapped, to_pool: bool, block_ids: np.ndarray,
                shard_offsets: np.ndarray, wait_event: bytes,
                progress: Progress | None = None) -> Future[JobResult]:
        assert isinstance(mapped, CudaMapped)
        fut: Future[JobResult] = Future()
        if self._closed:
            fut.set_exception(Aborted("the daemon is shutting down"))
            return fut
        blocks = np.ascontiguousarray(block_ids, dtype=np.int64)
        shards = np.ascontiguousarray(shard_offsets, dtype=np.int64)
        if blocks.shape != shards.shape or blocks.ndim != 1:
            fut.set_exception(OutOfRange("block ids and slots differ in number"))
            return fut
        try:
            mapped.job_started()
        except KvpoolError as e:
            fut.set_exception(e)
            return fut
        nbytes = len(blocks) * mapped.registration.layout.shard_bytes
        job = _Job(mapped, to_pool, blocks, shards, wait_event, fut, nbytes, progress=progress)
        if self.trace:
            job.trace = [time.monotonic_ns()]
        if len(blocks) == 0:
            self._finish(job, None)
            return fut
        gpu = self._gpus[mapped.ordinal]
        (gpu.store if to_pool else gpu.load).submit(job)
        return fut

    def _choose(self, m: CudaMapped, pinned: bool) -> str:
        can_kernel = pinned and m.kernel_ok and not self.kernel_broken \
            and self.registration is not None and self.registration.is_uva_identity
        can_dma = cuda.has_memcpy_batch()
        if self.backend == "kernel" and can_kernel:
            return "kernel"
        if self.backend == "dma" and can_dma:
            return "dma"
        # Pitched DMA moves strided small chunks at link speed without SMs (H100 run 4: 4 KiB
        # chunks 51 / 49 GB/s); the kernel is only for small chunks that form no strided runs.
        pitched = bool(m.pitched_ok and self.pitched and cuda.has_memcpy_2d_batch())
        if can_kernel and ((m.mean_chunk_bytes < self.dma_min_chunk_bytes and not pitched)
                           or not can_dma):
            return "kernel"
        if can_dma:
            return "dma"
        raise InternalError("no copy path: the driver lacks cuMemcpyBatchAsync (CUDA 12.8+) "
                            "and the pool is not pinned for the kernel path")

    def _open_event(self, m: CudaMapped, handle: bytes) -> int:
        ev = m.opened_events.get(handle)
        if ev is None:
            if len(m.opened_events) >= _OPENED_EVENTS_MAX:
                old = next(iter(m.opened_events))
                cuda.event_destroy(m.opened_events.pop(old))
            ev = m.opened_events[handle] = cuda.event_open_ipc(handle)
        return ev

    def _finish(self, job: _Job, err: BaseException | None) -> None:
        m = job.mapped
        if job.trace is not None:
            job.future.kvpool_trace = job.trace  # type: ignore[attr-defined]
        try:
            if err is None:
                job.future.set_result(JobResult(job.nbytes))
            elif isinstance(err, KvpoolError):
                job.future.set_exception(err)
            else:
                log.error("kvpool: %s job failed on GPU %d: %s",
                          "store" if job.to_pool else "load", m.ordinal, err)
                job.future.set_exception(InternalError(f"CUDA copy failed: {err}"))
        finally:
            if m.job_finished():
                self._release(m)

    def close(self) -> None:
        """Finish the jobs in flight, stop the lanes, unpin the pool."""
        self._closed = True
        for g in list(self._gpus.values()):
            for lane in (g.store, g.load):
                lane.jobs.put(None)
        for g in list(self._gpus.values()):
            for lane in (g.store, g.load):
                lane.submitter.join()
                lane.waiter.join()
        if self.registration is not None and self._ready.is_set() and self._init_error is None:
            self.registration.unregister()

    # -- introspection (tests, benchmarks, metrics) --

    def backend_for(self, mapped: CudaMapped) -> str:
        reg = self.registration
        return self._choose(mapped, reg is not None and reg.is_complete)
