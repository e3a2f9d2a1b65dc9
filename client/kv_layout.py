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
