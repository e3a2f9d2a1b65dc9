"""Thin wrappers over the CUDA driver API: the daemon's only low-level CUDA module.

Owns (the ABI it binds, constants and structures, is ``daemon/cuda_abi.py``): loading
``libcuda``, contexts (each device's *primary* context, the one PyTorch and Triton
use too, so pointers and streams made here are valid there), host registration of the pool,
CUDA IPC memory and event handles, streams, events, device lookup by UUID and the batched DMA
call ``cuMemcpyBatchAsync``.

Why ctypes on the driver library rather than ``cuda.bindings``: the batched copy takes three
arrays of up to ~10^5 pointers per job; ctypes hands numpy buffers over without touching each
element, where the bindings convert a Python list element by element. The driver library ships
with the driver, so this works wherever a GPU does, whichever toolkit is installed.

Must never: import torch or triton (the copy engine does that, lazily), run at import time
(``libcuda`` is loaded on first use, so this module imports on machines without CUDA), or block
anything but the calling thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np

from kvpool.daemon.cuda_abi import (  # noqa: F401 (the ABI, also read as cuda.NAME)
    BATCH3D_OP_DTYPE, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS, CU_EVENT_BLOCKING_SYNC, CU_EVENT_DISABLE_TIMING, CU_EVENT_INTERPROCESS,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    CU_MEMCPY_OPERAND_TYPE_POINTER, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEMHOSTALLOC_DEVICEMAP,
    CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_STREAM_NON_BLOCKING, IPC_HANDLE_BYTES,
    _BATCH3D_12, _BATCH3D_13, _BATCH_12, _BATCH_13, _CUuuid, _I, _IpcHandle, _MemLocation,
    _MemcpyAttributes, _P, _SIGNATURES, _SZ, _U64, _UI)

log = logging.getLogger(__name__)


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is the ``CUresult``."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code


class CudaUnavailable(RuntimeError):
    """No driver library or no device: the CUDA path is off."""




class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaUnavailable(f"no CUDA driver library: {e}") from None
        self.lib.cuGetErrorName.argtypes = [_I, ctypes.POINTER(ctypes.c_char_p)]
        version = _I()
        self.lib.cuDriverGetVersion(ctypes.byref(version))
        self.version = version.value
        self._getproc = getattr(self.lib, "cuGetProcAddress_v2", None)
        for name, argtypes in _SIGNATURES.items():
            setattr(self, name, self._resolve(name, argtypes))
        self.cuMemcpyBatchAsync = None
        if self.version >= 12080:
            try:
                self.cuMemcpyBatchAsync = self._resolve(
                    "cuMemcpyBatchAsync", _BATCH_13 if self.version >= 13000 else _BATCH_12)
            except CudaUnavailable:
                self.cuMemcpyBatchAsync = None
        self.cuMemcpy3DBatchAsync = None
        if self.version >= 12080:
            try:
                self.cuMemcpy3DBatchAsync = self._resolve(
                    "cuMemcpy3DBatchAsync",
                    _BATCH3D_13 if self.version >= 13000 else _BATCH3D_12)
            except CudaUnavailable:
                self.cuMemcpy3DBatchAsync = None
        self.check("cuInit", self.cuInit(0))

    def _resolve(self, name: str, argtypes: list):
        fn_ptr = _P()
        if self._getproc is not None:
            self._getproc.argtypes = [ctypes.c_char_p, ctypes.POINTER(_P), _I, _U64,
                                      ctypes.POINTER(_I)]
            status = _I()
            rc = self._getproc(name.encode(), ctypes.byref(fn_ptr), self.version, 0,
                               ctypes.byref(status))
            if rc != CUDA_SUCCESS or not fn_ptr.value:
                raise CudaUnavailable(f"driver has no {name}")
            fn = ctypes.CFUNCTYPE(_I, *argtypes)(fn_ptr.value)
        else:
            fn = getattr(self.lib, name, None) or getattr(self.lib, name + "_v2", None)
            if fn is None:
                raise CudaUnavailable(f"driver has no {name}")
            fn.argtypes = argtypes
            fn.restype = _I
        return fn

    def error_name(self, code: int) -> str:
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(s))
        return s.value.decode() if s.value else "CUDA_ERROR_UNKNOWN"

    def check(self, call: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(call, code, self.error_name(code))


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    """The loaded, initialised driver; raises ``CudaUnavailable`` where there is none."""
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = _Driver()
    return _driver


def is_available() -> bool:
    try:
        return device_count() > 0
    except (CudaUnavailable, CudaError):
        return False


def device_count() -> int:
    d = driver()
    n = _I()
    d.check("cuDeviceGetCount", d.cuDeviceGetCount(ctypes.byref(n)))
    return n.value


def normalize_uuid(uuid: str) -> str:
    """``GPU-3f2a…`` (nvidia-smi), ``3f2a…`` (torch) and upper case all name one device."""
    u = uuid.strip().lower()
    if u.startswith("gpu-"):
        u = u[4:]
    return u.replace("-", "")


def device_uuid(ordinal: int) -> str:
    d = driver()
    dev = _I()
    d.check("cuDeviceGet", d.cuDeviceGet(ctypes.byref(dev), ordinal))
    u = _CUuuid()
    d.check("cuDeviceGetUuid", d.cuDeviceGetUuid(ctypes.byref(u), dev))
    return bytes(u.bytes).hex()


def pci_bus_id(ordinal: int) -> str:
    """The PCI address of GPU ``ordinal`` (``0000:18:00.0``): where /sys says its NUMA node."""
    d = driver()
    dev = _I()
    d.check("cuDeviceGet", d.cuDeviceGet(ctypes.byref(dev), ordinal))
    buf = ctypes.create_string_buffer(32)
    d.check("cuDeviceGetPCIBusId", d.cuDeviceGetPCIBusId(buf, 32, dev))
    return buf.value.decode()


def device_by_uuid(uuid: str) -> int:
    """The ordinal *this process* sees for ``uuid``; ``KeyError`` if it sees no such GPU."""
    want = normalize_uuid(uuid)
    for i in range(device_count()):
        if device_uuid(i) == want:
            return i
    raise KeyError(uuid)


_contexts: dict[int, int] = {}


def use_device(ordinal: int) -> int:
    """Make ``ordinal``'s primary context current on the calling thread; returns it."""
    d = driver()
    ctx = _contexts.get(ordinal)
    if ctx is None:
        dev = _I()
        d.check("cuDeviceGet", d.cuDeviceGet(ctypes.byref(dev), ordinal))
        c = _P()
        d.check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev))
        ctx = _contexts.setdefault(ordinal, c.value)
    d.check("cuCtxSetCurrent", d.cuCtxSetCurrent(ctx))
    return ctx


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    d = driver()
    free, total = _SZ(), _SZ()
    d.check("cuMemGetInfo", d.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)))
    return free.value, total.value


# ---- host memory ---------------------------------------------------------------------------

def host_register(addr: int, nbytes: int) -> None:
    d = driver()
    d.check("cuMemHostRegister", d.cuMemHostRegister(
        addr, nbytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP))


def host_unregister(addr: int) -> None:
    d = driver()
    d.check("cuMemHostUnregister", d.cuMemHostUnregister(addr))


def host_device_pointer(addr: int) -> int:
    d = driver()
    out = _U64()
    d.check("cuMemHostGetDevicePointer", d.cuMemHostGetDevicePointer(ctypes.byref(out), addr, 0))
    return out.value


def host_alloc(nbytes: int) -> int:
    """Pinned, portable, device-mapped host memory (staging tables the kernels read over UVA)."""
    d = driver()
    p = _P()
    d.check("cuMemHostAlloc", d.cuMemHostAlloc(
        ctypes.byref(p), nbytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP))
    return p.value


def host_free(addr: int) -> None:
    driver().check("cuMemFreeHost", driver().cuMemFreeHost(addr))


# Pool pieces registered per driver call. Pinning holds the process's mmap lock: with 1 GiB
# pieces the event loop sat 180-253 ms in the kernel before its first registration whenever it
# needed the lock (growing its heap) on an H200 host (a 12 GiB pool, gpu_transfer's daemons).
# A daemon's pool's pieces meet at its extents' starts: whole extents up to this size, this
# size inside bigger extents it divides (copy_plan.registration_pieces).
PIECE_BYTES = 128 << 20


class HostRegistration:
    """Registers ``[addr, addr + nbytes)`` with CUDA in ``piece_bytes`` pieces, in address
    order, on a background thread, so a daemon with a pool of any size answers at once (8 GiB
    take ~0.3 s on the H100 host, DESIGN.md). A copy waits only until the pieces it touches are
    registered (``wait_until``), never for the whole pool.

    A failure is a warning, never a crash: pinning is a bandwidth optimisation, and DMA works on
    pageable memory at about a third of the speed (DESIGN.md: 17.4 / 13.9 GB/s).
    """

    def __init__(self, addr: int, nbytes: int, piece_bytes: int = PIECE_BYTES,
                 phase: int = 0) -> None:
        self.addr = addr
        self.nbytes = nbytes
        self.piece_bytes = piece_bytes
        # Pieces meet at ``addr + phase + k * piece_bytes`` (the first piece is ``phase`` bytes
        # where that is not 0): the pool puts them where its slots meet (copy_plan's
        # ``registration_pieces``), as no DMA copy may span two pieces.
        self.phase = phase
        self.registered: list[tuple[int, int]] = []
        self.registered_end = addr       # [addr, registered_end) is pinned
        self.error = ""
        self.elapsed_s = 0.0
        self.is_uva_identity = False     # device pointer == host pointer: kernels may use it
        self._cond = threading.Condition()
        self._finished = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self, ordinal: int = 0) -> HostRegistration:
        self._thread = threading.Thread(target=self._run, args=(ordinal,),
                                        name="kvpool-cuda-register", daemon=True)
        self._thread.start()
        return self

    def _run(self, ordinal: int) -> None:
        t0 = time.perf_counter()
        try:
            use_device(ordinal)
            end = self.addr + self.nbytes
            pos = self.addr
            while pos < end and not self._stop:
                n = min(self.piece_bytes - (pos - self.addr - self.phase) % self.piece_bytes,
                        end - pos)
                host_register(pos, n)
                if pos == self.addr:
                    self.is_uva_identity = host_device_pointer(pos) == pos
                with self._cond:
                    self.registered.append((pos, n))
                    self.registered_end = pos + n
                    self._cond.notify_all()
                pos += n
        except (CudaError, CudaUnavailable) as e:
            self.error = str(e)
            log.warning("kvpool: could not pin the pool with cudaHostRegister (%s); GPU copies "
                        "run from pageable memory at roughly a third of the PCIe bandwidth. "
                        "Check `ulimit -l` (locked memory) and the container's memlock limit.", e)
        finally:
            self.elapsed_s = time.perf_counter() - t0
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    @property
    def is_finished(self) -> bool:
        """Registration has stopped (every piece done, or it failed)."""
        return self._finished

    @property
    def is_complete(self) -> bool:
        """Every piece registered, with no error."""
        return self._finished and self.registered_end == self.addr + self.nbytes

    def wait_until(self, end_addr: int, timeout_s: float | None = None) -> bool:
        """Wait until ``[addr, end_addr)`` is pinned or registration has stopped; True if pinned."""
        with self._cond:
            self._cond.wait_for(lambda: self.registered_end >= end_addr or self._finished,
                                timeout_s)
            return self.registered_end >= end_addr

    def wait(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._finished, timeout_s)

    def unregister(self) -> None:
        self._stop = True
        self.wait()
        for a, _ in reversed(self.registered):
            try:
                host_unregister(a)
            except CudaError as e:
                log.warning("kvpool: cuMemHostUnregister failed: %s", e)
        self.registered.clear()
        self.registered_end = self.addr


# ---- IPC ------------------------------------------------------------------------------------

def ipc_open_mem(handle: bytes) -> int:
    """Map another process's allocation; returns the device pointer of its base."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC memory handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    d = driver()
    out = _U64()
    d.check("cuIpcOpenMemHandle", d.cuIpcOpenMemHandle(
        ctypes.byref(out), _IpcHandle.from_buffer_copy(handle),
        CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    return out.value


def ipc_close_mem(devptr: int) -> None:
    d = driver()
    d.check("cuIpcCloseMemHandle", d.cuIpcCloseMemHandle(devptr))


def address_range(devptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding ``devptr``."""
    d = driver()
    base, size = _U64(), _SZ()
    d.check("cuMemGetAddressRange", d.cuMemGetAddressRange(
        ctypes.byref(base), ctypes.byref(size), devptr))
    return base.value, size.value


# ---- events and streams ---------------------------------------------------------------------

def event_create(interprocess: bool = False, blocking: bool = False) -> int:
    """An event without timing; ``blocking``: a host thread that waits on it sleeps until it
    completes instead of spinning on a core (the driver's default for a few contexts)."""
    d = driver()
    ev = _P()
    flags = (CU_EVENT_DISABLE_TIMING | (CU_EVENT_INTERPROCESS if interprocess else 0)
             | (CU_EVENT_BLOCKING_SYNC if blocking else 0))
    d.check("cuEventCreate", d.cuEventCreate(ctypes.byref(ev), flags))
    return ev.value


def event_destroy(ev: int) -> None:
    d = driver()
    d.check("cuEventDestroy", d.cuEventDestroy(ev))


def event_open_ipc(handle: bytes) -> int:
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC event handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    d = driver()
    ev = _P()
    d.check("cuIpcOpenEventHandle",
            d.cuIpcOpenEventHandle(ctypes.byref(ev), _IpcHandle.from_buffer_copy(handle)))
    return ev.value


def event_record(ev: int, stream: int) -> None:
    d = driver()
    d.check("cuEventRecord", d.cuEventRecord(ev, stream))


def event_query(ev: int) -> bool:
    d = driver()
    rc = d.cuEventQuery(ev)
    if rc == CUDA_ERROR_NOT_READY:
        return False
    d.check("cuEventQuery", rc)
    return True


def event_synchronize(ev: int) -> None:
    d = driver()
    d.check("cuEventSynchronize", d.cuEventSynchronize(ev))


def stream_create() -> int:
    d = driver()
    s = _P()
    d.check("cuStreamCreate", d.cuStreamCreate(ctypes.byref(s), CU_STREAM_NON_BLOCKING))
    return s.value


def stream_destroy(stream: int) -> None:
    d = driver()
    d.check("cuStreamDestroy", d.cuStreamDestroy(stream))


def stream_wait_event(stream: int, ev: int) -> None:
    d = driver()
    d.check("cuStreamWaitEvent", d.cuStreamWaitEvent(stream, ev, 0))


def stream_synchronize(stream: int) -> None:
    d = driver()
    d.check("cuStreamSynchronize", d.cuStreamSynchronize(stream))


# ---- copies ---------------------------------------------------------------------------------

def has_memcpy_batch() -> bool:
    return driver().cuMemcpyBatchAsync is not None


_batch_attr = _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0),
                                _MemLocation(0, 0), CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
_batch_attr_idx = (_SZ * 1)(0)


def memcpy_batch_async(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                       stream: int) -> None:
    """One ``cuMemcpyBatchAsync`` over unified addresses: copy engines only, no SMs.

    The arrays must be contiguous uint64 and stay alive until the call returns (the driver
    reads them during the call, not later).
    """
    count = len(sizes)
    if count == 0:
        return
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    memcpy_batch_at(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count, stream)


def memcpy_batch_at(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> None:
    """``memcpy_batch_async`` over three arrays of ``count`` uint64 given by address (a small
    job's table is one ctypes array: numpy's ``.ctypes.data`` costs ~1.5 us an array)."""
    d = driver()
    if d.cuMemcpyBatchAsync is None:
        raise CudaUnavailable("this driver has no cuMemcpyBatchAsync (needs CUDA 12.8+)")
    args = [dsts, srcs, sizes, count,
            ctypes.addressof(_batch_attr), ctypes.addressof(_batch_attr_idx), 1]
    if d.version < 13000:
        fail_idx = _SZ(0)
        args.append(ctypes.addressof(fail_idx))
    args.append(stream)
    d.check("cuMemcpyBatchAsync", d.cuMemcpyBatchAsync(*args))


def has_memcpy_2d_batch() -> bool:
    return driver().cuMemcpy3DBatchAsync is not None


def pitched_ops(dst: np.ndarray, dst_pitch: np.ndarray, src: np.ndarray, src_pitch: np.ndarray,
                width: np.ndarray, rows: np.ndarray, depth: np.ndarray | int = 1, *,
                dst_layer: np.ndarray | None = None, src_layer: np.ndarray | None = None
                ) -> np.ndarray:
    """A ``CUDA_MEMCPY3D_BATCH_OP`` array of pitched copies: op ``i`` moves ``depth[i]`` layers
    of ``rows[i]`` rows of ``width[i]`` bytes from ``src[i]`` (rows ``src_pitch[i]`` apart,
    layers ``src_layer[i]`` rows apart) to ``dst[i]`` (likewise), all pointer operands in
    unified addressing (element = byte). Layers default to ``rows`` rows apart; with depth 1
    (the default) an op is a 2D copy."""
    n = len(dst)
    ops = np.zeros(n, dtype=BATCH3D_OP_DTYPE)
    ops["src_type"] = CU_MEMCPY_OPERAND_TYPE_POINTER
    ops["dst_type"] = CU_MEMCPY_OPERAND_TYPE_POINTER
    ops["src_ptr"] = src
    ops["dst_ptr"] = dst
    ops["src_row"] = src_pitch
    ops["dst_row"] = dst_pitch
    ops["src_layer"] = rows if src_layer is None else src_layer
    ops["dst_layer"] = rows if dst_layer is None else dst_layer
    ops["width"] = width
    ops["height"] = rows
    ops["depth"] = depth
    ops["order"] = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    return ops


def memcpy_2d_batch_async(ops: np.ndarray, stream: int) -> None:
    """One ``cuMemcpy3DBatchAsync`` over ``pitched_ops`` records: a strided run of chunks
    (every layer's K and V of one block) is one copy-engine operation instead of one per
    chunk, which is what bounds per-layer layouts (the driver's cost is per operation)."""
    if len(ops) == 0:
        return
    assert ops.dtype == BATCH3D_OP_DTYPE and ops.flags.c_contiguous
    memcpy_2d_batch_at(ops.ctypes.data, len(ops), stream)


def memcpy_2d_batch_at(ops: int, count: int, stream: int) -> None:
    """``memcpy_2d_batch_async`` over ``count`` records at address ``ops``."""
    d = driver()
    if d.cuMemcpy3DBatchAsync is None:
        raise CudaUnavailable("this driver has no cuMemcpy3DBatchAsync (needs CUDA 12.8+)")
    if d.version >= 13000:
        rc = d.cuMemcpy3DBatchAsync(count, ops, 0, stream)
    else:
        fail_idx = _SZ(0)
        rc = d.cuMemcpy3DBatchAsync(count, ops, ctypes.addressof(fail_idx), 0, stream)
    d.check("cuMemcpy3DBatchAsync", rc)


def check_memcpy_2d_batch(ordinal: int) -> str:
    """Run a small pitched round trip through ``cuMemcpy3DBatchAsync`` on ``ordinal`` and
    compare bytes; returns "" when it is right, else why not (the caller then keeps to 1D
    batches). Guards the hand-written struct layout against a driver that reads it otherwise."""
    # host rows back to back, GPU rows 3 widths apart
    return _pitched_round_trip(ordinal, "pitched", width=4096, rows=4, depth=1,
                               hpitch=4096, hlayer=4, gpitch=3 * 4096, glayer=4)


def check_memcpy_3d_batch(ordinal: int) -> str:
    """Like ``check_memcpy_2d_batch`` for 3D copies as a rank's head range uses them: layers
    of several rows further apart than their rows, and host rows further apart than they are
    wide (a slot holding two ranks' heads). "" when right, else why not (the engine then cuts
    each 3D copy into its 2D layers)."""
    return _pitched_round_trip(ordinal, "3D pitched", width=1024, rows=4, depth=3,
                               hpitch=2048, hlayer=4, gpitch=1024, glayer=12)


def _pitched_round_trip(ordinal: int, what: str, *, width: int, rows: int, depth: int,
                        hpitch: int, hlayer: int, gpitch: int, glayer: int) -> str:
    """Host -> GPU by one pitched op, checked row by row with plain 1D copies (known good) from
    where each row must have landed, then GPU -> host by one pitched op, checked again."""
    if not has_memcpy_2d_batch():
        return "no cuMemcpy3DBatchAsync in this driver"
    use_device(ordinal)
    hbytes, gbytes = hpitch * hlayer * depth, gpitch * glayer * depth
    src = host_alloc(hbytes)
    back = host_alloc(hbytes)
    dev = mem_alloc(gbytes)
    stream = stream_create()
    try:
        pattern = (np.arange(hbytes, dtype=np.uint32) * 2654435761 >> 9).astype(np.uint8)
        ctypes.memmove(src, pattern.ctypes.data, hbytes)
        ctypes.memset(back, 0, hbytes)
        one = np.ones(1, dtype=np.uint64)
        driver().check("cuMemsetD8Async", driver().cuMemsetD8Async(dev, 0x5A, gbytes, stream))
        memcpy_2d_batch_async(pitched_ops(one * dev, one * gpitch, one * src, one * hpitch,
                                          one * width, one * rows, one * depth,
                                          dst_layer=one * glayer, src_layer=one * hlayer), stream)
        cells = [((z * glayer + y) * gpitch, (z * hlayer + y) * hpitch)
                 for z in range(depth) for y in range(rows)]
        for g, h in cells:
            memcpy_async(back + h, dev + g, width, stream)
        stream_synchronize(stream)
        got = np.ctypeslib.as_array((ctypes.c_uint8 * hbytes).from_address(back))
        want = np.zeros(hbytes, dtype=np.uint8)
        for _, h in cells:
            want[h:h + width] = pattern[h:h + width]
        if not np.array_equal(got, want):
            return f"{what} host->device copy moved the wrong bytes"
        ctypes.memset(back, 0, hbytes)
        memcpy_2d_batch_async(pitched_ops(one * back, one * hpitch, one * dev, one * gpitch,
                                          one * width, one * rows, one * depth,
                                          dst_layer=one * hlayer, src_layer=one * glayer), stream)
        stream_synchronize(stream)
        if not np.array_equal(got, want):
            return f"{what} device->host copy moved the wrong bytes"
        return ""
    except CudaError as e:
        return str(e)
    finally:
        stream_destroy(stream)
        mem_free(dev)
        host_free(src)
        host_free(back)


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    d = driver()
    d.check("cuMemcpyAsync", d.cuMemcpyAsync(dst, src, nbytes, stream))


def mem_alloc(nbytes: int) -> int:
    d = driver()
    p = _U64()
    d.check("cuMemAlloc", d.cuMemAlloc(ctypes.byref(p), nbytes))
    return p.value


def mem_free(devptr: int) -> None:
    d = driver()
    d.check("cuMemFree", d.cuMemFree(devptr))
