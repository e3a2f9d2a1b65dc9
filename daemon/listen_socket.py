"""The daemon's ROUTER socket: one daemon per socket path (a lock beside it), bound with the
configured mode from the first instant (a umask around the bind, not a chmod after it)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import zmq

from kvpool.shared.config import DaemonConfig
from kvpool.shared.errors import KvpoolError


class SocketBusy(KvpoolError):
    """Another live daemon serves this socket path."""


def bind_router(config: DaemonConfig) -> tuple[zmq.Context, zmq.Socket, int]:
    """(context, bound ROUTER socket, lock fd); ``SocketBusy`` while another daemon holds the
    socket's lock (libzmq would silently take over a live daemon's socket file)."""
    path = Path(config.socket_path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    lock_fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise SocketBusy(f"another daemon is serving {path}") from None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # replies to vanished peers are dropped
    # A hard cap well above the soft limit: frames between the two get a TOO_LARGE reply,
    # beyond it libzmq drops the connection rather than buffer them.
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_request_bytes)
    old = os.umask(0o777 ^ config.socket_mode_bits)
    try:
        sock.bind(f"ipc://{path}")
    except BaseException:
        sock.close(linger=0)
        ctx.term()
        os.close(lock_fd)
        raise
    finally:
        os.umask(old)
    os.chmod(path, config.socket_mode_bits)
    return ctx, sock, lock_fd
