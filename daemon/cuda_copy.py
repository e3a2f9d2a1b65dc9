"""The CUDA copy engine: moves KV blocks between workers' GPU memory (CUDA IPC) and the pool.

Owns the pool's host registration (``cuda.HostRegistration``, started at construction,
background), each registration's IPC mappings, reference-counted by handle, and per GPU a store
lane and a load lane (``cuda_lane``: the streams and the threads that launch and wait). The
address tables they send come from ``copy_plan``.

Per job (per chunk of a big job, see ``cuda_lane``), exactly one batched operation runs on the
lane's stream, chosen per job:

- ``dma``: one ``cuMemcpyBatchAsync`` over the job's chunk table: copy engines only, no SMs, so
  the model runs at full speed beside it. Best for large chunks (block-outermost layouts).
- ``kernel``: one launch of a Triton gather/scatter kernel on at most ``max_ctas`` CTAs that
  reads or writes the registered pool over UVA. Best for many small chunks (per-layer layouts),
  where the DMA engines' per-copy cost dominates.

Pitched copies (``copy_plan``: one operation per strided run) are trusted only once a round
trip has been checked, once per engine (``cuda.check_memcpy_2d_batch``).

Must never: block the event loop (``submit_*`` only enqueue; completion resolves a
``concurrent.futures.Future`` from the waiting thread) or unmap a worker's memory while a copy
that touches it is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Literal

import numpy as np

from kvpool.daemon import cuda
from kvpool.daemon.copy_engine import (HEAD_BLOCKS, TAIL_BLOCKS, CopyEngine, JobResult,
                                       LateOffsets, Mapped, Progress, chunk_bounds, part_span,
                                       segment_address_table)
from kvpool.daemon.copy_plan import (SMALL_OPS, SMALL_TABLE_OPS, PitchedOps, block_runs,
                                     chunk_table, flatten_plan, pitched_plan,
                                     registration_pieces, slots_inside_pieces, strided_runs)
from kvpool.daemon.cuda_lane import Gpu, Job
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
        self.slots_inside_pieces = False    # set by the engine (``attach``)
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

    def inside_pieces(self, shard_offsets: np.ndarray, piece: int, phase: int = 0) -> bool:
        """Whether no slot of a small job (a few items: in Python) spans two separately
        registered pieces of the pool (meeting at ``phase`` plus multiples of ``piece``); a big
        job says False (``split_items`` then decides)."""
        if len(shard_offsets) > SMALL_TABLE_OPS:
            return False
        lo, hi = self.part_lo - phase, self.part_hi - 1 - phase
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
                 register_piece_bytes: int = cuda.PIECE_BYTES, kernel_words: int = 4096,
                 kernel_warps: int = 16, dma_2d: bool | None = None,
                 dma_2d_batch_ops: int = 256, inline_max_ops: int = SMALL_OPS,
                 chunk_blocks: int = CHUNK_BLOCKS, trace: bool = False,
                 thread_cpus: dict[int, frozenset[int]] | None = None) -> None:
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
        # per GPU ordinal: the CPUs its lanes' threads run on (its NUMA node, daemon/numa.py)
        self.thread_cpus = thread_cpus or {}
        self._pitched_lock = threading.Lock()
        self.registration: cuda.HostRegistration | None = None
        self.kernel_broken = False
        self._gpus: dict[int, Gpu] = {}
        self._ipc: dict[bytes, list[int]] = {}   # handle -> [devptr, refs]
        self._lock = threading.Lock()
        self._closed = False
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        # (piece, extent) bytes of a daemon's pool, whose pieces meet at its extents' starts
        self.piece_grid: tuple[int, int] | None = None
        if register_pool:
            # A daemon's pool (one with a geometry) is registered in pieces that meet at its
            # extents' starts, so that no slot of most sizes spans two; a bare buffer from its
            # base.
            geometry = getattr(pool, "geometry", None)
            piece, phase = register_piece_bytes, 0
            if geometry is not None:
                piece, phase = registration_pieces(geometry.data_offset, geometry.extent_bytes,
                                                   register_piece_bytes)
                self.piece_grid = (piece, geometry.extent_bytes)
            self.registration = cuda.HostRegistration(self.pool_base, self.pool_nbytes, piece,
                                                      phase)
        threading.Thread(target=self._init, name="kvpool-cuda-init", daemon=True).start()

    def _init(self) -> None:
        try:
            cuda.driver()
            self._retain_contexts()
            if self.registration is not None:
                self.registration.start(0)
        except BaseException as e:  # noqa: BLE001 - reported on first use
            self._init_error = e
        finally:
            self._ready.set()

    @staticmethod
    def _retain_contexts() -> None:
        """Make every GPU's primary context now, on this thread: made by a worker's first
        registration instead, on the event loop, one took 259 ms there (GPU 1 of 2 x H100)."""
        try:
            for ordinal in range(cuda.device_count()):
                cuda.use_device(ordinal)
        except Exception as e:  # noqa: BLE001 - the first use makes it instead
            log.debug("kvpool: GPU contexts not made ahead: %s", e)

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

    def _gpu(self, ordinal: int) -> Gpu:
        with self._lock:
            g = self._gpus.get(ordinal)
            if g is None:
                g = self._gpus[ordinal] = Gpu(self, ordinal)
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
        m = CudaMapped(registration, ordinal, opened, bases)
        # No slot of this registration spans two registered pieces: its chunks need no look
        # for one (a few numpy calls a chunk, on a lane's thread that shares the event loop's
        # GIL).
        m.slots_inside_pieces = self.piece_grid is not None and slots_inside_pieces(
            *self.piece_grid, registration.layout.slot_bytes)
        return m

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
                     wait_event: bytes = b"", progress: Progress | None = None,
                     late: LateOffsets | None = None) -> Future[JobResult]:
        return self._submit(mapped, True, block_ids, shard_offsets, wait_event, progress, late)

    def store_head(self, n: int) -> int:
        # The first chunk, launched on the caller's thread (``cuda_lane``): its offsets are
        # all a big store needs to start copying; the next chunk's go out on that thread too
        # (``LateOffsets.step``), before the loop finds room for the rest.
        return self._first_chunk(n, TAIL_BLOCKS)

    def submit_load(self, mapped: Mapped, shard_offsets: np.ndarray, block_ids: np.ndarray,
                    late: LateOffsets | None = None) -> Future[JobResult]:
        return self._submit(mapped, False, block_ids, shard_offsets, b"", late=late)

    def load_head(self, n: int) -> int:
        # The first chunk, launched on the caller's thread: what the loop does after it (the
        # rest's slots, the pins: ~0.4 ms for 1024 blocks) is shorter than its copy (~1.2 ms).
        return self._first_chunk(n, 0)

    def _first_chunk(self, n: int, tail: int) -> int:
        """Items in the first of the chunks a lane cuts an ``n``-item job into (``tail``: its
        last chunk's bound, ``Lane.submit``); 0 where it goes in one piece or not inline."""
        if not (self.inline_first_chunk and 0 < self.chunk_blocks < n):
            return 0
        bounds = chunk_bounds(n, self.chunk_blocks, tail, HEAD_BLOCKS)
        return bounds[1] if len(bounds) > 2 else 0

    def _submit(self, mapped: Mapped, to_pool: bool, block_ids: np.ndarray,
                shard_offsets: np.ndarray, wait_event: bytes,
                progress: Progress | None = None,
                late: LateOffsets | None = None) -> Future[JobResult]:
        assert isinstance(mapped, CudaMapped)
        fut: Future[JobResult] = Future()
        if self._closed:
            fut.set_exception(Aborted("the daemon is shutting down"))
            return fut
        blocks = np.ascontiguousarray(block_ids, dtype=np.int64)
        shards = np.ascontiguousarray(shard_offsets, dtype=np.int64)
        if late is not None and shards is not late.offsets:
            fut.set_exception(OutOfRange("late offsets need the caller's own int64 array"))
            return fut
        if blocks.shape != shards.shape or blocks.ndim != 1:
            fut.set_exception(OutOfRange("block ids and slots differ in number"))
            return fut
        try:
            mapped.job_started()
        except KvpoolError as e:
            fut.set_exception(e)
            return fut
        nbytes = len(blocks) * mapped.registration.layout.shard_bytes
        job = Job(mapped, to_pool, blocks, shards, wait_event, fut, nbytes, progress=progress,
                  late=late)
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

    def _finish(self, job: Job, err: BaseException | None) -> None:
        m = job.mapped
        if job.trace is not None:
            job.future.kvpool_trace = job.trace  # type: ignore[attr-defined]
            job.future.kvpool_chunks = job.chunks_ns  # type: ignore[attr-defined]
            job.future.kvpool_launch = job.launch_ns  # type: ignore[attr-defined]
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
