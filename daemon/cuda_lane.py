"""The CUDA engine's lanes: per GPU a store lane and a load lane, each a CUDA stream with a
submitting thread and a waiting thread, so a long store never delays a load's completion.

A big job goes in chunks (``chunk_blocks``, one event after each), so the first chunk copies
while the next is enqueued and each chunk's slots can commit as it lands. The engine
(``cuda_copy``) chooses each job's path; ``copy_plan`` builds its tables.

Small jobs (at most ``inline_max_ops`` copies, ``SMALL_OPS`` by default: those whose tables are
built in Python), and jobs of at most ``LEAD_BLOCKS`` blocks (a worker's lead request, or any
job that size: what a big job's first chunk costs the loop) are launched on the caller's thread
(the event loop) when the lane has nothing queued, saving the hop to the submit thread (H100
run 20: ~75 us from dispatch to launch start of a single block). It was off by default while
a single block's launch cost 40-150 us of Python on the loop (runs 4-5: no gain); the
templates cut that to ~15 us on CPU.
With ``trace`` (the daemon's ``trace`` setting) every job carries monotonic timestamps of its
hops (``Future.kvpool_trace``) and of each chunk's launch and landing (``Future.kvpool_chunks``)
for latency breakdowns.

Ordering: a store must not copy before the worker's step has written the KV: the worker sends
the handle of an interprocess event it recorded on its compute stream, and the lane's thread
polls that event on the host (``cuEventQuery``) before it enqueues the copy. It never makes the
lane's stream wait on it on the GPU: such a wait slows the engine's kernels in the other process
as much as a kernel would (bench/investigations/gemm_probe.py: a GEMM 1.16x slower beside
copies that each wait on one, 1.00x beside the same copies without). A load is reported done
(``JobDone``) only after the lane's thread saw its copy finish, so the engine reads loaded
blocks without waiting on anything either. Jobs of one lane run in submission order; stores and
loads run concurrently (the index never loads into a block that is being stored, nor loads a
slot that is not committed).

Must never: block the event loop (a launch on its thread that would wait does nothing, and the
job goes to the submit thread) or run a Python call per block.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.daemon import cuda, numa
from kvpool.daemon.copy_engine import (HEAD_BLOCKS, TAIL_BLOCKS, LateOffsets, Progress,
                                       chunk_bounds)
from kvpool.daemon.copy_plan import (SMALL_TABLE_OPS, PitchedOps, chunk_table, small_table,
                                     split_at_boundaries, split_items)
from kvpool.shared.errors import Aborted
from kvpool.shared.protocol import LEAD_BLOCKS

if TYPE_CHECKING:
    from kvpool.daemon.cuda_copy import CudaCopyEngine, CudaMapped

log = logging.getLogger(__name__)


@dataclass
class Job:
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
    # with ``trace``, monotonic ns per chunk: enqueued, seen landed (``Future.kvpool_chunks``:
    # a chunk enqueued after the one before it landed left the GPU idle in between)
    chunks_ns: tuple[list[int], list[int]] | None = None
    # with ``trace``, monotonic ns inside the launch of its first chunk: the worker's event
    # seen done (or none to wait for), that chunk's copies enqueued (``Future.kvpool_launch``)
    launch_ns: list[int] | None = None
    progress: Progress | None = None
    error: BaseException | None = None   # a launch that failed after some chunks went out
    bounds: list[int] = field(default_factory=list)   # item bounds of its chunks
    launched: int = 0                    # chunks enqueued so far
    # A job whose offsets past its head come after submission (``copy_engine``): the caller's
    # thread launches its first chunk (and, a store's, the next on ``advance``) at most, this
    # lane's thread waits for the rest.
    late: LateOffsets | None = None
    pinned: bool = False                 # the pool range it copies is registered (page-locked)


class Lane:
    """One direction on one GPU: a stream, a thread that launches, a thread that waits."""

    def __init__(self, engine: CudaCopyEngine, gpu: Gpu, to_pool: bool) -> None:
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
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Held while a job's copies are enqueued on the stream (by either thread); ``queued``
        # counts jobs handed to the submit thread but not launched yet, so an inline launch
        # never overtakes one of them.
        self.launch_lock = threading.Lock()
        self.qlock = threading.Lock()
        self.queued = 0
        self.waits: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.recycled: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.submitter = threading.Thread(target=self._submit_loop, name=name + "-submit",
                                          daemon=True)
        self.waiter = threading.Thread(target=self._wait_loop, name=name + "-wait", daemon=True)
        self.submitter.start()
        self.waiter.start()

    # -- launching (caller's thread for small jobs, else the submit thread) --

    def submit(self, job: Job) -> None:
        """Launch ``job`` now on the caller's thread where that saves a thread hop and the
        lane is idle: a small job whole, a big one's first chunk (the GPU starts on it while
        the submit thread, which takes the job next, enqueues the rest), a late store's head;
        else queue it."""
        eng = self.engine
        job.bounds = chunk_bounds(len(job.block_ids), eng.chunk_blocks,
                                  TAIL_BLOCKS if job.progress is not None else 0,
                                  HEAD_BLOCKS if eng.inline_first_chunk else 0)
        whole = len(job.bounds) == 2 and job.late is None
        small = whole and (len(job.block_ids) * job.mapped.copies_per_block(eng)
                           <= eng.inline_max_ops)
        # a worker's lead request (LEAD_BLOCKS), the first chunk of a job sent in two; not
        # where inline launches are off (``inline_max_ops`` 0)
        lead = (whole and eng.inline_max_ops > 0 and eng.inline_first_chunk
                and len(job.block_ids) <= LEAD_BLOCKS)
        first = eng.inline_first_chunk and len(job.bounds) > 2 and (
            job.late is None or job.bounds[1] <= job.late.head)
        if (small or lead or first) and self.launch_lock.acquire(blocking=False):
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
                        if job.late is not None and len(job.bounds) > 3:
                            # The caller finds the next chunk's room first and launches it
                            # here too (``advance``), before it finds the rest's.
                            job.late.step = job.bounds[2]
                            job.late.on_advance = lambda upto: self._advance(job, upto)
                        # Queued before the lock goes: no later job overtakes its other chunks.
                        self._queue(job)
                        return
            finally:
                self.launch_lock.release()
        self._queue(job)

    def _queue(self, job: Job) -> None:
        with self.qlock:
            self.queued += 1
        self.jobs.put(job)

    def _submit_loop(self) -> None:
        numa.pin_thread(self.engine.thread_cpus.get(self.gpu.ordinal), self.submitter.name)
        cuda.use_device(self.gpu.ordinal)
        self.engine._check_pitched(self.gpu.ordinal)
        self._warm_kernel()
        while True:
            job = self.jobs.get()
            if job is None:
                self.waits.put(None)
                return
            if job.launched and job.late is not None:
                # Outside the lock: the caller may launch the job's next chunk meanwhile.
                job.late.settle()
            with self.launch_lock:
                try:
                    if job.launched:         # its first chunk went out on the caller's thread
                        self._continue(job)
                    else:
                        self._launch(job)
                except Exception as e:  # noqa: BLE001 - every failure goes back through the future
                    self.engine._finish(job, e)
                else:
                    self.waits.put(job)
                finally:
                    with self.qlock:
                        self.queued -= 1

    def _advance(self, job: Job, upto: int) -> None:
        """``LateOffsets.advance`` of a late store whose head went out on the caller's thread:
        launch, on that thread too, the chunks its offsets now cover, where the lane is free
        and the pool under them registered (else this thread launches them with the rest).
        A failure is the job's (``_continue`` reports it), never the caller's."""
        if job.error is not None or not self.launch_lock.acquire(blocking=False):
            return
        try:
            bounds, k = job.bounds, job.launched
            end = k
            while end + 1 < len(bounds) and bounds[end + 1] <= upto:
                end += 1
            if end == k:
                return
            eng = self.engine
            reg = eng.registration
            top = int(job.shard_offsets[bounds[k]:bounds[end]].max())
            if reg is not None and reg.registered_end < eng.pool_base + top + job.mapped.part_hi:
                return
            cuda.use_device(self.gpu.ordinal)
            self._launch_chunks(job, end - k, inline=True)
        except Exception as e:  # noqa: BLE001 - reported through the job's future
            job.error = e
        finally:
            self.launch_lock.release()

    def _continue(self, job: Job) -> None:
        """Enqueue the chunks of a job whose first went out on the caller's thread, once its
        late offsets are written (and the pool under them registered). Where they will not be
        (the caller found no room for them), the job ends after the chunks that went out."""
        if job.error is not None:
            # (a chunk that the caller's thread launched failed part way: what it enqueued
            # may still run, so it is waited for before anything is reported)
            self._drain_streams()
            job.launched = len(job.bounds) - 1
            return
        if job.late is not None:
            try:
                job.late.wait()
                reg = self.engine.registration
                if reg is not None:
                    reg.wait_until(self.engine.pool_base + int(job.shard_offsets.max())
                                   + job.mapped.part_hi)
            except Exception as e:  # noqa: BLE001 - reported through the future, after the head
                job.error = e
                job.launched = len(job.bounds) - 1
                return
        self._launch_chunks(job)

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
        # Blocking: the waiting thread sleeps until a chunk lands. A spinning wait kept each
        # lane's waiting thread at 0.95-1.0 of a core for the whole of every copy (2 x H100,
        # bench/host_scale.py: two cores per GPU doing nothing but wait).
        return self.free_events.pop() if self.free_events else cuda.event_create(False, True)

    def _launch(self, job: Job, inline: bool = False, chunks: int | None = None) -> bool:
        """Enqueue the job's copies (its first ``chunks`` chunks; None: all) and their
        events on the lane's stream; the caller holds ``launch_lock``. ``inline`` (the event
        loop's thread) must not block: it returns False, having done nothing, for a job that
        needs something that could (a pool piece still being registered, the kernel path's
        first compile, the pitched-copy check, a worker's event not complete yet)."""
        m = job.mapped
        eng = self.engine
        offs = job.shard_offsets
        if job.late is not None:
            if inline:
                offs = offs[:job.late.head]     # all the head reads; the rest is unwritten
            else:
                job.late.wait()
        top = max(offs.tolist()) if len(offs) <= SMALL_TABLE_OPS else int(offs.max())
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
        job.pinned = pinned
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
        if job.trace is not None:
            job.launch_ns = [time.monotonic_ns()]
        job.backend = backend
        if backend == "kernel":
            self._launch_kernel(job)
            self._mark(job, len(job.block_ids))
            job.launched = len(job.bounds) - 1
        else:
            self._launch_chunks(job, chunks, inline)
        return True

    def _launch_chunks(self, job: Job, chunks: int | None = None,
                       inline: bool = False) -> None:
        """Enqueue the next ``chunks`` (None: all remaining) chunks of a DMA job, an event
        after each: the GPU starts on the first chunk while this thread builds the next one's
        table, and the waiting thread can report each chunk as it lands. A failure after some
        chunks went out waits (on the host) for what was enqueued, then goes back through the
        waiting thread with the chunks that did land, so no slot is dropped or reused while a
        copy into it may still run. (Not on the event loop's thread, ``inline``: a failure in a
        first chunk leaves no chunk to report, and one after it (``_advance``) is waited out
        by the lane's thread, ``_continue``.)"""
        bounds = job.bounds
        last = len(bounds) - 1
        end = last if chunks is None else min(last, job.launched + chunks)
        while job.launched < end:
            lo, hi = bounds[job.launched], bounds[job.launched + 1]
            try:
                self._enqueue_dma(job, job.block_ids[lo:hi], job.shard_offsets[lo:hi])
                if job.launch_ns is not None and len(job.launch_ns) == 1:
                    job.launch_ns.append(time.monotonic_ns())
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

    def _mark(self, job: Job, end: int) -> None:
        """Record the event that says items [0, ``end``) of ``job`` have landed."""
        ev = self._event()
        cuda.event_record(ev, self.stream)
        job.marks.append((ev, end))
        if job.trace is not None:
            now = time.monotonic_ns()
            if len(job.marks) == 1:
                job.trace.append(now)
            if job.chunks_ns is None:
                job.chunks_ns = ([], [])
            job.chunks_ns[0].append(now)

    def _drain_streams(self) -> None:
        """Wait until nothing is in flight on this lane's streams (a failed launch)."""
        for st in [self.stream] + [s for s, _ in self.aux]:
            try:
                cuda.stream_synchronize(st)
            except Exception:  # noqa: BLE001 - the launch's own error is the one reported
                pass

    def _enqueue_dma(self, job: Job, blocks: np.ndarray, shards: np.ndarray) -> None:
        """One chunk's batched DMA: pitched runs where the registration has them, 1D copies
        for the rest."""
        m = job.mapped
        eng = self.engine
        reg = eng.registration
        split = reg is not None and len(reg.registered) > 1
        # (a daemon's pool, a slot size its pieces cut none of: none to look for)
        slots_split = split and not m.slots_inside_pieces
        if m.pitched_ok and eng.pitched:
            # Shards that straddle two registered pieces of the pool go as 1D chunks, split
            # at the boundary; every other one as pitched runs.
            cross = (split_items(shards + (m.part_lo - reg.phase), m.part_hi - m.part_lo,
                                 reg.piece_bytes) if slots_split and not m.inside_pieces(
                shards, reg.piece_bytes, reg.phase) else None)
            keep = slice(None) if cross is None else ~cross
            kind = (job.to_pool, bool(eng.pitched_3d))
            tmpl = m.pitched_ops.get(kind)
            if tmpl is None:
                tmpl = m.pitched_ops[kind] = PitchedOps(m.plan if kind[1] else m.plan_2d,
                                                        job.to_pool)
            job.backend = "dma2d"
            if cross is None and len(blocks) * len(tmpl.rows) <= SMALL_TABLE_OPS:
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
        if len(blocks) and len(blocks) * len(m.runs) <= SMALL_TABLE_OPS and (
                not slots_split or m.inside_pieces(shards, reg.piece_bytes, reg.phase)):
            table, count = small_table(m.runs, blocks.tolist(), shards.tolist(), eng.pool_base,
                                       *((reg.piece_bytes, reg.phase) if split else ()))
            if count == 1 and job.pinned:
                # One copy (blocks into slots that follow): cuMemcpyAsync's call costs half
                # the batch call's when the daemon meets the job cold (H200 host, 40 ms idle
                # after a 256 MiB write: ~85 against ~190 us, equal warm). Page-locked only:
                # from pageable memory it may copy before it returns.
                gpu, host, n = table
                cuda.memcpy_async(*((host, gpu) if job.to_pool else (gpu, host)), n, self.stream)
                return
            at = ctypes.addressof(table)
            dst, src = (at + 8 * count, at) if job.to_pool else (at, at + 8 * count)
            cuda.memcpy_batch_at(dst, src, at + 16 * count, count, self.stream)
        elif len(blocks):
            gpu, host, size = chunk_table(m.seg_dev, m.seg_stride, m.seg_bytes,
                                          m.seg_prefix, blocks, shards, eng.pool_base)
            if split:
                gpu, host, size = split_at_boundaries(gpu, host, size,
                                                      eng.pool_base + reg.phase,
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

    def _stage_items(self, job: Job) -> int:
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

    def _launch_kernel(self, job: Job) -> None:
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
        numa.pin_thread(self.engine.thread_cpus.get(self.gpu.ordinal), self.waiter.name)
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
    def _await_marks(job: Job) -> BaseException | None:
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
            if job.chunks_ns is not None:
                job.chunks_ns[1].append(time.monotonic_ns())
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


class Gpu:
    """One GPU's two lanes."""

    def __init__(self, engine: CudaCopyEngine, ordinal: int) -> None:
        self.ordinal = ordinal
        self.store = Lane(engine, self, to_pool=True)
        self.load = Lane(engine, self, to_pool=False)
