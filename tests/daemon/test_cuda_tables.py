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
