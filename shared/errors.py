"""Error codes on the wire and the exception hierarchy both sides raise.

Each ``KvpoolError`` subclass has exactly one ``ErrorCode``. The daemon turns exceptions into
``ErrorReply(code, message)`` in one place (the server's dispatch); the client turns an
``ErrorReply`` back into the matching subclass with ``error_from_code``. ``DaemonUnavailable``
lives only on the client side and is never sent.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Wire error codes. Values are part of the protocol: append, never renumber."""

    PROTOCOL = 1          # malformed frame, wrong types, unknown message
    VERSION_MISMATCH = 2  # Hello with another PROTOCOL_VERSION
    UNKNOWN_ID = 3        # registration, lease, slot, job or namespace the daemon does not know
    OUT_OF_RANGE = 4      # block id or slot ref outside what was registered
    TOO_LARGE = 5         # frame or request over the daemon's limits
    POOL_FULL = 6         # nothing evictable: every slot is writing or pinned
    LEASE_EXPIRED = 7     # a slot was evicted or its lease ran out before the load
    LAYOUT_MISMATCH = 8   # registration disagrees with the namespace's layout
    CONFIG = 9            # invalid configuration
    HELLO_REQUIRED = 10   # peer unknown to this daemon (first contact or daemon restart)
    ABORTED = 11          # job dropped: its worker went away or the daemon is shutting down
    BLOCK_LOST = 12       # a block could not be brought back from a lower tier (failed its
                          # checksum, or the tier failed): the engine recomputes it
    PERMISSION = 13       # peer not allowed (allow_uid/allow_gid), or asked for what it may not
    INTERNAL = 99         # a bug in the daemon; logged with its traceback there


class KvpoolError(Exception):
    """Base of every error kvpool raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message or self.__class__.__name__


class ProtocolError(KvpoolError):
    code = ErrorCode.PROTOCOL


class VersionMismatch(ProtocolError):
    code = ErrorCode.VERSION_MISMATCH


class UnknownId(KvpoolError):
    code = ErrorCode.UNKNOWN_ID


class OutOfRange(KvpoolError):
    code = ErrorCode.OUT_OF_RANGE


class TooLarge(ProtocolError):
    code = ErrorCode.TOO_LARGE


class PoolFull(KvpoolError):
    code = ErrorCode.POOL_FULL


class LeaseExpired(KvpoolError):
    code = ErrorCode.LEASE_EXPIRED


class LayoutMismatch(KvpoolError):
    code = ErrorCode.LAYOUT_MISMATCH


class ConfigError(KvpoolError):
    code = ErrorCode.CONFIG


class HelloRequired(KvpoolError):
    code = ErrorCode.HELLO_REQUIRED


class Aborted(KvpoolError):
    code = ErrorCode.ABORTED


class BlockLost(KvpoolError):
    code = ErrorCode.BLOCK_LOST


class PermissionDenied(KvpoolError):
    code = ErrorCode.PERMISSION


class InternalError(KvpoolError):
    code = ErrorCode.INTERNAL


class DaemonUnavailable(KvpoolError):
    """Client side only: the daemon did not answer within the timeout or is not running.

    Never sent on the wire. Callers inside an engine catch it and degrade (zero hits, stores
    skipped, loads failed) instead of failing the engine.
    """


class SocketForbidden(DaemonUnavailable):
    """Client side only: the daemon's socket exists, but this user may not open it (its file
    mode or directory). Unlike other unavailability, waiting does not help."""


_BY_CODE: dict[int, type[KvpoolError]] = {
    cls.code: cls
    for cls in (ProtocolError, VersionMismatch, UnknownId, OutOfRange, TooLarge, PoolFull,
                LeaseExpired, LayoutMismatch, ConfigError, HelloRequired, Aborted, BlockLost,
                PermissionDenied,
                InternalError)
}


def error_from_code(code: int, message: str) -> KvpoolError:
    """The exception for a wire ``ErrorReply``; unknown codes become ``InternalError``."""
    return _BY_CODE.get(code, InternalError)(message)
