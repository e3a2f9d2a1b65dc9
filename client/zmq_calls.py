"""Non-blocking ZeroMQ send and receive that keep the GIL.

pyzmq releases the GIL around every ``send`` and ``recv``, even non-blocking ones. In a
process where another thread runs Python (vLLM's engine core serialises outputs on its own
threads), giving the GIL up costs the caller up to the interpreter's switch interval (5 ms) to
get it back: measured on a 2-core host, a 584-byte ``send(NOBLOCK)`` took p50 60 us and p99
16 ms next to one busy thread, against 22 us / 106 us through libzmq with the GIL held. The
scheduler's thread must never wait like that, so its transport calls libzmq's ``zmq_send`` /
``zmq_msg_recv`` with ``ZMQ_DONTWAIT`` through ``ctypes.PyDLL`` (which does not release the
GIL): they return at once either way.

Owns nothing but these two calls. Uses the libzmq that pyzmq itself loaded (found in
``/proc/self/maps``), since a socket handle belongs to one library instance; where that is not
possible (another OS, a statically linked pyzmq) ``HeldSocket`` falls back to pyzmq's calls.
"""

from __future__ import annotations

import ctypes
import errno
import logging

import zmq

log = logging.getLogger(__name__)


class _Msg(ctypes.Structure):
    _fields_ = [("_", ctypes.c_ubyte * 64)]    # zmq_msg_t: 64 opaque bytes


def _load() -> ctypes.PyDLL | None:
    import zmq.backend.cython._zmq  # noqa: F401  (makes sure pyzmq's libzmq is mapped)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libzmq" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.PyDLL(path)
            lib.zmq_send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                     ctypes.c_int]
            lib.zmq_send.restype = ctypes.c_int
            lib.zmq_msg_init.argtypes = [ctypes.POINTER(_Msg)]
            lib.zmq_msg_recv.argtypes = [ctypes.POINTER(_Msg), ctypes.c_void_p, ctypes.c_int]
            lib.zmq_msg_recv.restype = ctypes.c_int
            lib.zmq_msg_data.argtypes = [ctypes.POINTER(_Msg)]
            lib.zmq_msg_data.restype = ctypes.c_void_p
            lib.zmq_msg_close.argtypes = [ctypes.POINTER(_Msg)]
            lib.zmq_errno.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        return lib
    return None


_lib = _load()
if _lib is None:
    log.debug("libzmq not found in this process's maps: pyzmq's send/recv release the GIL")


class HeldSocket:
    """``send``/``recv`` of single frames on ``sock`` without waiting and without releasing
    the GIL. Valid while ``sock`` is open; its owner drops both together."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._handle = ctypes.c_void_p(sock.underlying) if _lib is not None else None
        self._msg = _Msg()
        self._msg_ref = ctypes.byref(self._msg)

    def send(self, data: bytes) -> bool:
        """Queue one frame; False if it cannot be queued now (no peer, or the queue full)."""
        if self._handle is None:
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True
        if _lib.zmq_send(self._handle, data, len(data), zmq.DONTWAIT) >= 0:
            return True
        err = _lib.zmq_errno()
        if err == errno.EAGAIN:
            return False
        raise zmq.ZMQError(err)

    def recv(self) -> bytes | None:
        """One waiting frame, or None."""
        if self._handle is None:
            try:
                return self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
        ref = self._msg_ref
        _lib.zmq_msg_init(ref)
        n = _lib.zmq_msg_recv(ref, self._handle, zmq.DONTWAIT)
        if n < 0:
            err = _lib.zmq_errno()
            _lib.zmq_msg_close(ref)
            if err == errno.EAGAIN:
                return None
            raise zmq.ZMQError(err)
        data = ctypes.string_at(_lib.zmq_msg_data(ref), n)
        _lib.zmq_msg_close(ref)
        return data
