"""The tensor → segment planner on the KV layouts vLLM 0.33 allocates."""

import pytest
import torch

from kvpool.client.kv_layout import plan_kv_memory

L, N, T, H, D = 3, 10, 16, 4, 8   # layers, blocks, tokens per block, kv heads, head dim
E = 2                              # fp16


def views(shape, per_layer_dim):
    """One allocation of ``shape``; per-layer views selected on ``per_layer_dim``."""
    whole = torch.empty(shape, dtype=torch.float16)
    return whole, [whole.select(per_layer_dim, i) for i in range(L)]


@pytest.mark.parametrize("name,shape,layer_dim,block_dim,segments", [
    # allocation shape, dim of layers, block dim within a layer view, expected segment sizes
    ("LBNHC per-layer flash", (L, 2, N, T, H, D), 0, 1, [T * H * D * E] * (2 * L)),
    ("LBHNC per-layer HND", (L, 2, N, H, T, D), 0, 1, [T * H * D * E] * (2 * L)),
    ("BLHNC block-outermost", (N, L, 2, T, H, D), 1, 0, [L * 2 * T * H * D * E]),
    ("BHLNC heads-outer", (N, H, L, 2, T, D), 2, 0, None),
])
def test_layouts(name, shape, layer_dim, block_dim, segments):
    whole, tensors = views(shape, layer_dim)
    plan = plan_kv_memory(tensors, [block_dim] * L, [(whole.data_ptr(), whole.nbytes)])
    assert plan.num_blocks == N
    assert sum(plan.segment_bytes) == L * 2 * T * H * D * E
    if segments is not None:
        assert list(plan.segment_bytes) == segments
    # Every byte of block 7 is covered exactly once, at the offsets the placement claims.
    for t in tensors:
        t.fill_(0)
    for t in tensors:
        t.select(block_dim, 7).fill_(1)
    raw = whole.view(torch.int16).view(-1) != 0
    covered = torch.zeros_like(raw)
    for place, nbytes in zip(plan.placement, plan.segment_bytes):
        start = (place.offset_bytes + 7 * place.block_stride_bytes) // 2
        assert not covered[start:start + nbytes // 2].any()
        covered[start:start + nbytes // 2] = True
    assert torch.equal(covered, raw)


def test_mla_latent_cache():
    whole = torch.empty((L, N, T, 576), dtype=torch.bfloat16)
    plan = plan_kv_memory([whole[i] for i in range(L)], [0] * L, [(whole.data_ptr(), whole.nbytes)])
    assert list(plan.segment_bytes) == [T * 576 * 2] * L


def test_tensors_outside_regions_or_disagreeing_are_refused():
    a = torch.empty((2, N, T, H, D))
    b = torch.empty((2, N + 1, T, H, D))
    with pytest.raises(ValueError, match="outside"):
        plan_kv_memory([a], [1], [(b.data_ptr(), b.nbytes)])
    with pytest.raises(ValueError, match="disagree"):
        plan_kv_memory([a, b], [1, 1], [(a.data_ptr(), a.nbytes), (b.data_ptr(), b.nbytes)])


# ---- KV-head cells (head-split layouts, shared across TP sizes) ----------------------------

def _layer_views(order: str, heads: int = H, blocks: int = N) -> list[torch.Tensor]:
    """vLLM 0.33's per-layer ``[B, H, N, C]`` views (C: a token's K and V of a head)."""
    from bench.kvtest import STRIDE_ORDERS
    so = STRIDE_ORDERS[order]
    shape = (L, blocks, heads, T, 2 * D)
    whole = torch.empty([shape[d] for d in so], dtype=torch.float16)
    logical = whole.permute(*[so.index(d) for d in range(5)])
    return [logical[i] for i in range(L)]


@pytest.mark.parametrize("order,cell", [
    ("LBNHC", 2 * D), ("BLNHC", 2 * D),                         # a token's K and V
    ("LBHNC", T * 2 * D), ("BLHNC", T * 2 * D), ("LHBNC", T * 2 * D),   # all tokens of a head
    ("BHLNC", T * 2 * D)])
def test_tp_cross_head_cells_of_every_vllm_layout(order, cell):
    from kvpool.client.kv_layout import head_cell_bytes, head_split
    tensors = _layer_views(order)
    assert head_cell_bytes(tensors[0], 0, 1) == cell * E
    shard = L * H * T * 2 * D * E
    assert head_split(tensors, [0] * L, [1] * L, H, 1, shard) == cell * E
    # a TP=2 rank holds half the heads; the same cell, so the same canonical slot
    half = _layer_views(order, heads=H // 2)
    assert head_split(half, [0] * L, [1] * L, H, 2, shard // 2) == cell * E


def test_tp_cross_head_split_refuses_what_is_not_rows_of_head_cells():
    from kvpool.client.kv_layout import head_cell_bytes, head_split
    old = torch.empty(2, N, T, H, D, dtype=torch.float16)       # [2, B, N, H, D]: cells of D
    assert head_cell_bytes(old, 1, 3) == D * E
    # padding after each token's cell: a head's tokens are not one contiguous cell
    padded = torch.empty(N, H, T, 2 * D + 8, dtype=torch.float16)[..., :2 * D]
    assert head_cell_bytes(padded, 0, 1) is None
    tensors = _layer_views("LBNHC")
    shard = L * H * T * 2 * D * E
    assert head_split(tensors, [0] * L, [1] * L, 2 * H, 1, shard) == 0     # heads disagree
    assert head_split(tensors, [0] * L, [None] * L, H, 1, shard) == 0      # no head dim
    assert head_split(tensors, [0] * L, [None] * L, 1, 4, shard) == shard  # MLA: one cell
    assert head_split(tensors, [0] * L, [1] * L, 0, 1, shard) == 0         # not declared
