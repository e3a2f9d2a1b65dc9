"""Copy plans for the CUDA engine: the address tables of a job's copies between GPU blocks and
pool slots, built with numpy (tested on CPU).

Tables are built over (items x segments) at once; nothing in Python runs per block or per layer,
except for chunks of at most ``SMALL_TABLE_OPS`` copies, whose tables are a few Python additions
to per-registration templates (``block_runs``, ``PitchedOps``): numpy's fixed cost per call,
~25-40 us a table, was most of a single block's launch, and several times that when the daemon
meets a job with its caches evicted by the copy before.

Where a registration's segments form strided runs (per-layer layouts: every layer's K and V of a
block sit one fixed pitch apart on the GPU and back to back in the shard), the ``dma`` path
(``cuda_copy``) sends one pitched 2D operation per (block, run) through ``cuMemcpy3DBatchAsync``
rather than one copy per chunk: the driver's CPU cost is per operation, and at 64 chunks per
block it was what bounded per-layer throughput.

The pool may be registered in separate pieces (``cuda.HostRegistration``); no DMA copy may span
two, so tables are cut at their boundaries (``split_at_boundaries``, ``split_items``). A
daemon's pool is registered in pieces that meet at its extents' starts
(``registration_pieces``): for most slot sizes none spans two (``slots_inside_pieces``), and
only copies merged across slots are cut.

Must never: call the CUDA driver (``cuda.pitched_ops`` only fills records): every table here is
checked on CPU (tests/daemon/test_copy_plan.py).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvpool.daemon import cuda
from kvpool.daemon.cuda import BATCH3D_OP_DTYPE


def chunk_table(seg_dev: np.ndarray, seg_stride: np.ndarray, seg_bytes: np.ndarray,
                seg_prefix: np.ndarray, block_ids: np.ndarray, shard_offsets: np.ndarray,
                pool_base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gpu address, pool address, nbytes) of every chunk of a job, as uint64 arrays, with runs
    that are contiguous on *both* sides merged into one copy.

    Item ``i`` pairs GPU block ``block_ids[i]`` with the shard at pool byte offset
    ``shard_offsets[i]``; segment ``s`` of it lives at ``seg_dev[s] + block * seg_stride[s]`` on
    the GPU and at ``shard_offset + seg_prefix[s]`` in the shard.
    """
    blocks = np.asarray(block_ids, dtype=np.int64)
    shards = np.asarray(shard_offsets, dtype=np.int64)
    gpu = (seg_dev[None, :] + blocks[:, None] * seg_stride[None, :]).ravel()
    host = (pool_base + shards[:, None] + seg_prefix[None, :]).ravel()
    size = np.broadcast_to(seg_bytes[None, :], (len(blocks), len(seg_bytes))).ravel()
    return merge_runs(gpu, host, size)


def merge_runs(gpu: np.ndarray, host: np.ndarray, size: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each chunk into its predecessor where both sides continue it exactly."""
    if len(size) == 0:
        e = np.zeros(0, dtype=np.uint64)
        return e, e, e
    cont = np.empty(len(size), dtype=bool)
    cont[0] = False
    np.logical_and(gpu[:-1] + size[:-1] == gpu[1:], host[:-1] + size[:-1] == host[1:],
                   out=cont[1:])
    starts = np.flatnonzero(~cont)
    merged = np.add.reduceat(size, starts)
    return (gpu[starts].astype(np.uint64), host[starts].astype(np.uint64),
            merged.astype(np.uint64))


def split_at_boundaries(gpu: np.ndarray, host: np.ndarray, size: np.ndarray, base: int,
                        piece: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut chunks whose pool range crosses a multiple of ``piece`` from ``base``, so no DMA copy
    spans two separately registered pieces of the pool. Chunks may span several pieces."""
    if len(size) == 0:
        return gpu, host, size
    h = host.astype(np.int64) - base
    s = size.astype(np.int64)
    first = h // piece
    last = (h + s - 1) // piece
    n = (last - first + 1)
    if (n == 1).all():
        return gpu, host, size
    idx = np.repeat(np.arange(len(s)), n)
    # k-th sub-chunk of each chunk: k = position within its run of repeats
    k = np.arange(len(idx)) - np.repeat(np.cumsum(n) - n, n)
    piece_no = first[idx] + k
    lo = np.maximum(h[idx], piece_no * piece)
    hi = np.minimum(h[idx] + s[idx], (piece_no + 1) * piece)
    g = gpu.astype(np.int64)[idx] + (lo - h[idx])
    return (g.astype(np.uint64), (lo + base).astype(np.uint64), (hi - lo).astype(np.uint64))


def strided_runs(region: np.ndarray, seg_dev: np.ndarray, seg_stride: np.ndarray,
                 seg_bytes: np.ndarray, seg_prefix: np.ndarray | None = None,
                 max_pitch: int = (1 << 31) - 1) -> np.ndarray:
    """Cut pieces (in slot order) into runs a pitched copy can move at once: same region,
    block stride and size, GPU addresses one constant pitch apart and pool offsets another
    (each >= the size, so rows never overlap). ``seg_prefix`` None: pieces back to back in the
    slot. Returns each run's first piece index plus a final ``len(seg_dev)``."""
    if seg_prefix is None:
        seg_prefix = np.zeros_like(seg_bytes)
        np.cumsum(seg_bytes[:-1], out=seg_prefix[1:])
    starts = [0]
    pitch = hpitch = 0
    for s in range(1, len(seg_dev)):
        d = int(seg_dev[s] - seg_dev[s - 1])
        h = int(seg_prefix[s] - seg_prefix[s - 1])
        same = (region[s] == region[s - 1] and seg_stride[s] == seg_stride[s - 1]
                and seg_bytes[s] == seg_bytes[s - 1] and seg_bytes[s] <= d <= max_pitch
                and seg_bytes[s] <= h <= max_pitch)
        if same and (s - starts[-1] == 1 or (d == pitch and h == hpitch)):
            pitch, hpitch = d, h
            continue
        starts.append(s)
        pitch = hpitch = 0
    return np.asarray(starts + [len(seg_dev)], dtype=np.int64)


# Columns of a pitched plan (``pitched_plan``): one row per copy of one block.
(P_GPU, P_STRIDE, P_GPITCH, P_GLAYER, P_HOST, P_HPITCH, P_HLAYER, P_WIDTH, P_HEIGHT,
 P_DEPTH) = range(10)


def pitched_plan(seg_dev: np.ndarray, seg_stride: np.ndarray, seg_bytes: np.ndarray,
                 seg_prefix: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The pitched copies of one block, as an int64 [ops, 10] table (``P_*`` columns): GPU
    address of block 0 and block stride, GPU row pitch and rows per layer, slot offset, pool row
    pitch and rows per layer, row bytes, rows, layers.

    Runs (``strided_runs``) of more than one row that repeat with one shape at constant GPU and
    pool distances, each a whole number of rows, become one 3D copy: a rank's head range of a
    per-layer cache (every layer's rows at one pitch on the GPU, at another in the slot that
    holds every head) is then one copy per block. Everything else is a 2D copy (depth 1)."""
    first = bounds[:-1]
    rows = np.diff(bounds)
    nxt = np.minimum(first + 1, len(seg_dev) - 1)
    width = seg_bytes[first]
    gpitch = np.where(rows > 1, seg_dev[nxt] - seg_dev[first], width)
    hpitch = np.where(rows > 1, seg_prefix[nxt] - seg_prefix[first], width)
    ops: list[list[int]] = []
    r = 0
    while r < len(first):
        op = [int(seg_dev[first[r]]), int(seg_stride[first[r]]), int(gpitch[r]), int(rows[r]),
              int(seg_prefix[first[r]]), int(hpitch[r]), int(rows[r]), int(width[r]),
              int(rows[r]), 1]
        n = 1
        if rows[r] > 1 and r + 1 < len(first):
            dg = int(seg_dev[first[r + 1]] - seg_dev[first[r]])
            dh = int(seg_prefix[first[r + 1]] - seg_prefix[first[r]])
            shape = (rows[r], width[r], gpitch[r], hpitch[r], seg_stride[first[r]])
            if (dg > 0 and dh > 0 and dg % gpitch[r] == 0 and dh % hpitch[r] == 0
                    and dg // gpitch[r] >= rows[r] and dh // hpitch[r] >= rows[r]):
                while (r + n < len(first)
                       and (rows[r + n], width[r + n], gpitch[r + n], hpitch[r + n],
                            seg_stride[first[r + n]]) == shape
                       and seg_dev[first[r + n]] - seg_dev[first[r + n - 1]] == dg
                       and seg_prefix[first[r + n]] - seg_prefix[first[r + n - 1]] == dh):
                    n += 1
                if n > 1:
                    op[P_GLAYER], op[P_HLAYER], op[P_DEPTH] = (dg // int(gpitch[r]),
                                                               dh // int(hpitch[r]), n)
        ops.append(op)
        r += n
    return np.asarray(ops, dtype=np.int64).reshape(-1, 10)


def flatten_plan(plan: np.ndarray) -> np.ndarray:
    """The same copies with every 3D copy cut into its layers (2D copies only)."""
    depth = plan[:, P_DEPTH]
    if (depth == 1).all():
        return plan
    out = np.repeat(plan, depth, axis=0)
    z = np.arange(len(out)) - np.repeat(np.cumsum(depth) - depth, depth)
    out[:, P_GPU] += z * out[:, P_GLAYER] * out[:, P_GPITCH]
    out[:, P_HOST] += z * out[:, P_HLAYER] * out[:, P_HPITCH]
    out[:, P_GLAYER] = out[:, P_HEIGHT]
    out[:, P_HLAYER] = out[:, P_HEIGHT]
    out[:, P_DEPTH] = 1
    return out


def pitched_table(plan: np.ndarray, block_ids: np.ndarray, shard_offsets: np.ndarray,
                  pool_base: int) -> tuple[np.ndarray, ...]:
    """Every pitched copy of a job: (gpu address, gpu pitch, gpu rows per layer, pool address,
    pool pitch, pool rows per layer, row bytes, rows, layers) as uint64 arrays, one per
    (item, plan row). Item ``i`` pairs GPU block ``block_ids[i]`` with the slot at pool byte
    offset ``shard_offsets[i]``."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    shards = np.asarray(shard_offsets, dtype=np.int64)
    n, r = len(blocks), len(plan)
    gpu = (plan[None, :, P_GPU] + blocks[:, None] * plan[None, :, P_STRIDE]).ravel()
    host = (pool_base + shards[:, None] + plan[None, :, P_HOST]).ravel()

    def rep(col: int) -> np.ndarray:
        return np.broadcast_to(plan[:, col], (n, r)).ravel().astype(np.uint64)

    return (gpu.astype(np.uint64), rep(P_GPITCH), rep(P_GLAYER), host.astype(np.uint64),
            rep(P_HPITCH), rep(P_HLAYER), rep(P_WIDTH), rep(P_HEIGHT), rep(P_DEPTH))


def registration_pieces(data_offset: int, extent_bytes: int, piece_bytes: int
                        ) -> tuple[int, int]:
    """(piece size, phase) for registering a pool in pieces of about ``piece_bytes`` that meet
    at every extent start (``cuda.HostRegistration``): whole extents where they are smaller
    than ``piece_bytes``, else ``piece_bytes`` where it divides an extent (so no piece pins
    more than that at once: the mmap lock, ``cuda.PIECE_BYTES``), else whole extents. Pieces
    counted from the pool's base met inside slots (its tables before the first extent are no
    whole number of slots): a TP=2 rank's cut 2 MiB slot went as 1024 copies of 1 KiB."""
    if extent_bytes <= piece_bytes:
        piece = piece_bytes // extent_bytes * extent_bytes
    elif extent_bytes % piece_bytes == 0:
        piece = piece_bytes
    else:
        piece = extent_bytes
    return piece, data_offset % piece


def slots_inside_pieces(piece: int, extent_bytes: int, slot_bytes: int) -> bool:
    """Whether no slot of ``slot_bytes`` spans two pieces planned by ``registration_pieces``:
    slots lie inside extents from their starts, so pieces of whole extents cut none, and
    pieces inside extents cut none of a size that divides them (every power-of-two block)."""
    return piece % extent_bytes == 0 or piece % slot_bytes == 0


def split_items(shard_offsets: np.ndarray, shard_bytes: int, piece: int) -> np.ndarray:
    """Mask of the shards that span two separately registered pieces of the pool."""
    lo = np.asarray(shard_offsets, dtype=np.int64)
    return (lo // piece) != ((lo + shard_bytes - 1) // piece)


def crosses_pieces(shard_offsets: np.ndarray, shard_bytes: int, piece: int) -> bool:
    """Whether any shard spans two separately registered pieces of the pool."""
    return bool(split_items(shard_offsets, shard_bytes, piece).any())


# Copies at most that a job may have for its 1D table to be built in Python from the
# registration's per-block runs (``block_runs``) rather than with numpy: ``chunk_table`` costs
# ~25 us however small the job, ~20 Python additions cost ~5.
SMALL_OPS = 16

# Copies at most that a chunk may have for its table to be built in Python (``small_table``,
# ``PitchedOps.small``) rather than with numpy, whatever launches it: at 64 both cost ~18 us
# warm, but the daemon meets a job cold (it slept through the copy before, whose DMA into host
# memory evicted the CPU's caches), and cold numpy's ~8 calls for a 64-copy chunk cost 264 us
# against 75 for the Python table (this VM, 256 MiB written and 40 ms idle before each; on an
# H200 host the batch call itself then took 180-210 us: see ``small_table``).
SMALL_TABLE_OPS = 64


def block_runs(seg_dev: np.ndarray, seg_stride: np.ndarray, seg_bytes: np.ndarray,
               seg_prefix: np.ndarray) -> list[tuple[int, int, int, int]]:
    """A block's pieces merged where they are contiguous on both sides for *every* block (one
    stride), as (GPU address in block 0, block stride, offset in the slot, bytes) Python ints:
    what ``chunk_table`` merges inside one block, computed once per registration."""
    runs: list[list[int]] = []
    for d, st, n, p in zip(seg_dev.tolist(), seg_stride.tolist(), seg_bytes.tolist(),
                           seg_prefix.tolist()):
        last = runs[-1] if runs else None
        if last is not None and last[1] == st and last[0] + last[3] == d \
                and last[2] + last[3] == p:
            last[3] += n
        else:
            runs.append([d, st, p, n])
    return [(d, st, p, n) for d, st, p, n in runs]


def small_table(runs: list[tuple[int, int, int, int]], block_ids: list[int],
                shard_offsets: list[int], pool_base: int, piece: int = 0, phase: int = 0
                ) -> tuple[ctypes.Array, int]:
    """A small job's 1D copies as one ctypes uint64 array: every GPU address, then every pool
    address, then every size (``count`` each; ``cuda.memcpy_batch_at`` takes the three by
    address). A copy that starts where the one before it ended on both sides joins it (as
    ``chunk_table``'s do), except at a multiple of ``piece`` from ``pool_base + phase`` (0: the
    pool is one piece), where separately registered pieces of the pool meet. Consecutive
    blocks into consecutive slots are common (a job's blocks, victims stored together): the
    driver's cost per copy goes (~0.5 us warm), and a chunk left with one copy is enqueued by
    ``cuMemcpyAsync``, whose call costs half the batch call's when the daemon meets the job
    cold (``cuda_lane``)."""
    gpu: list[int] = []
    host: list[int] = []
    size: list[int] = []
    g_end = h_end = -1
    origin = pool_base + phase
    for b, o in zip(block_ids, shard_offsets):
        o += pool_base
        for d, st, p, n in runs:
            g, h = d + b * st, o + p
            if g == g_end and h == h_end and not (piece and (h - origin) % piece == 0):
                size[-1] += n
            else:
                gpu.append(g)
                host.append(h)
                size.append(n)
            g_end, h_end = g + n, h + n
    count = len(size)
    return (ctypes.c_uint64 * (3 * count))(*gpu, *host, *size), count


class PitchedOps:
    """One direction's pitched copies of a registration's block 0 into a slot at pool address
    0, as driver records (``BATCH3D_OP_DTYPE``) seen as rows of uint64 words: a job's
    records are these repeated per item, each item's block and slot added to two words of
    each (``pitched_table`` then ``cuda.pitched_ops`` cost ~40 us even for one block)."""

    __slots__ = ("words", "rows", "gpu_word", "host_word", "stride", "strides")

    WORDS = BATCH3D_OP_DTYPE.itemsize // 8

    def __init__(self, plan: np.ndarray, to_pool: bool) -> None:
        zero = np.zeros(1, dtype=np.int64)
        gpu, gpitch, glayer, host, hpitch, hlayer, width, rows, depth = pitched_table(
            plan, zero, zero, 0)
        if to_pool:
            ops = cuda.pitched_ops(host, hpitch, gpu, gpitch, width, rows, depth,
                                   dst_layer=hlayer, src_layer=glayer)
            gpu_field, host_field = "src_ptr", "dst_ptr"
        else:
            ops = cuda.pitched_ops(gpu, gpitch, host, hpitch, width, rows, depth,
                                   dst_layer=glayer, src_layer=hlayer)
            gpu_field, host_field = "dst_ptr", "src_ptr"
        fields = BATCH3D_OP_DTYPE.fields
        self.gpu_word = fields[gpu_field][1] // 8
        self.host_word = fields[host_field][1] // 8
        self.words = np.ascontiguousarray(ops).view(np.uint64).reshape(len(ops), self.WORDS)
        self.rows = self.words.tolist()
        self.stride = plan[:, P_STRIDE].astype(np.uint64)
        self.strides = plan[:, P_STRIDE].tolist()

    def for_items(self, block_ids: np.ndarray, shard_offsets: np.ndarray,
                  pool_base: int) -> np.ndarray:
        """The records of items (``block_ids[i]``, slot at ``shard_offsets[i]``), in order."""
        r = len(self.words)
        w = np.tile(self.words, (len(block_ids), 1))
        w[:, self.gpu_word] += (block_ids.astype(np.uint64)[:, None]
                                * self.stride[None, :]).ravel()
        w[:, self.host_word] += np.repeat((shard_offsets + pool_base).astype(np.uint64), r)
        return w.view(BATCH3D_OP_DTYPE).reshape(-1)

    def small(self, block_ids: list[int], shard_offsets: list[int],
              pool_base: int) -> tuple[ctypes.Array, int]:
        """``for_items`` of a few items as one ctypes array, in Python (no numpy's fixed
        costs), and its number of records."""
        out: list[int] = []
        g, h = self.gpu_word, self.host_word
        for b, o in zip(block_ids, shard_offsets):
            o += pool_base
            for row, st in zip(self.rows, self.strides):
                row = row.copy()
                row[g] += b * st
                row[h] += o
                out += row
        return (ctypes.c_uint64 * len(out))(*out), len(out) // self.WORDS
