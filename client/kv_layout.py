"""Describe an engine's KV tensors as a kvpool layout: per-block segments and their placement.

An engine keeps each layer's KV as a strided view into some allocation (vLLM: one allocation per
KV-cache tensor, layer views in layouts such as LBNHC, BLHNC or MLA's latent-only shape). For one
block, a tensor's bytes are a few maximal contiguous runs; each run is a *segment* with a fixed
offset and a fixed block stride. Runs that touch in memory (say, layer l+1 right after layer l in
a block-outermost layout) are merged, so a block-outermost cache is one segment per block and the
copy engines move it in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvpool.shared.layout import SegmentPlacement


@dataclass(frozen=True)
class KvMemoryPlan:
    segment_bytes: tuple[int, ...]
    placement: list[SegmentPlacement]
    num_blocks: int


def _runs(t: torch.Tensor, block_dim: int) -> list[tuple[int, int]]:
    """(byte offset from the tensor's data_ptr, nbytes) of each contiguous run of block 0."""
    b0 = t.select(block_dim, 0)
    elem = t.element_size()
    dims = sorted(range(b0.dim()), key=lambda d: b0.stride(d))
    # Grow the contiguous inner part from the smallest stride outwards.
    inner, run = [], 1
    for d in dims:
        if b0.size(d) == 1:
            continue
        if b0.stride(d) == run:
            inner.append(d)
            run *= b0.size(d)
        else:
            break
    outer = [d for d in range(b0.dim()) if d not in inner and b0.size(d) > 1]
    outer.sort(key=lambda d: -b0.stride(d))
    offsets = [0]
    for d in outer:
        offsets = [o + i * b0.stride(d) for o in offsets for i in range(b0.size(d))]
    return [(o * elem, run * elem) for o in offsets]


def plan_kv_memory(tensors: Sequence[torch.Tensor], block_dims: Sequence[int],
                   regions: Sequence[tuple[int, int]]) -> KvMemoryPlan:
    """Segments of one block across ``tensors`` (in order), located in ``regions``.

    ``block_dims[i]`` is the block-index dimension of ``tensors[i]``; ``regions`` are
    ``(base_address, nbytes)`` of the registered allocations. Every tensor must lie inside one
    region and all must agree on the number of blocks.
    """
    num_blocks = {t.size(d) for t, d in zip(tensors, block_dims)}
    if len(num_blocks) != 1:
        raise ValueError(f"KV tensors disagree on the number of blocks: {sorted(num_blocks)}")
    segs: list[list[int]] = []   # [region, offset, stride, nbytes]
    for t, d in zip(tensors, block_dims):
        ptr = t.data_ptr()
        region = next((i for i, (base, n) in enumerate(regions) if base <= ptr < base + n), None)
        if region is None:
            raise ValueError("a KV tensor lies outside every registered region")
        base = regions[region][0]
        stride = t.stride(d) * t.element_size()
        for off, nbytes in _runs(t, d):
            offset = ptr - base + off
            last = segs[-1] if segs else None
            if (last is not None and last[0] == region and last[2] == stride
                    and last[1] + last[3] == offset):
                last[3] += nbytes
            else:
                segs.append([region, offset, stride, nbytes])
    return KvMemoryPlan(tuple(s[3] for s in segs),
                        [SegmentPlacement(s[0], s[1], s[2]) for s in segs], num_blocks.pop())


def head_cell_bytes(t: torch.Tensor, block_dim: int, head_dim: int) -> int | None:
    """Bytes of one KV head's cell in a block of ``t``, or None when the block is not made of
    such cells.

    A head-split layout (``kvpool.shared.layout``) needs a rank's part of a block, its segments
    concatenated in address order, to be rows of one contiguous cell per head with the head
    index running fastest: then it is ``rows x local heads x cell`` whatever the rest of the
    shape is. That holds when the dimensions with a smaller stride than the head's form one
    contiguous run (the cell) and every other dimension's stride is at least a whole row of
    heads. vLLM's layer views ``[B, H, N, C]`` pass in every ``KVCacheLayout`` (LBNHC and
    BLNHC: a cell is one token's K and V of a head; LBHNC, BLHNC and LHBNC: all tokens of a
    head; BHLNC: every layer of a head), as do the older ``[2, B, N, H, D]`` shapes.
    """
    b0 = t.select(block_dim, 0)
    hd = head_dim - (head_dim > block_dim)
    head_stride = b0.stride(hd)
    heads = b0.size(hd)
    others = [(b0.stride(d), b0.size(d)) for d in range(b0.dim()) if d != hd and b0.size(d) > 1]
    cell = 1
    for stride, size in sorted(s for s in others if s[0] < head_stride):
        if stride != cell:
            return None
        cell *= size
    if cell > head_stride:
        return None
    if heads > 1 and any(head_stride <= s < heads * head_stride for s, _ in others):
        return None
    return cell * t.element_size()


def head_split(tensors: Sequence[torch.Tensor], block_dims: Sequence[int],
               head_dims: Sequence[int | None], kv_heads: int, tp_size: int,
               shard_bytes: int) -> int:
    """``head_bytes`` for a head-split ``Layout`` of ``tensors`` (one rank's KV of one group,
    ``kv_heads`` across all ranks), or 0 when they cannot be split by heads (the layout is
    then rank-sharded: only engines of one TP size share it).

    ``head_dims[i]`` is the KV-head dimension of ``tensors[i]`` (None: it has none, as MLA's
    latent). One head (MLA, or a single KV head replicated on every rank) needs no split:
    the whole part is one row of one cell.
    """
    if kv_heads <= 0:
        return 0
    if kv_heads == 1:
        return shard_bytes
    local = max(1, kv_heads // tp_size)
    cells = set()
    for t, bd, hd in zip(tensors, block_dims, head_dims):
        if hd is None or t.size(hd) != local:
            return 0
        cell = head_cell_bytes(t, bd, hd)
        if cell is None:
            return 0
        cells.add(cell)
    if len(cells) != 1:
        return 0
    cell = cells.pop()
    return cell if shard_bytes % (local * cell) == 0 else 0
