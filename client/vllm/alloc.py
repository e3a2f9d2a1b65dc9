"""A CPU engine's KV cache, allocated where kvpoold can map it.

vLLM allocates a CPU worker's KV cache with ``torch.zeros(n, dtype=int8)`` in private memory,
which no other process can reach, so without this the host path would never see a block. Right
before that allocation vLLM (0.32 and 0.33, GPU and CPU workers alike) enters the context its
KV connector returns from ``get_mem_pool_context()``. ``ShmKvAllocation`` is that context: a
``TorchFunctionMode`` that answers the factory call whose size is one of the engine's KV-cache
tensors with a tensor over fresh POSIX shared memory (``SharedHostMemory``: zero-filled, pages
reserved, 0600, unlinked at exit or reaped by kvpoold after a SIGKILL). The engine gets a normal
CPU tensor of the size and dtype it asked for: no flag, no extra copy, nothing else changes.

Only CPU factory calls of exactly a KV-cache tensor's byte size are taken, each size at most as
often as the config lists it; every other call (weights, buffers, a CUDA allocation) passes
through untouched. If /dev/shm cannot hold the cache, the allocation falls back to private
memory and ``failure`` says why in one line (the worker logs it once: the engine runs without
kvpool).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode

from kvpool.client.host_memory import SharedHostMemory, ShmSpaceError

logger = logging.getLogger("kvpool.vllm")

_FACTORIES = (torch.zeros, torch.empty)


def _requested_bytes(args: tuple, kwargs: dict) -> tuple[tuple[int, ...], torch.dtype, int] | None:
    """(shape, dtype, bytes) of a plain CPU ``torch.zeros``/``torch.empty`` call, else None."""
    if kwargs.get("out") is not None or kwargs.get("pin_memory") or kwargs.get("requires_grad"):
        return None
    if kwargs.get("layout", torch.strided) is not torch.strided:
        return None
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None \
        else torch.get_default_device()
    if device.type != "cpu":
        return None
    size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if "size" in kwargs:
        size = kwargs["size"]
    try:
        shape = tuple(int(s) for s in size)
    except (TypeError, ValueError):
        return None
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    numel = 1
    for s in shape:
        numel *= s
    return shape, dtype, numel * torch.empty((), dtype=dtype).element_size()


class ShmKvAllocation(TorchFunctionMode):
    """Context for vLLM's KV-cache allocation; see the module docstring.

    ``sizes`` are the byte sizes of the engine's KV-cache tensors (``KVCacheConfig``). After
    the context, ``memories`` holds the shared memory handed out (kept for the worker's life:
    it carries the liveness lock) and ``failure`` the one-line reason a tensor went private.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        super().__init__()
        self._wanted = [int(s) for s in sizes if int(s) > 0]
        self.memories: list[SharedHostMemory] = []
        self.failure: str | None = None

    def __torch_function__(self, func, types, args: tuple = (), kwargs: dict | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func not in _FACTORIES or not self._wanted:
            return func(*args, **kwargs)
        req = _requested_bytes(args, kwargs)
        if req is None or req[2] not in self._wanted:
            return func(*args, **kwargs)
        shape, dtype, nbytes = req
        self._wanted.remove(nbytes)
        try:
            mem = SharedHostMemory(nbytes)
        except (ShmSpaceError, OSError) as e:
            self.failure = self.failure or (e.strerror if isinstance(e, ShmSpaceError)
                                            else f"cannot allocate it in /dev/shm: {e}")
            return func(*args, **kwargs)
        self.memories.append(mem)
        # Fresh shm is zero-filled, which serves torch.zeros and torch.empty alike.
        return mem.tensor.view(dtype).view(shape)
