"""The CUDA driver ABI kvpool binds (``daemon/cuda.py`` calls it): flag and error values,
the ctypes structures, each entry point's argument types, and the batched 3D copy's op record
as a numpy dtype. Data only: nothing here loads the driver."""

from __future__ import annotations

import ctypes

import numpy as np

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4
CU_STREAM_NON_BLOCKING = 0x1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 18

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

IPC_HANDLE_BYTES = 64


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_SZ = ctypes.c_size_t
_I = ctypes.c_int
_UI = ctypes.c_uint

# name -> argtypes. Resolved through cuGetProcAddress with the driver's own version, so each
# name binds the ABI that the installed driver documents (e.g. cuMemHostRegister -> _v2).
_SIGNATURES: dict[str, list] = {
    "cuInit": [_UI],
    "cuDriverGetVersion": [ctypes.POINTER(_I)],
    "cuDeviceGetCount": [ctypes.POINTER(_I)],
    "cuDeviceGet": [ctypes.POINTER(_I), _I],
    "cuDeviceGetUuid": [ctypes.POINTER(_CUuuid), _I],
    "cuDeviceGetPCIBusId": [ctypes.c_char_p, _I, _I],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), _I],
    "cuCtxSetCurrent": [_P],
    "cuMemHostRegister": [_P, _SZ, _UI],
    "cuMemHostUnregister": [_P],
    "cuMemHostGetDevicePointer": [ctypes.POINTER(_U64), _P, _UI],
    "cuMemHostAlloc": [ctypes.POINTER(_P), _SZ, _UI],
    "cuMemFreeHost": [_P],
    "cuMemAlloc": [ctypes.POINTER(_U64), _SZ],
    "cuMemFree": [_U64],
    "cuMemGetInfo": [ctypes.POINTER(_SZ), ctypes.POINTER(_SZ)],
    "cuMemGetAddressRange": [ctypes.POINTER(_U64), ctypes.POINTER(_SZ), _U64],
    "cuPointerGetAttribute": [_P, _I, _U64],
    "cuIpcOpenMemHandle": [ctypes.POINTER(_U64), _IpcHandle, _UI],
    "cuIpcCloseMemHandle": [_U64],
    "cuIpcOpenEventHandle": [ctypes.POINTER(_P), _IpcHandle],
    "cuEventCreate": [ctypes.POINTER(_P), _UI],
    "cuEventDestroy": [_P],
    "cuEventRecord": [_P, _P],
    "cuEventQuery": [_P],
    "cuEventSynchronize": [_P],
    "cuStreamCreate": [ctypes.POINTER(_P), _UI],
    "cuStreamDestroy": [_P],
    "cuStreamWaitEvent": [_P, _P, _UI],
    "cuStreamSynchronize": [_P],
    "cuMemcpyAsync": [_U64, _U64, _SZ, _P],
    "cuMemsetD8Async": [_U64, ctypes.c_ubyte, _SZ, _P],
}

# CUDA 12.8 introduced the batched copy with a trailing ``failIdx``; 13.0 dropped it.
_BATCH_12 = [_P, _P, _P, _SZ, _P, _P, _SZ, _P, _P]
_BATCH_13 = [_P, _P, _P, _SZ, _P, _P, _SZ, _P]
# cuMemcpy3DBatchAsync(numOps, opList, [failIdx,] flags, stream): same history.
_BATCH3D_12 = [_SZ, _P, _P, ctypes.c_ulonglong, _P]
_BATCH3D_13 = [_SZ, _P, ctypes.c_ulonglong, _P]

# CUDA_MEMCPY3D_BATCH_OP as a numpy record, so a job's whole op list is built with array
# arithmetic: two CUmemcpy3DOperand (type, pad, {ptr, rowLength, layerHeight, locHint}) of
# 40 bytes each, a CUextent3D, srcAccessOrder and flags: 112 bytes, 8-aligned.
CU_MEMCPY_OPERAND_TYPE_POINTER = 0x1
BATCH3D_OP_DTYPE = np.dtype({
    "names": ["src_type", "src_ptr", "src_row", "src_layer", "dst_type", "dst_ptr", "dst_row",
              "dst_layer", "width", "height", "depth", "order", "flags"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8",
                "<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 40, 48, 56, 64, 80, 88, 96, 104, 108],
    "itemsize": 112})
