"""Exceptions turned into replies, in one place.

A ``KvpoolError`` becomes its ``ErrorCode`` and message. Anything else is a bug of ours: it
becomes ``INTERNAL``, logged with its traceback, and the peer stays connected (the daemon keeps
serving everyone else). Every error is counted through the ``count`` callback the caller passes
(the server's error counter and metrics). Callers: the server's dispatch, the answer to a lookup
that waited for a lower tier, and the copy jobs.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvpool.shared import protocol as p
from kvpool.shared.errors import ErrorCode, KvpoolError

log = logging.getLogger("kvpoold")


def code_and_message(exc: BaseException, count: Callable[[int], None],
                     what: str = "handling a request") -> tuple[int, str]:
    """``exc``'s error code and message for a reply, counted; INTERNAL (logged) for anything
    that is not a ``KvpoolError``."""
    if isinstance(exc, KvpoolError):
        count(exc.code)
        return int(exc.code), exc.message
    count(ErrorCode.INTERNAL)
    log.error("internal error %s", what, exc_info=exc)
    return int(ErrorCode.INTERNAL), f"internal error: {exc!r}"


def error_reply(req_id: int, exc: BaseException, count: Callable[[int], None],
                what: str = "handling a request") -> p.ErrorReply:
    """The ``ErrorReply`` to a request that failed with ``exc``."""
    return p.ErrorReply(req_id, *code_and_message(exc, count, what))


def job_failed(msg: p.StoreRequest | p.LoadRequest, exc: BaseException,
               count: Callable[[int], None]) -> p.JobDone:
    """The ``JobDone`` of a store or load job that failed with ``exc`` (nothing committed or
    loaded)."""
    code, message = code_and_message(exc, count, "in a copy job")
    return p.JobDone(msg.req_id, msg.job_id, code, message)
