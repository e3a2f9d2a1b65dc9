"""``SchedulerClient``: what an engine's scheduler uses to find, pin and prepare blocks.

Called from the scheduler's thread. Every method is one round trip bounded by ``timeout_ms``
and raises ``DaemonUnavailable`` past it (callers degrade: zero hits, no stores).
``lookup_start`` is the non-blocking form for schedulers that must never wait: it returns a
``PendingCall`` to poll on later steps.
"""

from __future__ import annotations

import time
from typing import Sequence

from kvpool.client.transport import Transport
from kvpool.shared import protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import DaemonUnavailable, error_from_code


class PendingCall:
    """A request in flight. ``result()`` returns its reply, None while waiting, or raises."""

    def __init__(self, client: "SchedulerClient", req_id: int, deadline: float) -> None:
        self._client = client
        self.req_id = req_id
        self._deadline = deadline

    def result(self) -> p.Reply | None:
        return self._client._collect(self)


class SchedulerClient:
    def __init__(self, config: ClientConfig, name: str = "", engine_id: str = "",
                 heartbeat: bool = True) -> None:
        self._t = Transport(config, p.Role.SCHEDULER, name, engine_id, heartbeat=heartbeat)
        self._timeout_s = config.timeout_ms / 1000
        self._replies: dict[int, p.Reply] = {}
        self._pending: set[int] = set()

    def lookup(self, namespace: bytes, key_lists: Sequence[Sequence[bytes]],
               pin: bool = False) -> p.LookupReply:
        """Leading hits of many requests in one round trip; with ``pin``, one lease each."""
        reply = self._t.call(lambda rid: p.LookupRequest(rid, namespace, key_lists, pin))
        assert isinstance(reply, p.LookupReply)
        return reply

    def lookup_start(self, namespace: bytes, key_lists: Sequence[Sequence[bytes]],
                     pin: bool = False) -> PendingCall:
        """Send a lookup and return at once; poll ``PendingCall.result()`` later."""
        req_id = self._t.send(lambda rid: p.LookupRequest(rid, namespace, key_lists, pin))
        self._pending.add(req_id)
        return PendingCall(self, req_id, time.monotonic() + self._timeout_s)

    def prepare_store(self, namespace: bytes, keys: Sequence[bytes]) -> list[int]:
        """Per key: a slot ref to store into, ``SLOT_PRESENT`` (committed or already in flight),
        or ``SLOT_NO_SPACE``. Raises ``PoolFull`` when no key found room."""
        reply = self._t.call(lambda rid: p.PrepareStoreRequest(rid, namespace, list(keys)))
        assert isinstance(reply, p.PrepareStoreReply)
        return reply.slots

    def abort_store(self, slots: Sequence[int]) -> int:
        return self._ok(lambda rid: p.AbortStoreRequest(rid, list(slots)))

    def release(self, leases: Sequence[int]) -> int:
        return self._ok(lambda rid: p.ReleaseRequest(rid, [x for x in leases if x]))

    def reset(self, namespace: bytes) -> int:
        return self._ok(lambda rid: p.ResetRequest(rid, namespace))

    def info(self) -> p.PoolInfo:
        reply = self._t.call(lambda rid: p.InfoRequest(rid))
        assert isinstance(reply, p.InfoReply)
        return reply.info

    def ping(self) -> p.Pong:
        reply = self._t.call(lambda rid: p.Ping(rid))
        assert isinstance(reply, p.Pong)
        return reply

    @property
    def owner_id(self) -> int | None:
        return self._t.owner_id

    def close(self) -> None:
        self._t.close()

    # ---- internals -------------------------------------------------------------------------

    def _ok(self, make) -> int:
        reply = self._t.call(make)
        assert isinstance(reply, p.OkReply)
        return reply.count

    def _collect(self, call: PendingCall) -> p.Reply | None:
        for reply in self._t.drain():
            if reply.req_id in self._pending:
                self._pending.discard(reply.req_id)
                self._replies[reply.req_id] = reply
        reply = self._replies.pop(call.req_id, None)
        if reply is None:
            if (self._t.is_stale or self._t.connection_lost()
                    or time.monotonic() > call._deadline):
                self._pending.discard(call.req_id)
                self._t.disconnect()
                raise DaemonUnavailable("kvpoold did not answer the lookup in time")
            return None
        if isinstance(reply, p.ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply
