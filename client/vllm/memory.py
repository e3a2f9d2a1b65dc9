"""Where a vLLM worker's KV tensors live, in the terms a registration needs.

Owns one question: given the KV tensors of one KV-cache group, which regions (host POSIX shm or,
through ``kvpool.client.cuda_export``, CUDA IPC allocations) hold them, and what the
block-index dimension of each tensor is. Never talks to the daemon and never copies KV.

Host tensors are found through ``/proc/self/maps``: any tensor that lives in a ``/dev/shm``
mapping (``SharedHostMemory``, or an engine's own shm allocator) can be registered without the
engine telling us where it got the memory.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from kvpool.shared.protocol import HostRegion, Region


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The block-index dimension of a vLLM KV tensor: ``(num_blocks, ...)`` in vLLM 0.33, or
    the older ``(2, num_blocks, ...)``; ``ValueError`` if no dimension has ``num_blocks``."""
    dims = [d for d in range(t.dim()) if t.size(d) == num_blocks]
    if not dims:
        raise ValueError(f"KV tensor of shape {tuple(t.shape)} has no dimension of "
                         f"{num_blocks} blocks")
    if len(dims) > 1 and t.dim() > 1 and t.size(0) == 2 and 1 in dims:
        return 1
    return dims[0]


def head_dim(t: torch.Tensor, block: int) -> int | None:
    """The KV-head dimension of a vLLM KV tensor whose block dimension is ``block``: vLLM
    0.33's layer views are ``[B, H, N, C]``, older ones ``[2, B, N, H, D]`` or
    ``[B, 2, N, H, D]``; None for shapes without one (MLA's ``[B, N, latent]``)."""
    if t.dim() == 4 and block == 0:
        return 1
    if t.dim() == 5:
        return 3
    return None


def _shm_mappings() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, shm name) of every /dev/shm mapping of this process."""
    out = []
    with open(f"/proc/{os.getpid()}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5].strip()[len("/dev/shm/"):]
            if name.endswith(" (deleted)"):
                continue
            out.append((lo, hi, int(parts[2], 16), name))
    return out


def host_regions(tensors: Sequence[torch.Tensor]) -> tuple[list[Region], list[tuple[int, int]]]:
    """Regions (for the daemon) and ``(base_address, nbytes)`` spans (for ``plan_kv_memory``)
    of the shm mappings holding ``tensors``; ``ValueError`` for a tensor outside shm."""
    maps = _shm_mappings()
    regions: list[Region] = []
    spans: list[tuple[int, int]] = []
    for t in tensors:
        lo_ptr = t.data_ptr()
        hi_ptr = lo_ptr + max(1, _extent_bytes(t))
        for k, (lo, hi, off, name) in enumerate(maps):
            if lo <= lo_ptr and hi_ptr <= hi:
                if (lo, hi - lo) not in spans:
                    spans.append((lo, hi - lo))
                    regions.append(HostRegion(name, hi - lo, off))
                break
        else:
            raise ValueError("a KV tensor is not in POSIX shared memory: the host path needs "
                             "the KV cache allocated in /dev/shm (CUDA tensors use CUDA IPC)")
    return regions, spans


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from the first to one past the last element of a strided view."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def cuda_regions(tensors: Sequence[torch.Tensor]) -> tuple[list[Region], list[tuple[int, int]]]:
    """The CUDA IPC regions of ``tensors``, through the GPU exporter (imported only here, so a
    CPU-only engine never loads CUDA code)."""
    from kvpool.client import cuda_export  # noqa: PLC0415  (lazy: CUDA only)

    return cuda_export.export_regions(list(tensors))


def regions_for(tensors: Sequence[torch.Tensor]) -> tuple[list[Region], list[tuple[int, int]]]:
    if tensors and tensors[0].is_cuda:
        return cuda_regions(tensors)
    return host_regions(tensors)


class TransferEvents:
    """GPU ordering for one worker's stores; nothing at all for host memory or for loads.

    A store must not copy before this step's kernels have written the KV: the worker records an
    interprocess event on its compute stream and the daemon polls it before copying. Loads need
    nothing: the daemon reports a load only once its copy has finished. Host memory needs
    neither: the forward has returned when the store is submitted.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._store = None
        if tensors and tensors[0].is_cuda:
            from kvpool.client import cuda_export  # noqa: PLC0415  (lazy: CUDA only)

            self._store = cuda_export.StoreEvents()

    def store_event(self) -> bytes:
        return self._store.record() if self._store is not None else b""
