"""The gather/scatter copy kernel (Triton) behind ``CudaCopyEngine``'s kernel backend.

One launch moves every chunk of a job: chunk ``c`` is segment ``c % n_seg`` of item
``c // n_seg``; its GPU address is ``seg_dev[s] + block_id * seg_stride[s]`` and its pool address
``pool_base + shard_offset + seg_prefix[s]``. The pool is registered host memory reached over
UVA, so the kernel writes (stores) or reads (loads) it directly across PCIe. The grid is small
and fixed (``max_ctas``): every CTA walks chunks with a grid stride, so the SMs the model needs
stay free however large the job.

Imported lazily by the copy engine (importing Triton takes a while); never imported on CPU.
Every address and size is a multiple of 16 bytes (the engine checks), so each thread moves
16-byte vectors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_chunks_kernel(items_ptr, n_items, seg_dev_ptr, seg_stride_ptr, seg_bytes_ptr,
                       seg_prefix_ptr, n_seg, pool_base, base,
                       TO_POOL: tl.constexpr, WORDS: tl.constexpr):
    # items_ptr: int64 pairs (block_id, shard_offset) in pinned host memory. base: an int32
    # pointer to the pool's first byte (pool_base). Every address becomes an element offset
    # from it: offsets carry the 16-byte alignment hint that turns each thread's accesses into
    # 16-byte vectors, where a pointer cast from an integer would lose it.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, WORDS)
    vec_of_lane = lanes // 4
    total = n_items * n_seg
    for c in range(pid, total, nprog):
        i = c // n_seg
        s = c - i * n_seg
        block = tl.load(items_ptr + 2 * i)
        shard = tl.load(items_ptr + 2 * i + 1)
        dev = tl.load(seg_dev_ptr + s) + block * tl.load(seg_stride_ptr + s) - pool_base
        host = shard + tl.load(seg_prefix_ptr + s)
        nvec = tl.load(seg_bytes_ptr + s) // 16
        if TO_POOL:
            src_w = dev // 4
            dst_w = host // 4
        else:
            src_w = host // 4
            dst_w = dev // 4
        for v0 in range(0, nvec, WORDS // 4):
            mask = (vec_of_lane + v0) < nvec
            so = tl.max_contiguous(tl.multiple_of(src_w + v0 * 4 + lanes, 4), WORDS)
            do = tl.max_contiguous(tl.multiple_of(dst_w + v0 * 4 + lanes, 4), WORDS)
            x = tl.load(base + so, mask=mask, cache_modifier=".cg")
            tl.store(base + do, x, mask=mask, cache_modifier=".cs")
