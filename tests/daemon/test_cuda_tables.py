"""The CUDA engine's address arithmetic, checked on CPU against a plain per-chunk loop, and the
CUDA modules' import on a machine without CUDA."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.daemon.cuda_copy import chunk_table, merge_runs, split_at_boundaries


def _naive(seg_dev, seg_stride, seg_bytes, seg_prefix, blocks, shards, base):
    out = []
    for b, o in zip(blocks, shards):
        for s in range(len(seg_dev)):
            out.append((seg_dev[s] + b * seg_stride[s], base + o + seg_prefix[s], seg_bytes[s]))
    return out


def _bytes_map(gpu, host, size):
    """Every (gpu byte -> host byte) pair a table moves, as two arrays (small sizes only)."""
    g = np.concatenate([np.arange(a, a + n) for a, n in zip(gpu, size)])
    h = np.concatenate([np.arange(a, a + n) for a, n in zip(host, size)])
    return g, h


@pytest.mark.parametrize("lead,inner,nb", [(4, 32, 10), (1, 256, 7), (6, 48, 5)])
def test_chunk_table_matches_loop(lead, inner, nb):
    rng = np.random.default_rng(lead * 100 + inner)
    seg_dev = np.array([1 << 20 | (i * nb * inner) for i in range(lead)], dtype=np.int64)
    seg_stride = np.full(lead, inner, dtype=np.int64)
    seg_bytes = np.full(lead, inner, dtype=np.int64)
    seg_prefix = np.arange(lead, dtype=np.int64) * inner
    blocks = rng.permutation(nb)[:4]
    shards = np.arange(4, dtype=np.int64) * lead * inner * 2
    gpu, host, size = chunk_table(seg_dev, seg_stride, seg_bytes, seg_prefix, blocks, shards,
                                  1 << 30)
    assert gpu.dtype == host.dtype == size.dtype == np.uint64
    naive = _naive(seg_dev, seg_stride, seg_bytes, seg_prefix, blocks, shards, 1 << 30)
    g1, h1 = _bytes_map(*zip(*naive))
    g2, h2 = _bytes_map(gpu.astype(np.int64), host.astype(np.int64), size.astype(np.int64))
    assert np.array_equal(g1, g2) and np.array_equal(h1, h2)
    assert int(size.sum()) == len(blocks) * lead * inner


def test_block_outermost_consecutive_blocks_merge_into_one_copy():
    # one segment per block, consecutive blocks into consecutive shards: a single copy
    gpu, host, size = chunk_table(np.array([4096]), np.array([512]), np.array([512]),
                                  np.array([0]), np.arange(3, 9), np.arange(6) * 512, 0)
    assert list(size) == [6 * 512] and list(gpu) == [4096 + 3 * 512] and list(host) == [0]


def test_merge_requires_both_sides_contiguous():
    gpu = np.array([0, 10, 20, 100], dtype=np.int64)
    host = np.array([0, 10, 50, 60], dtype=np.int64)
    size = np.array([10, 10, 10, 10], dtype=np.int64)
    g, h, s = merge_runs(gpu, host, size)
    assert list(g) == [0, 20, 100] and list(h) == [0, 50, 60] and list(s) == [20, 10, 10]
    e = merge_runs(gpu[:0], host[:0], size[:0])
    assert all(len(x) == 0 for x in e)


def test_split_at_piece_boundaries_keeps_every_byte():
    base, piece = 1000, 64
    gpu = np.array([0, 500, 9000], dtype=np.uint64)
    host = np.array([base + 10, base + 60, base + 100], dtype=np.uint64)
    size = np.array([20, 150, 28], dtype=np.uint64)
    g, h, s = split_at_boundaries(gpu, host, size, base, piece)
    hi = h.astype(np.int64) - base
    assert ((hi // piece) == ((hi + s.astype(np.int64) - 1) // piece)).all()
    assert np.array_equal(np.stack(_bytes_map(gpu.astype(np.int64), host.astype(np.int64),
                                              size.astype(np.int64))),
                          np.stack(_bytes_map(g.astype(np.int64), h.astype(np.int64),
                                              s.astype(np.int64))))
    assert len(s) == 1 + 4 + 1   # 60..210 crosses 64, 128, 192


def test_cuda_modules_import_without_cuda():
    from kvpool.client import cuda_export  # noqa: F401
    from kvpool.daemon import cuda
    assert cuda.normalize_uuid("GPU-AB12-cd") == cuda.normalize_uuid("ab12cd")
    if not cuda.is_available():
        with pytest.raises((cuda.CudaUnavailable, cuda.CudaError)):
            cuda.device_count()


def _expand_pitched(gpu, gpitch, glayer, host, hpitch, hlayer, width, rows, depth):
    """Every (gpu, host, nbytes) row a ``pitched_table`` moves, by the driver's 3D addressing:
    byte x of row y of layer z at ptr + (z * layer + y) * pitch + x."""
    out = []
    cols = (gpu, gpitch, glayer, host, hpitch, hlayer, width, rows, depth)
    for g, gp, gl, h, hp, hl, w, r, d in zip(*(x.astype(np.int64) for x in cols)):
        assert r <= gl and r <= hl and w <= gp and w <= hp
        out += [(g + (z * gl + y) * gp, h + (z * hl + y) * hp, w)
                for z in range(d) for y in range(r)]
    return out


@pytest.mark.parametrize("case", ["per_layer", "mla", "mixed", "block_outer"])
def test_pitched_table_moves_the_same_bytes_as_the_chunk_table(case):
    from kvpool.daemon.cuda_copy import pitched_plan, pitched_table, strided_runs
    nb = 9
    if case == "per_layer":     # [L, 2, NB, inner]: one run of 2L rows
        lead, inner = 8, 64
        seg_dev = np.array([4096 + i * nb * inner for i in range(lead)], dtype=np.int64)
        seg_bytes = np.full(lead, inner, dtype=np.int64)
        region = np.zeros(lead, dtype=np.int64)
    elif case == "mla":         # two regions (e.g. two KV-cache tensors)
        lead, inner = 6, 48
        seg_dev = np.array([4096 + (i % 3) * nb * inner + (i // 3) * (1 << 20)
                            for i in range(lead)], dtype=np.int64)
        seg_bytes = np.full(lead, inner, dtype=np.int64)
        region = np.array([0, 0, 0, 1, 1, 1], dtype=np.int64)
    elif case == "mixed":       # sizes and pitches change along the shard
        seg_dev = np.array([0, 1000, 2000, 3000, 9000, 9100, 20000], dtype=np.int64) + 4096
        seg_bytes = np.array([32, 32, 32, 16, 16, 16, 64], dtype=np.int64)
        region = np.zeros(7, dtype=np.int64)
        lead = 7
    else:
        lead, inner = 1, 256
        seg_dev = np.array([4096], dtype=np.int64)
        seg_bytes = np.full(1, inner, dtype=np.int64)
        region = np.zeros(1, dtype=np.int64)
    seg_stride = np.full(lead, int(seg_bytes.max()), dtype=np.int64)
    seg_prefix = np.zeros(lead, dtype=np.int64)
    np.cumsum(seg_bytes[:-1], out=seg_prefix[1:])
    bounds = strided_runs(region, seg_dev, seg_stride, seg_bytes)
    if case == "per_layer":
        assert list(bounds) == [0, lead]
    if case == "mla":
        assert list(bounds) == [0, 3, 6]
    blocks = np.array([5, 0, 7, 2])
    shards = np.arange(4, dtype=np.int64) * int(seg_bytes.sum()) * 3
    plan = pitched_plan(seg_dev, seg_stride, seg_bytes, seg_prefix, bounds)
    table = pitched_table(plan, blocks, shards, 1 << 30)
    assert all(t.dtype == np.uint64 for t in table)
    assert len(table[0]) == len(blocks) * (len(bounds) - 1)
    naive = _naive(seg_dev, seg_stride, seg_bytes, seg_prefix, blocks, shards, 1 << 30)
    g1, h1 = _bytes_map(*zip(*naive))
    g2, h2 = _bytes_map(*zip(*_expand_pitched(*table)))
    assert np.array_equal(np.sort(g1), np.sort(g2))
    assert np.array_equal(g1[np.argsort(g1)], g2[np.argsort(g2)])
    assert np.array_equal(h1[np.argsort(g1)], h2[np.argsort(g2)])


def test_pitched_ops_record_layout():
    from kvpool.daemon import cuda
    one = np.ones(2, dtype=np.uint64)
    ops = cuda.pitched_ops(one * 10, one * 20, one * 30, one * 40, one * 50, one * 60)
    assert ops.dtype.itemsize == 112 and ops.flags.c_contiguous
    raw = ops.view(np.uint8).reshape(2, 112)
    word = lambda off: int(raw[0, off:off + 8].view(np.uint64)[0])   # noqa: E731
    assert [word(8), word(16), word(24)] == [30, 40, 60]        # src ptr, rowLength, layerHeight
    assert [word(48), word(56), word(64)] == [10, 20, 60]       # dst
    assert [word(80), word(88), word(96)] == [50, 60, 1]        # extent w, h, d
    assert int(raw[0, 0:4].view(np.int32)[0]) == 1 and int(raw[0, 40:44].view(np.int32)[0]) == 1
    assert int(raw[0, 104:108].view(np.int32)[0]) == 1          # srcAccessOrder = stream


def test_crosses_pieces():
    from kvpool.daemon.cuda_copy import crosses_pieces
    assert not crosses_pieces(np.array([0, 1 << 21]), 1 << 21, 1 << 30)
    assert crosses_pieces(np.array([(1 << 30) - 4096]), 1 << 21, 1 << 30)
