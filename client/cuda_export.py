"""Worker side of the CUDA path: share vLLM's KV-cache tensors with kvpoold over CUDA IPC.

Owns: finding each KV tensor's backing allocation (one ``cudaMalloc`` per KV-cache tensor in
vLLM 0.33; every per-layer tensor is a strided view into one of them), exporting one
``CudaRegion`` per allocation (device UUID, IPC handle, offset) with the spans that
``kvpool.client.kv_layout.plan_kv_memory`` places segments in, and the ring of interprocess events the
daemon polls before a store copies.

Layouts: any strided view works (LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC, MLA's one latent per
token): the planner cuts each tensor into its maximal per-block contiguous chunks.

Memory made by ``cuMemCreate`` (PyTorch's ``expandable_segments:True``, vLLM's sleep-mode
allocator) cannot be shared with a legacy IPC handle: registration then fails with a
``ConfigError`` that says what to change, before anything is sent.

Must never: import ``kvpool.daemon``, block or stall the engine's compute stream (it only
records events; nothing waits on one on the GPU), or do work at import time (torch is
imported by the caller already).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

from kvpool.shared.errors import ConfigError
from kvpool.shared.protocol import CudaRegion

_IS_LEGACY_CUDA_IPC_CAPABLE = 18
_STORE_EVENTS = 32   # the daemon keeps at most a few hundred opened; a ring keeps it bounded


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_lib: Any = None


def _cuda() -> Any:
    # The driver library, for the calls torch does not expose (an allocation's range, its IPC
    # handle, whether legacy IPC can share it) or makes slow (a store event's record, see
    # StoreEvents). torch already initialised CUDA.
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _lib = lib
    return _lib


def allocation_of(ptr: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation that holds device pointer ``ptr``."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _cuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc != 0:
        raise ConfigError(f"pointer {ptr:#x} is not CUDA device memory (cuMemGetAddressRange "
                          f"error {rc})")
    return base.value, size.value


def _expandable_segments_configured() -> bool:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            return True
    return False


def ipc_handle_of(base: int) -> bytes:
    """The legacy CUDA IPC handle of the allocation at ``base``; ``ConfigError`` (saying what to
    change) when the allocation cannot be shared that way."""
    lib = _cuda()
    capable = ctypes.c_int(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(capable), _IS_LEGACY_CUDA_IPC_CAPABLE, base)
    h = _Handle()
    if rc != 0 or capable.value:
        # the attribute is missing on some drivers: then the handle call decides
        rc2 = lib.cuIpcGetMemHandle(ctypes.byref(h), base)
        if rc2 == 0:
            return ctypes.string_at(ctypes.addressof(h), 64)
    else:
        rc2 = -1
    hint = (" PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which allocates with "
            "cuMemCreate;" if _expandable_segments_configured() else "")
    raise ConfigError(
        f"the KV cache at {base:#x} cannot be shared with kvpoold over CUDA IPC (legacy IPC "
        f"needs cudaMalloc memory; driver codes {rc}/{capable.value}/{rc2}).{hint} Start the vLLM workers without "
        "expandable_segments:True (e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False) "
        "and without sleep mode, or use host KV memory instead.")


def device_uuid(device: Any) -> str:
    import torch
    return str(torch.cuda.get_device_properties(device).uuid)


def export_regions(tensors: Sequence[Any]) -> tuple[list[CudaRegion], list[tuple[int, int]]]:
    """One ``CudaRegion`` per backing allocation of ``tensors`` (in first-seen order) and, for
    the planner, each region's (start address, nbytes). A region spans only the bytes the
    tensors use, so the daemon's checks bound every copy to the KV cache itself."""
    if not tensors:
        raise ConfigError("no KV-cache tensors to export")
    dev = tensors[0].device
    if dev.type != "cuda" or any(t.device != dev for t in tensors):
        raise ConfigError("every KV-cache tensor of a worker must be on its one CUDA device")
    spans: dict[int, list[int]] = {}   # allocation base -> [lo, hi, size]
    for t in tensors:
        lo = t.data_ptr()
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
        hi = lo + extent * t.element_size()
        base, size = allocation_of(lo)
        span = spans.setdefault(base, [lo, hi, size])
        span[0] = min(span[0], lo)
        span[1] = max(span[1], hi)
    uuid = device_uuid(dev)
    regions, bounds = [], []
    for base, (lo, hi, _size) in spans.items():
        regions.append(CudaRegion(device_uuid=uuid, ipc_handle=ipc_handle_of(base),
                                  nbytes=hi - lo, offset_bytes=lo - base))
        bounds.append((lo, hi - lo))
    return regions, bounds


class StoreEvents:
    """Interprocess events a worker records on its compute stream so the daemon's store waits
    for the KV it copies. A ring: the daemon opens each handle once and keeps it; a re-recorded
    event only makes a later wait cover more work, never less (the daemon polls an event when
    it takes the job, so a re-record after the send can only delay that store).

    After an event's first record (torch creates it then) it is recorded through the driver on
    the raw current stream: torch's ``Event.record()`` builds a ``Stream`` object for the
    current stream, under a device guard, on every call (192-205 us of a 1024-block store's
    submit after 40 ms idle on an H200 host, against 65 us for the driver's record)."""

    def __init__(self, size: int = _STORE_EVENTS) -> None:
        import torch
        self._events = [torch.cuda.Event(interprocess=True) for _ in range(size)]
        self._handles: list[bytes] = []
        self._raw: list[int] = []                 # each event's CUevent, once torch made it
        self._next = 0
        self._device = torch.cuda.current_device
        # (a CUDA build's: what Triton reads its launch stream with)
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def record(self, stream: Any = None) -> bytes:
        """Record on ``stream`` (default: the current stream); returns the handle to send."""
        k = self._next % len(self._events)
        self._next += 1
        ev = self._events[k]
        if k < len(self._handles) and self._raw_stream is not None:
            raw = self._raw_stream(self._device()) if stream is None else stream.cuda_stream
            rc = _cuda().cuEventRecord(self._raw[k], raw)
            if rc != 0:
                raise RuntimeError(f"cuEventRecord of a store event failed (driver error {rc})")
            return self._handles[k]
        ev.record(stream)
        if k == len(self._handles):
            self._handles.append(bytes(ev.ipc_handle()))
            self._raw.append(ev.cuda_event)
        return self._handles[k]
