"""The CUDA engine's address arithmetic (``copy_plan``), checked on CPU against a plain
per-chunk loop, and the CUDA modules' import on a machine without CUDA."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.daemon.copy_plan import (chunk_table, merge_runs, registration_pieces,
                                     slots_inside_pieces, split_at_boundaries)
from kvpool.daemon.pool import Geometry


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
    from kvpool.daemon.copy_plan import pitched_plan, pitched_table, strided_runs
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
    from kvpool.daemon.copy_plan import crosses_pieces
    assert not crosses_pieces(np.array([0, 1 << 21]), 1 << 21, 1 << 30)
    assert crosses_pieces(np.array([(1 << 30) - 4096]), 1 << 21, 1 << 30)


# ---- a rank's head range of a slot that holds every head (head-split layouts) ----------------

def _run_ops(src: np.ndarray, dst: np.ndarray, rows: list[tuple[int, int, int]]) -> None:
    for s, d, n in rows:
        dst[d:d + n] = src[s:s + n]


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LHBNC", "BHLNC"])
@pytest.mark.parametrize("tp,rank,heads", [(2, 1, 4), (4, 2, 4), (1, 0, 4), (4, 3, 2)])
def test_tp_cross_pitched_plan_moves_exactly_the_ranks_heads(order, tp, rank, heads):
    """The GPU engine's copies of a rank's part, run on bytes by the driver's addressing rules:
    pitched (2D and 3D, and 3D cut into 2D) and 1D chunks each move exactly the host path's
    pieces, and nothing else of the slot."""
    from kvpool.daemon.copy_engine import segment_address_table
    from kvpool.daemon.copy_plan import (flatten_plan, pitched_plan, pitched_table,
                                         strided_runs)
    from kvpool.shared.protocol import RegisterRequest
    from bench.kvtest import HeadKv

    kv = HeadKv(tp, rank, heads=heads, layers=3, blocks=6, block_tokens=4, cell=8, order=order)
    try:
        reg = RegisterRequest(1, kv.namespace, kv.layout, rank, kv.blocks, [kv.mem.region],
                              kv.placement)
        region, offset, stride, nbytes, prefix = segment_address_table(reg)
        worker = np.random.default_rng(tp * 10 + rank).integers(
            0, 255, kv.mem.nbytes, dtype=np.uint8)
        slot = kv.layout.slot_bytes
        blocks, slots = np.array([4, 0, 5]), np.array([2, 0, 1]) * slot
        want = np.zeros(3 * slot, np.uint8)
        _run_ops(worker, want, [(o + b * st, s + p, n) for b, s in zip(blocks, slots)
                                for o, st, n, p in zip(offset, stride, nbytes, prefix)])
        assert (want != 0).sum() > 0
        g, h, sz = chunk_table(offset, stride, nbytes, prefix, blocks, slots, 0)
        got = np.zeros_like(want)
        _run_ops(worker, got, list(zip(g.astype(np.int64), h.astype(np.int64),
                                       sz.astype(np.int64))))
        assert np.array_equal(got, want), "1D chunks"
        plan = pitched_plan(offset, stride, nbytes, prefix,
                            strided_runs(region, offset, stride, nbytes, prefix))
        for p in (plan, flatten_plan(plan)):
            got = np.zeros_like(want)
            _run_ops(worker, got, _expand_pitched(*pitched_table(p, blocks, slots, 0)))
            assert np.array_equal(got, want), "pitched"
        local = max(1, heads // tp)
        if order in ("LBNHC", "BLNHC") and local < heads:
            # token rows of a few heads: one 3D copy per block (per-layer) or one 2D copy
            assert len(plan) == 1 and len(flatten_plan(plan)) == (3 if order == "LBNHC" else 1)
        if order == "BLHNC":
            assert len(plan) == 1          # layers of whole heads, one pitched copy per block
    finally:
        kv.close()


def test_tp_cross_engine_tables_for_the_benchmark_layouts():
    """Llama-3.1-8B blocks (8 KV heads, 16 tokens, 512-byte K+V cells, 32 layers) at TP=2: the
    per-layer cache is one 3D copy of 64 layers of 16 rows of 2 KiB per block, block-outermost
    NHD one 2D copy of 512 rows of 2 KiB, block-outermost HND one 2D copy of 32 rows of 32 KiB;
    at TP=1 each is as before."""
    from kvpool.daemon.copy_engine import segment_address_table
    from kvpool.daemon.copy_plan import (P_DEPTH, P_HEIGHT, P_WIDTH, pitched_plan,
                                         strided_runs)
    from kvpool.shared.layout import Layout, SegmentPlacement
    from kvpool.shared.protocol import RegisterRequest

    nb, cell, tokens, layers, heads = 100, 512, 16, 32, 8

    def plan(tp, segs, inner, hb):
        local = heads // tp
        seg = inner * local // heads
        lay = Layout(tokens, tp, "bfloat16", (seg,) * segs, "llama", heads, hb)
        placement = [SegmentPlacement(0, i * nb * seg, seg) for i in range(segs)]
        reg = RegisterRequest(1, b"n" * 16, lay, 1 % tp, nb, [], placement)
        region, offset, stride, nbytes, prefix = segment_address_table(reg)
        return pitched_plan(offset, stride, nbytes, prefix,
                            strided_runs(region, offset, stride, nbytes, prefix))

    # LBNHC: 32 layers, one segment per layer ([N, H, C]); a row is a token of all heads
    p = plan(2, layers, tokens * heads * cell, cell)
    assert p[:, [P_WIDTH, P_HEIGHT, P_DEPTH]].tolist() == [[4 * cell, tokens, layers]]
    p = plan(1, layers, tokens * heads * cell, cell)
    assert p[:, [P_WIDTH, P_HEIGHT, P_DEPTH]].tolist() == [[tokens * heads * cell, layers, 1]]
    # BLNHC: one segment per block
    p = plan(2, 1, layers * tokens * heads * cell, cell)
    assert p[:, [P_WIDTH, P_HEIGHT, P_DEPTH]].tolist() == [[4 * cell, layers * tokens, 1]]
    # BLHNC: one segment per block, a row is a layer of all heads
    p = plan(2, 1, layers * tokens * heads * cell, tokens * cell)
    assert p[:, [P_WIDTH, P_HEIGHT, P_DEPTH]].tolist() == [[4 * tokens * cell, layers, 1]]


# ---- small jobs' tables (built in Python from per-registration templates) -------------------

@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LHBNC", "BHLNC"])
@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1), (4, 3)])
def test_templates_give_the_same_copies_as_the_full_tables(order, tp, rank):
    """A job's pitched records from a registration's ``PitchedOps`` (numpy for any size, Python
    for a few items) are the records ``pitched_table`` + ``pitched_ops`` give, in order, both
    directions, 2D and 3D; a small job's 1D table from ``block_runs`` moves exactly the bytes
    of ``chunk_table``'s."""
    import ctypes

    from kvpool.daemon import cuda
    from kvpool.daemon.copy_engine import segment_address_table
    from kvpool.daemon.copy_plan import (PitchedOps, block_runs, flatten_plan, pitched_plan,
                                         pitched_table, small_table, strided_runs)
    from kvpool.shared.protocol import RegisterRequest
    from bench.kvtest import HeadKv

    kv = HeadKv(tp, rank, heads=4, layers=3, blocks=6, block_tokens=4, cell=8, order=order)
    try:
        reg = RegisterRequest(1, kv.namespace, kv.layout, rank, kv.blocks, [kv.mem.region],
                              kv.placement)
        region, offset, stride, nbytes, prefix = segment_address_table(reg)
        dev = offset + (1 << 40)
        slot = kv.layout.slot_bytes
        base = 1 << 30
        plan = pitched_plan(dev, stride, nbytes, prefix,
                            strided_runs(region, dev, stride, nbytes, prefix))
        for blocks, slots in ((np.array([4]), np.array([2 * slot])),
                              (np.array([4, 0, 5]), np.array([2, 0, 1]) * slot)):
            for p in (plan, flatten_plan(plan)):
                g, gp, gl, h, hp, hl, w, r, d = pitched_table(p, blocks, slots, base)
                for to_pool in (True, False):
                    want = (cuda.pitched_ops(h, hp, g, gp, w, r, d, dst_layer=hl, src_layer=gl)
                            if to_pool else
                            cuda.pitched_ops(g, gp, h, hp, w, r, d, dst_layer=gl, src_layer=hl))
                    t = PitchedOps(p, to_pool)
                    got = t.for_items(blocks, slots, base)
                    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
                    table, count = t.small(blocks.tolist(), slots.tolist(), base)
                    assert count == len(want) and bytes(table) == want.tobytes()
            runs = block_runs(dev, stride, nbytes, prefix)
            assert len(runs) <= len(dev)
            table, count = small_table(runs, blocks.tolist(), slots.tolist(), base)
            cols = np.frombuffer(table, np.uint64).reshape(3, count).astype(np.int64)
            naive = _naive(dev, stride, nbytes, prefix, blocks, slots, base)
            g1, h1 = _bytes_map(*zip(*naive))
            g2, h2 = _bytes_map(*cols)
            assert np.array_equal(g1[np.argsort(g1)], g2[np.argsort(g2)])
            assert np.array_equal(h1[np.argsort(g1)], h2[np.argsort(g2)])
            assert ctypes.sizeof(table) == 3 * 8 * count
    finally:
        kv.close()


def test_a_small_table_joins_copies_contiguous_on_both_sides_but_not_across_a_piece():
    """Blocks into slots that follow on both sides go as one copy (the driver costs per copy);
    a gap on either side, or two pool pieces meeting between them, keeps them apart."""
    from kvpool.daemon.copy_plan import small_table
    runs = [(1000, 100, 0, 100)]      # one 100-byte run per block, blocks 100 bytes apart
    base = 1 << 20

    def cols(blocks, slots, piece=0):
        table, count = small_table(runs, blocks, slots, base, piece)
        return np.frombuffer(table, np.uint64).reshape(3, count).tolist()
    assert cols([3, 4, 5], [0, 100, 200]) == [[1300], [base], [300]]
    assert cols([3, 4, 5], [0, 200, 300]) == [[1300, 1400], [base, base + 200], [100, 200]]
    assert cols([3, 5, 6], [0, 100, 200]) == [[1300, 1500], [base, base + 100], [100, 200]]
    assert cols([3, 4, 5], [0, 100, 200], piece=200) == [[1300, 1500], [base, base + 200],
                                                        [200, 100]]
    assert cols([5, 4], [100, 0]) == [[1500, 1400], [base + 100, base], [100, 100]]


def test_block_runs_merge_only_what_stays_contiguous_for_every_block():
    from kvpool.daemon.copy_plan import block_runs
    a = lambda *x: np.array(x, dtype=np.int64)   # noqa: E731
    # two segments back to back on both sides with one stride: one run
    assert block_runs(a(100, 110), a(64, 64), a(10, 10), a(0, 10)) == [(100, 64, 0, 20)]
    # contiguous in block 0 but with different strides: they part in block 1
    assert len(block_runs(a(100, 110), a(64, 32), a(10, 10), a(0, 10))) == 2
    # contiguous on the GPU, not in the slot
    assert len(block_runs(a(100, 110), a(64, 64), a(10, 10), a(0, 20))) == 2


@pytest.mark.parametrize("pool_gib,extent_mib", [(6, 32), (1, 8), (64, 256), (12, 64), (2, 4),
                                                 (4, 192)])
def test_registered_pieces_meet_at_extent_starts_and_cut_no_slot_they_say_they_do_not(
        pool_gib, extent_mib):
    """No slot may span two registered pieces (a cut slot's copy falls apart: a TP=2 rank's
    2 MiB slot went as 1024 copies of 1 KiB). Slots lie inside extents from their starts:
    pieces meet at every extent start, and inside bigger extents only at multiples of the
    piece, so they cut no slot whose size divides it. Pieces from the pool's base cut 2 MiB
    slots of the 6 GiB pool, since its tables before the first extent are no whole number
    of slots."""
    g = Geometry.plan(pool_gib << 30, extent_mib << 20)
    want = 128 << 20
    piece, phase = registration_pieces(g.data_offset, g.extent_bytes, want)
    assert 0 <= phase < piece
    assert piece % g.extent_bytes == 0 or g.extent_bytes % piece == 0
    # no bigger than asked where the extents allow it (pinning holds the mmap lock)
    assert piece <= want or piece == g.extent_bytes and g.extent_bytes % want != 0
    starts = g.data_offset + np.arange(g.num_extents, dtype=np.int64) * g.extent_bytes
    # boundaries at the first extent's start plus whole pieces: so at extent starts, and
    # inside extents only at whole pieces from their starts
    assert (g.data_offset - phase) % piece == 0
    for slot in (2 << 20, 3 << 19, 7 << 18, 4096 * 3):
        offs = (starts[:, None] + np.arange(g.extent_bytes // slot)[None, :] * slot).ravel()
        cut = ((offs - phase) // piece != (offs + slot - 1 - phase) // piece).any()
        assert cut != slots_inside_pieces(piece, g.extent_bytes, slot), (piece, slot)
    if (pool_gib, extent_mib) == (6, 32):
        assert slots_inside_pieces(piece, g.extent_bytes, 2 << 20)
        offs = (starts[:, None] + np.arange(16)[None, :] * (2 << 20)).ravel()
        assert ((offs // want) != ((offs + (2 << 20) - 1) // want)).any()
    if (pool_gib, extent_mib) == (64, 256):
        assert piece == want and slots_inside_pieces(piece, g.extent_bytes, 2 << 20)
        assert not slots_inside_pieces(piece, g.extent_bytes, 7 << 18)   # 1.75 MiB blocks
