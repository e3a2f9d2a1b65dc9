"""Host transfer path: copies between KV tensors in host shared memory and the pool.

The path CI and CPU engines use; the CUDA engines implement the same ``CopyEngine`` interface.
A job is turned into two row-index vectors over the pool and the worker's region (over the
rank's pieces of each slot, ``segment_address_table``: whole segments, or the rows of its head
range in a slot that holds every head), each row one copy unit (the largest power-of-two-free unit that divides every offset and size of the job),
and moved with one vectorised gather/scatter pair per bounded batch of rows: no Python work per
block or per layer. Copies run on a per-registration thread (numpy's ``take``, fancy
assignment and ``copyto`` release the GIL), so the event loop never waits on a large job, and
each worker's jobs finish in the order they were sent. A small job (``INLINE_BYTES``, one
2 MiB block) whose registration has nothing queued is copied on the caller's thread instead:
its future is done when ``submit_*`` returns, and the server answers it in the same dispatch,
with no thread hand-off either way.

The pool's pages are mapped into the daemon in the background once it serves (``_populate``):
a first touch per page would otherwise slow the first copies into a fresh pool 3-4x.

Never imports torch: its import held the GIL for 0.2-3.4 s (the C extension's module init), and
run on a thread after the socket was bound it stalled a restarted daemon's event loop past its
clients' timeouts (issue 36); numpy does the same copies (``np.take`` with ``mode="clip"``
writes straight into its output, where the default mode buffers the whole result first, which
is why it once measured 2.8x slower than torch's ``index_select``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import posix_ipc

from kvpool.daemon.copy_engine import (CopyEngine, JobResult, LateOffsets, Mapped, Progress,
                                       chunk_bounds, segment_address_table)
from kvpool.daemon.peer import Peer, check_may_open
from kvpool.daemon.pool import Pool
from kvpool.shared.config import CHUNK_BLOCKS
from kvpool.shared.errors import Aborted, LayoutMismatch, ProtocolError, TooLarge, UnknownId
from kvpool.shared.layout import check_placement
from kvpool.shared.protocol import ENGINE_SHM_PREFIX, HostRegion, RegisterRequest

log = logging.getLogger(__name__)

# Rows gathered into one temporary before they are scattered: small enough to stay in cache,
# large enough that the two calls per batch cost little next to moving the bytes.
BATCH_BYTES = 4 << 20
# A job of at most this many bytes is copied on the caller's thread (the event loop) when its
# registration has nothing queued: one 2 MiB block costs about as much loop time as the two
# thread hand-offs it saves (bench/investigations/single_block.py).
INLINE_BYTES = 2 << 20
# Above this many runs of adjacent shards a job takes the gather/scatter path instead.
MAX_RUNS = 16
_SHM_NAME_MAX = 200
# Engine segments, named by ``SharedHostMemory``; "kvpool-kv-" is what clients from before the
# liveness lock used (still accepted: the same protocol version may send it).
_SHM_PREFIXES = (ENGINE_SHM_PREFIX, "kvpool-kv-")
_SHM_NAME = re.compile(r"/?((?:%s)[A-Za-z0-9_.-]{1,%d})"
                       % ("|".join(map(re.escape, _SHM_PREFIXES)), _SHM_NAME_MAX - 16))


class HostMapped(Mapped):
    def __init__(self, registration: RegisterRequest, maps: list[mmap.mmap],
                 views: list[np.ndarray]) -> None:
        self.registration = registration
        self.maps = maps
        self.views = views          # one uint8 array per region, exactly its registered bytes
        self.table = segment_address_table(registration)
        _, _, _, nbytes, slot = self.table
        # Where the rank's part starts in a slot when it is one contiguous run there (its
        # pieces back to back: TP=1, or a rank-sharded shard); None for a strided part.
        ends = np.cumsum(nbytes)
        self.contiguous_at: int | None = (
            int(slot[0]) if np.array_equal(slot[1:] - slot[0], ends[:-1]) else None)
        self.rows = _uniform_rows(registration.layout.slot_bytes, self.table)
        self.one_region = len(np.unique(self.table[0])) == 1
        self.shard_bytes = int(nbytes.sum())
        # unit -> (segment of each unit row of a block, its row within the segment): what
        # ``_unit_rows`` recomputed for every job.
        self.row_plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # One thread per registration keeps its jobs in submission order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-host-copy")
        # The job last handed to that thread: a small job may run inline only once it is done,
        # so inline jobs never overtake queued ones.
        self.last: Future[JobResult] | None = None

    def unit_rows(self, starts: np.ndarray, unit: int) -> np.ndarray:
        """``_unit_rows(starts, nbytes, unit)`` for every piece of the table, as numpy, with
        the per-registration part computed once per unit."""
        plan = self.row_plans.get(unit)
        if plan is None:
            reps = self.table[3] // unit
            seg = np.repeat(np.arange(len(reps)), reps)
            within = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
            plan = self.row_plans[unit] = (seg, within)
        seg, within = plan
        return ((starts // unit)[:, seg] + within).ravel()


class HostCopyEngine(CopyEngine):
    name = "host"

    def __init__(self, pool: Pool, threads: int = 2, inline_bytes: int = INLINE_BYTES,
                 chunk_blocks: int = CHUNK_BLOCKS, trace: bool = False) -> None:
        self._pool_u8 = pool.view()
        self._pool_rows: dict[int, np.ndarray] = {}
        self._pool_name = pool.name.lstrip("/")
        self._closed = False
        # A job is cut into ``threads`` parts run by this pool: each numpy call runs on one
        # thread and releases the GIL, so the parts copy at once.
        self._threads = threads
        self._fanout = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvpool-copy")
        # With ``trace`` (the daemon's trace setting), jobs carry monotonic ns stamps
        # (submitted, copy started, copy done, done) as ``Future.kvpool_trace``, as the CUDA
        # engine's do; 0 ``inline_bytes`` sends every job to the registration's thread.
        self.trace = trace
        self.inline_bytes = inline_bytes
        self.chunk_blocks = chunk_blocks

    def start(self) -> None:
        threading.Thread(target=_populate, args=(self._pool_u8, lambda: self._closed),
                         name="kvpool-pool-populate", daemon=True).start()

    def attach(self, registration: RegisterRequest, peer: Peer | None = None) -> HostMapped:
        regions = registration.regions
        if not all(isinstance(r, HostRegion) for r in regions):
            raise ProtocolError("the host copy engine takes HostRegion registrations only")
        names = [check_shm_name(r.shm_name, self._pool_name) for r in regions]
        check_placement(registration.layout, registration.placement,
                        [r.nbytes for r in regions], registration.num_blocks)
        maps: list[mmap.mmap] = []
        views: list[np.ndarray] = []
        try:
            for r, name in zip(regions, names):
                try:
                    shm = posix_ipc.SharedMemory("/" + name, 0)
                except posix_ipc.ExistentialError:
                    raise UnknownId(f"shared memory {name!r} does not exist") from None
                except posix_ipc.PermissionsError:
                    raise UnknownId(f"shared memory {name!r} is not readable by kvpoold "
                                    f"(check owner and mode)") from None
                try:
                    st = os.fstat(shm.fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise ProtocolError(f"shared memory {name!r} is not a regular object")
                    check_may_open(st, peer, f"shared memory {name!r}")
                    if r.nbytes < 0 or r.offset_bytes < 0 or r.offset_bytes + r.nbytes > st.st_size:
                        raise LayoutMismatch(f"region {name!r} [{r.offset_bytes}, "
                                             f"+{r.nbytes}) exceeds its {st.st_size} bytes")
                    _back(shm.fd, st, r.offset_bytes, r.nbytes, name)
                    m = mmap.mmap(shm.fd, st.st_size)
                finally:
                    shm.close_fd()
                maps.append(m)
                views.append(np.frombuffer(m, np.uint8, r.nbytes, r.offset_bytes))
        except BaseException:
            del views
            for m in maps:
                m.close()
            raise
        return HostMapped(registration, maps, views)

    def detach(self, mapped: Mapped) -> None:
        assert isinstance(mapped, HostMapped)
        mapped.executor.shutdown(wait=True)
        mapped.views.clear()
        for m in mapped.maps:
            try:
                m.close()
            except BufferError:   # a view escaped; the mapping goes with the process
                log.warning("host region still referenced at detach")

    def submit_store(self, mapped: Mapped, block_ids: np.ndarray, shard_offsets: np.ndarray,
                     wait_event: bytes = b"", progress: Progress | None = None,
                     late: LateOffsets | None = None) -> Future[JobResult]:
        return self._submit(mapped, block_ids, shard_offsets, to_pool=True, progress=progress,
                            late=late)

    def store_head(self, n: int) -> int:
        # The first chunk: its copy on the registration's thread runs beside the event loop
        # finding room for the rest (a store) or the rest's slots (a load).
        return self.chunk_blocks if 0 < self.chunk_blocks < n else 0

    def submit_load(self, mapped: Mapped, shard_offsets: np.ndarray, block_ids: np.ndarray,
                    late: LateOffsets | None = None) -> Future[JobResult]:
        return self._submit(mapped, block_ids, shard_offsets, to_pool=False, late=late)

    def load_head(self, n: int) -> int:
        return self.store_head(n)

    def close(self) -> None:
        self._closed = True
        self._fanout.shutdown(wait=False)

    def _parallel(self, parts: list, fan_out: bool = True) -> None:
        """Run the copy thunks in ``parts`` on the fan-out pool and wait for all of them (one
        after the other on this thread without ``fan_out``: an inline job never waits on
        other threads)."""
        if len(parts) == 1 or not fan_out:
            for part in parts:
                part()
            return
        for f in [self._fanout.submit(part) for part in parts]:
            f.result()

    # ---- internals -------------------------------------------------------------------------

    def _submit(self, mapped: Mapped, block_ids: np.ndarray, shard_offsets: np.ndarray,
                to_pool: bool, progress: Progress | None = None,
                late: LateOffsets | None = None) -> Future[JobResult]:
        assert isinstance(mapped, HostMapped)
        if self._closed:
            f: Future[JobResult] = Future()
            f.set_exception(Aborted("daemon is shutting down"))
            return f
        stamps = [time.monotonic_ns()] if self.trace else None
        if (late is None and len(block_ids) * mapped.shard_bytes <= self.inline_bytes
                and (mapped.last is None or mapped.last.done())):
            return self._inline(stamps, mapped, block_ids, shard_offsets, to_pool)
        if stamps is None:
            fut = mapped.executor.submit(self._copy_job, mapped, block_ids, shard_offsets,
                                         to_pool, progress, True, late)
        else:
            fut = mapped.executor.submit(self._traced, stamps, mapped, block_ids, shard_offsets,
                                         to_pool, progress, True, late)
            fut.kvpool_trace = stamps  # type: ignore[attr-defined]
        mapped.last = fut
        return fut

    def _inline(self, stamps: list[int] | None, mapped: HostMapped, block_ids: np.ndarray,
                shard_offsets: np.ndarray, to_pool: bool) -> Future[JobResult]:
        """A small job copied now, on the caller's thread; returns its future, done."""
        fut: Future[JobResult] = Future()
        try:
            if stamps is None:
                fut.set_result(self._copy(mapped, block_ids, shard_offsets, to_pool, False))
            else:
                fut.kvpool_trace = stamps  # type: ignore[attr-defined]
                fut.set_result(self._traced(stamps, mapped, block_ids, shard_offsets, to_pool,
                                            None, False))
        except Exception as e:  # noqa: BLE001 - as the thread path: failures go in the future
            fut.set_exception(e)
        return fut

    def _traced(self, stamps: list[int], *args) -> JobResult:
        stamps.append(time.monotonic_ns())
        try:
            return self._copy_job(*args)
        finally:
            stamps.append(time.monotonic_ns())
            stamps.append(stamps[-1])

    def _copy_job(self, mapped: HostMapped, block_ids: np.ndarray, shard_offsets: np.ndarray,
                  to_pool: bool, progress: Progress | None = None,
                  fan_out: bool = True, late: LateOffsets | None = None) -> JobResult:
        """A job, in chunks when a store wants to hear of them (``progress``): each chunk's
        slots can then be committed on the loop while this thread copies the next one. Items
        past ``late.head`` are copied once the caller has written their offsets."""
        # (No small tail chunk, ``TAIL_BLOCKS``, here: each chunk's fixed cost is paid on the
        # copying thread, in line with the copy, where it would cost more than it saves.)
        n = len(block_ids)
        if progress is not None:
            bounds = chunk_bounds(n, self.chunk_blocks)
        else:   # (nobody to tell of chunks) in one piece, or the head then the rest
            bounds = [0, late.head, n] if late is not None and 0 < late.head < n else [0, n]
        total = 0
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if late is not None and hi > late.head:
                late.wait()
                late = None
            total += self._copy(mapped, block_ids[lo:hi], shard_offsets[lo:hi], to_pool,
                                fan_out).nbytes
            if progress is not None and hi < len(block_ids):
                progress(hi)
        return JobResult(total)

    def _copy(self, mapped: HostMapped, block_ids: np.ndarray, shard_offsets: np.ndarray,
              to_pool: bool, fan_out: bool = True) -> JobResult:
        region, offset, stride, nbytes, prefix = mapped.table
        # The pairs can be copied in any order: in pool order, slots that sit together in memory
        # (whatever order eviction handed them out in) form runs for the one-pass path.
        if len(shard_offsets) > 1:
            order = np.argsort(shard_offsets, kind="stable")
            block_ids, shard_offsets = block_ids[order], shard_offsets[order]
        # [blocks, segments] byte offsets on both sides and the unit that divides all of them.
        src = offset[None, :] + block_ids[:, None] * stride[None, :]
        dst = shard_offsets[:, None] + prefix[None, :]
        unit = int(np.gcd.reduce(np.concatenate([nbytes, src.ravel(), dst.ravel()])))
        unit = unit & -unit if unit else 1   # largest power of two dividing everything
        unit = min(unit, 1 << 20)
        total = int(nbytes.sum()) * len(block_ids)
        if self._copy_runs(mapped, src, shard_offsets, unit, to_pool, fan_out):
            return JobResult(total)
        if self._copy_rows(mapped, src, shard_offsets, to_pool, fan_out):
            return JobResult(total)
        for r in np.unique(region):
            cols = np.flatnonzero(region == r)
            rows_w = _unit_rows(src[:, cols], nbytes[cols], unit)
            rows_p = _unit_rows(dst[:, cols], nbytes[cols], unit)
            worker = _rows(mapped.views[int(r)], unit)
            pool = _rows(self._pool_u8, unit)
            _check_rows(rows_w, len(worker))
            _check_rows(rows_p, len(pool))
            if not to_pool:
                worker, rows_w, pool, rows_p = pool, rows_p, worker, rows_w
            k = min(self._threads, max(1, len(rows_w) * unit // BATCH_BYTES))
            cuts = np.linspace(0, len(rows_w), k + 1).astype(np.int64)
            self._parallel([
                lambda a=a, b=b: _gather_scatter(worker, rows_w[a:b], pool, rows_p[a:b], unit)
                for a, b in zip(cuts[:-1], cuts[1:])], fan_out)
        return JobResult(total)

    def _copy_runs(self, mapped: HostMapped, src: np.ndarray, shard_offsets: np.ndarray,
                   unit: int, to_pool: bool, fan_out: bool = True) -> bool:
        """One pass when the pool side is a few contiguous runs of parts; False otherwise.

        Slots of one size are handed out in address order and LRU eviction frees them in
        roughly that order, so a job's slots are usually a handful of runs; then each run is
        one gather straight into the pool (store) or one scatter straight from it (load), and
        no bytes go through a temporary. Needs one region, a rank's part that is contiguous in
        the slot, and parts that touch from slot to slot (TP=1 with page-sized blocks).
        """
        shard = mapped.shard_bytes
        if not mapped.one_region or shard % unit or mapped.contiguous_at is None:
            return False
        shard_offsets = shard_offsets + mapped.contiguous_at   # a multiple of unit (see _copy)
        n = len(shard_offsets)
        breaks = (np.flatnonzero(np.diff(shard_offsets) != shard) + 1).tolist() if n > 1 else []
        if len(breaks) >= MAX_RUNS:
            return False
        rows_w = mapped.unit_rows(src, unit)
        view = mapped.views[int(mapped.table[0][0])]
        rows_per_shard = shard // unit
        parts = []
        # A gather straight into the pool run (store) or a scatter straight from it (load).
        worker, pool = _rows(view, unit), self._pool_array(unit)
        _check_rows(rows_w, len(worker))
        bounds = [0, *breaks, n]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            # Cut long runs so every fan-out thread gets a share.
            step = max(1, -(-(hi - lo) // self._threads))
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                first = int(shard_offsets[a]) // unit
                pool_run = pool[first:first + (b - a) * rows_per_shard]
                idx = rows_w[a * rows_per_shard:b * rows_per_shard]
                if to_pool:
                    parts.append(lambda i=idx, o=pool_run: _take(worker, i, o))
                else:
                    parts.append(lambda i=idx, o=pool_run: worker.__setitem__(i, o))
        self._parallel(parts, fan_out)
        return True

    def _pool_array(self, unit: int) -> np.ndarray:
        rows = self._pool_rows.get(unit)
        if rows is None:
            rows = self._pool_rows[unit] = _rows(self._pool_u8, unit)
        return rows

    def _copy_rows(self, mapped: HostMapped, src: np.ndarray, shard_offsets: np.ndarray,
                   to_pool: bool, fan_out: bool = True) -> bool:
        """A rank's head range (``HostMapped.rows``) without building a pool row index: over a
        run of adjacent slots its rows are one strided view of the pool, filled by one gather
        straight from the worker's rows (store), or scattered into them through a cache-sized
        temporary (a scatter from a strided source is slower than from a contiguous one); False
        when the job's slots form too many runs."""
        if mapped.rows is None:
            return False
        first, nrows, pitch, width, run = mapped.rows
        breaks = np.flatnonzero(np.diff(shard_offsets) != nrows * pitch) + 1
        if len(breaks) >= MAX_RUNS:
            return False
        region = int(mapped.table[0][0])
        worker = _rows(mapped.views[region], width)
        word = worker.itemsize
        if (self._pool_u8.ctypes.data + first) % word or pitch % word:
            return False
        pool = self._pool_u8[:len(self._pool_u8) // word * word].view(worker.dtype)
        idx = (src // width).ravel()                      # worker rows, slot by slot, in order
        wide = _rows(mapped.views[region], run * width)   # worker runs, for loads
        runs = (src[:, ::run] // (run * width)).ravel()
        _check_rows(idx, len(worker))
        parts = []
        for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(shard_offsets)]):
            step = max(1, -(-(hi - lo) // self._threads))
            for a in range(int(lo), int(hi), step):
                b = min(int(hi), a + step)
                at = (int(shard_offsets[a]) + first) // word
                view = np.lib.stride_tricks.as_strided(
                    pool[at:], ((b - a) * nrows, width // word), (pitch, word))
                if to_pool:
                    i = idx[a * nrows:b * nrows]
                    parts.append(lambda i=i, o=view: _gather_strided(worker, i, o))
                else:
                    i = runs[a * nrows // run:b * nrows // run]
                    parts.append(lambda i=i, v=view: _scatter_strided(wide, i, v, run))
        self._parallel(parts, fan_out)
        return True


# Linux 5.14+: fault a range in now, writable (the kernel's batch path, no copy).
_MADV_POPULATE_WRITE = 23
# Each call holds the process's mmap lock for reading; any thread that maps memory meanwhile
# (Python's allocator, libzmq) waits for the call to end, and so do the page faults queued
# behind it, the event loop's among them. 64 MiB calls (~0.2 s each on a loaded 2-core host)
# made pings take 70-600 ms while a 5.7 GiB pool was populated; 2 MiB calls take milliseconds.
_POPULATE_CHUNK = 2 << 20
# After each call the thread rests as long as the call took: at most half a core, taken from
# nobody for long. It keeps its priority: at nice 19 a loaded 2-core host left it off the CPU
# for 100+ ms in the middle of a call, holding the mmap lock, and the event loop waited that
# long behind it (156 ms in tests/integration/test_event_loop.py beside other tests).
_POPULATE_DUTY = 0.5
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):
    _madvise = None


def _populate(u8: np.ndarray, stop: Callable[[], bool]) -> None:
    """Map every page of the pool into this process now, in the background.

    ``Pool`` reserves the pages at start, but the first touch of each one in our mapping
    still faults and clears it: a copy into a fresh pool ran at 1.5 GB/s against 5.8 GB/s
    once mapped (1 GiB, one thread, 2-core host), and the disk tier's O_DIRECT writes fault
    the same pages in. ``MADV_POPULATE_WRITE`` does it in 0.37 s per GiB of one core, in
    2 MiB steps (ctypes drops the GIL for each), stopping at close. A pure speed-up: where
    the kernel lacks it, pages fault in on first use as before. (A CUDA pool is pinned by
    ``cudaHostRegister`` at start; this then finds every page mapped already.) Calls short
    enough that the event loop never waits long for one, a rest after each."""
    if _madvise is None or not len(u8):
        return
    t0 = time.monotonic()
    base, n = u8.ctypes.data, len(u8)
    start = base - base % mmap.PAGESIZE
    for at in range(start, base + n, _POPULATE_CHUNK):
        if stop():
            return
        t_call = time.monotonic()
        if _madvise(at, min(_POPULATE_CHUNK, base + n - at), _MADV_POPULATE_WRITE) != 0:
            log.debug("pool pages not mapped ahead: %s", os.strerror(ctypes.get_errno()))
            return
        time.sleep((time.monotonic() - t_call) * _POPULATE_DUTY / (1 - _POPULATE_DUTY))
    log.debug("pool pages mapped in %.2f s", time.monotonic() - t0)


def check_shm_name(name: str, pool_name: str) -> str:
    """The bare name of an engine KV segment, or ``ProtocolError``.

    The daemon opens shared memory on a client's behalf only for engine KV segments, named
    ``kvpool-engine-*`` (``SharedHostMemory``; ``kvpool-kv-*`` from older clients), never its own pool: no crafted name (``../``
    paths, NUL bytes, which crash the shm library, another tenant's or daemon's segment)
    makes it open anything else."""
    m = _SHM_NAME.fullmatch(name)
    if m is None or m.group(1) == pool_name:
        raise ProtocolError(f"shared memory name {name[:80]!r} refused: a host region must be an "
                            f"engine KV segment named {ENGINE_SHM_PREFIX}<letters, digits, _ . ->, at "
                            f"most {_SHM_NAME_MAX} characters")
    return m.group(1)


def _back(fd: int, st: os.stat_result, offset: int, nbytes: int, name: str) -> None:
    """Make sure /dev/shm pages back the region: copying into a page tmpfs cannot provide is a
    SIGBUS that kills the daemon. Engines' segments are fully backed (``SharedHostMemory``
    reserves them); a sparse one is reserved here, once, or refused if /dev/shm is full."""
    if st.st_blocks * 512 >= st.st_size or not nbytes:
        return
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        raise TooLarge(f"shared memory {name!r} is sparse and /dev/shm cannot back its "
                       f"{nbytes} bytes: {e.strerror}") from None


def _uniform_rows(slot_bytes: int, table: tuple[np.ndarray, ...]
                  ) -> tuple[int, int, int, int, int] | None:
    """(first byte, rows, pitch, row bytes, rows per worker run) when a rank's part of a slot
    is rows of one width at one pitch that continue from slot to slot (a head range of a
    head-split layout whose slot is exactly its rows: ``_copy_rows``), in one region, each row
    a whole row of the worker's memory at that width; else None. A worker run is the rows that
    sit back to back in the worker's memory (a segment's tokens), as wide rows of their own."""
    region, offset, stride, nbytes, slot = table
    if len(slot) < 2 or len(np.unique(region)) != 1 or (nbytes != nbytes[0]).any():
        return None
    width, pitch = int(nbytes[0]), int(slot[1] - slot[0])
    if (pitch <= width or (np.diff(slot) != pitch).any() or slot_bytes != len(slot) * pitch
            or (offset % width).any() or (stride % width).any()):
        return None
    run = 1
    while run < len(slot) and offset[run] == offset[0] + run * width and stride[run] == stride[0]:
        run += 1
    if len(slot) % run:
        run = 1
    o, st = offset.reshape(-1, run), stride.reshape(-1, run)
    if not ((o - o[:, :1] == np.arange(run) * width).all() and (st == st[:, :1]).all()
            and not (o[:, 0] % (run * width)).any() and not (stride % (run * width)).any()):
        run = 1
    return int(slot[0]), len(slot), pitch, width, run


def _unit_rows(starts: np.ndarray, seg_bytes: np.ndarray, unit: int) -> np.ndarray:
    """Row index (in ``unit``-sized rows) of every unit of every [block, segment] whose byte
    offsets are ``starts``, block by block, segment by segment: all vectorised."""
    reps = np.tile(seg_bytes // unit, len(starts))
    within = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
    return np.repeat((starts // unit).ravel(), reps) + within


def _rows(u8: np.ndarray, unit: int) -> np.ndarray:
    """``u8`` as a [n, unit] array (int64 elements when the unit allows: wider is faster)."""
    n = len(u8) // unit
    a = u8[: n * unit]
    if unit % 8 == 0 and u8.ctypes.data % 8 == 0:
        return a.view(np.int64).reshape(n, unit // 8)
    return a.reshape(n, unit)


def _check_rows(rows: np.ndarray, n: int) -> None:
    """Row indices inside [0, n): ``_take``'s clip mode would silently clamp any other (the
    engine's callers check blocks and slots; this guards the arithmetic between)."""
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise AssertionError(f"copy row index out of range [0, {n})")


def _take(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[rows]`` for a C-contiguous ``out``, written in place with the GIL released
    (``mode="clip"``: the default mode buffers the whole result and copies it again)."""
    np.take(src, rows, axis=0, out=out, mode="clip")


def _gather_strided(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[rows]`` for a strided ``out`` (``np.take`` would buffer all of it),
    through a cache-sized contiguous temporary."""
    batch = max(1, BATCH_BYTES // (src.shape[1] * src.itemsize))
    tmp = np.empty((min(batch, len(rows)), src.shape[1]), dtype=src.dtype)
    for i in range(0, len(rows), batch):
        t = tmp[:min(batch, len(rows) - i)]
        _take(src, rows[i:i + batch], t)
        np.copyto(out[i:i + len(t)], t)


def _scatter_strided(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray,
                     run: int) -> None:
    """``dst[dst_rows] = src`` for a strided ``src`` whose rows go ``run`` at a time into one
    (``run`` times wider) row of ``dst``, through a cache-sized contiguous temporary."""
    batch = max(1, BATCH_BYTES // (run * src.shape[1] * src.itemsize)) * run
    tmp = np.empty((min(batch, len(src)), src.shape[1]), dtype=src.dtype)
    for i in range(0, len(src), batch):
        t = tmp[:min(batch, len(src) - i)]
        np.copyto(t, src[i:i + batch])
        dst[dst_rows[i // run:(i + len(t)) // run]] = t.reshape(-1, dst.shape[1])


def _gather_scatter(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray,
                    dst_rows: np.ndarray, unit: int) -> None:
    batch = max(1, BATCH_BYTES // unit)
    tmp = np.empty((min(batch, len(src_rows)), src.shape[1]), dtype=src.dtype)
    for i in range(0, len(src_rows), batch):
        s, d = src_rows[i:i + batch], dst_rows[i:i + batch]
        t = tmp[: len(s)]
        _take(src, s, t)
        dst[d] = t
