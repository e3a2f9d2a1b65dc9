"""One connection to kvpoold: a DEALER socket, request ids, timeouts, reconnects, heartbeats.

Contract for callers (the worker and scheduler clients, one ``Transport`` each, used from one
thread):

- ``call(make)`` sends one request and returns its reply, or raises the ``KvpoolError`` of an
  ``ErrorReply``, or ``DaemonUnavailable`` when no reply came within ``timeout_ms``. It never
  waits longer. After a failure the next attempts fail fast until the backoff has passed, so an
  engine whose daemon is gone pays at most one timeout per backoff period.
- ``send(make)`` sends without waiting; replies arrive through ``drain()``, never blocking.
- The connection (Hello) is made lazily and remade after a timeout or a daemon restart; the
  ``on_connect`` hook lets the owner replay its registrations then. ``ensure_connected`` waits
  for the Hello's answer (bounded); ``connect_nowait`` never waits: it sends the Hello and
  answers False until a later ``drain`` has seen the reply, for callers that must never block
  (the scheduler). ``epoch`` counts connections, so owners can tell that what the daemon granted
  to an earlier one (slots, leases) is gone.
- A background thread with its own socket sends heartbeats so the daemon can release what a
  dead process held; it also notices a restarted or vanished daemon (``is_stale``).
- ``send`` and ``drain`` go through ``zmq_calls.HeldSocket``: they never release the GIL, so a
  caller on a scheduler thread never waits for another thread to hand it back.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Callable

import zmq

from kvpool.client.zmq_calls import HeldSocket
from kvpool.shared import protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import (DaemonUnavailable, HelloRequired, KvpoolError,
                                  error_from_code)

log = logging.getLogger(__name__)


class Transport:
    def __init__(self, config: ClientConfig, role: p.Role, name: str = "", engine_id: str = "",
                 on_connect: Callable[[], None] | None = None, heartbeat: bool = True) -> None:
        self.config = config
        self.role = role
        self.name = name
        self.engine_id = engine_id
        self.on_connect = on_connect
        self.owner_id: int | None = None
        self.daemon_id: str | None = None
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._held: HeldSocket | None = None
        self._ids = itertools.count(1)
        self._retry_at = 0.0
        self._backoff_s = config.reconnect_backoff_ms / 1000
        self._unsolicited: list[p.Reply] = []
        self._heartbeat = _Heartbeat(self) if heartbeat else None
        self.epoch = 0                       # successful connections so far
        # A connection being made without waiting: the socket is open since _connect_deadline
        # - timeout; the Hello is sent (_hello_id) once the socket is writable.
        self._hello_id: int | None = None
        self._connect_deadline = 0.0
        self._hello_error: KvpoolError | None = None

    # ---- public ----------------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def call(self, make: Callable[[int], p.Request], timeout_ms: int | None = None) -> p.Reply:
        """Send ``make(req_id)`` and wait for its reply (see module docstring)."""
        for attempt in (0, 1):
            self.ensure_connected()
            req_id = self.next_id()
            self._send(make(req_id))
            try:
                return self._await(req_id, timeout_ms)
            except HelloRequired:
                # The daemon restarted under us: reconnect (replaying registrations) and retry.
                self.disconnect(backoff=False)
                if attempt:
                    raise DaemonUnavailable("daemon keeps forgetting this client") from None
        raise AssertionError("unreachable")

    def send(self, make: Callable[[int], p.Request]) -> int:
        """Send without waiting for the reply; returns the req_id."""
        self.ensure_connected()
        req_id = self.next_id()
        self._send(make(req_id))
        return req_id

    def drain(self) -> list[p.Reply]:
        """Every reply that has arrived, without waiting (the answer to a Hello sent by
        ``connect_nowait`` is taken in here, not returned)."""
        out, self._unsolicited = self._unsolicited, []
        held = self._held
        if held is None:
            return out
        while True:
            try:
                frame = held.recv()
            except zmq.ZMQError:
                self.disconnect()
                return out
            if frame is None:
                return out
            reply = p.decode_reply(frame)
            if self._hello_id is not None and reply.req_id == self._hello_id:
                self._hello_answered(reply)
                continue
            out.append(reply)

    def connect_nowait(self) -> bool:
        """Make progress on connecting without waiting; True once connected.

        Raises ``DaemonUnavailable`` inside the reconnect backoff, when no daemon listens, or
        when the Hello went unanswered for ``timeout_ms`` (the socket is dropped then), and the
        daemon's refusal of the Hello (``VersionMismatch``). Replies that arrive meanwhile stay
        queued for ``drain``.
        """
        if self.is_stale:
            self.disconnect(backoff=False)
        if self.is_connected:
            return True
        if self._hello_error is not None:
            err, self._hello_error = self._hello_error, None
            self.disconnect()
            raise err
        now = time.monotonic()
        timeout_s = self.config.timeout_ms / 1000
        if self._sock is None:
            if now < self._retry_at:
                raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} unavailable; "
                                        f"next try in {(self._retry_at - now) * 1000:.0f} ms")
            self._open_socket()
            self._connect_deadline = now + timeout_s
        if self._hello_id is None:
            assert self._sock is not None
            if self._sock.poll(0, zmq.POLLOUT):
                hello_id = self.next_id()
                self._send(p.Hello(hello_id, p.PROTOCOL_VERSION, self.role, self.name,
                                   os.getpid(), self.engine_id))
                self._hello_id = hello_id
                self._connect_deadline = now + timeout_s    # for the answer, from now
                return False
            if now > self._connect_deadline:
                self.disconnect()
                raise DaemonUnavailable(f"kvpoold not reachable at {self.config.socket_path} "
                                        f"within {self.config.timeout_ms} ms")
            return False
        self._unsolicited.extend(self.drain())
        if self.is_connected:
            return True
        if self._hello_error is not None or self._hello_id is None:   # refused, or read late
            return self.connect_nowait()
        if now > self._connect_deadline:
            self.disconnect()
            raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} did not answer the "
                                    f"Hello within {self.config.timeout_ms} ms")
        return False

    @property
    def is_connecting(self) -> bool:
        """A connection is being made by ``connect_nowait`` (socket open, no answer yet)."""
        return self._sock is not None and self.owner_id is None

    def wait_readable(self, timeout_s: float) -> bool:
        """Block until a reply is waiting or ``timeout_s`` passed (for callers with nothing
        else to do, such as ``WorkerClient.wait``); True if something arrived."""
        if self._unsolicited:
            return True
        if self._sock is None:
            time.sleep(min(timeout_s, 0.01))
            return False
        return bool(self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    @property
    def is_connected(self) -> bool:
        return self._sock is not None and self.owner_id is not None

    @property
    def is_stale(self) -> bool:
        """The heartbeat thread saw the daemon vanish or restart since we connected."""
        hb = self._heartbeat
        return hb is not None and hb.is_stale

    def ensure_connected(self) -> None:
        if self.is_stale:
            self.disconnect(backoff=False)
        if self.is_connected:
            return
        if self._sock is not None:   # a connect_nowait in progress: start over, waiting
            self.disconnect(backoff=False)
        now = time.monotonic()
        if now < self._retry_at:
            raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} unavailable; next "
                                    f"try in {(self._retry_at - now) * 1000:.0f} ms")
        self._open_socket()
        try:
            reply = self._hello()
        except DaemonUnavailable:
            self.disconnect()
            raise
        self._connected(reply)

    def _connected(self, reply: p.HelloReply) -> None:
        self._hello_id = None
        self.owner_id = reply.owner_id
        self.daemon_id = reply.daemon_id
        self.epoch += 1
        self._backoff_s = self.config.reconnect_backoff_ms / 1000
        if self._heartbeat is not None:
            self._heartbeat.watch(reply.owner_id, reply.daemon_id, reply.heartbeat_interval_ms)
        if self.on_connect is not None:
            self.on_connect()

    def _hello_answered(self, reply: p.Reply) -> None:
        if isinstance(reply, p.HelloReply):
            if time.monotonic() > self._connect_deadline:
                # Read too late (nobody called for a while): no heartbeat ran meanwhile, so
                # the daemon may have released this owner already. Say Hello again on this
                # socket (the daemon replaces the owner of a connection that says Hello).
                self._hello_id = None
                return
            self._connected(reply)
        else:
            self._hello_id = None
            self._hello_error = (error_from_code(reply.code, reply.message)
                                 if isinstance(reply, p.ErrorReply) else
                                 DaemonUnavailable(f"unexpected answer to Hello: {reply!r}"))

    def disconnect(self, backoff: bool = True) -> None:
        """Drop the socket (and anything queued on it); the next call reconnects."""
        if self._sock is not None:
            self._held = None
            self._sock.close(linger=0)
            self._sock = None
        self.owner_id = None
        self._hello_id = None
        if self._heartbeat is not None:
            self._heartbeat.watch(None, None, 0)
        if backoff:
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(max(self._backoff_s * 2, 0.001),
                                  self.config.reconnect_backoff_max_ms / 1000)
        else:
            self._retry_at = 0.0

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.disconnect(backoff=False)

    # ---- internals -------------------------------------------------------------------------

    def _open_socket(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE: never queue requests for a daemon that is not there; fail fast instead.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.IDENTITY, os.urandom(8))
        sock.connect(f"ipc://{self.config.socket_path}")
        self._sock = sock
        self._held = HeldSocket(sock)

    def _hello(self) -> p.HelloReply:
        assert self._sock is not None
        if not self._sock.poll(self.config.timeout_ms, zmq.POLLOUT):
            raise DaemonUnavailable(f"kvpoold not reachable at {self.config.socket_path} "
                                    f"within {self.config.timeout_ms} ms")
        req_id = self.next_id()
        self._send(p.Hello(req_id, p.PROTOCOL_VERSION, self.role, self.name, os.getpid(),
                           self.engine_id))
        reply = self._await(req_id, None)
        assert isinstance(reply, p.HelloReply)
        return reply

    def _send(self, msg: p.Request) -> None:
        assert self._held is not None
        try:
            sent = self._held.send(p.encode(msg))
        except zmq.ZMQError:
            sent = False
        if not sent:
            self.disconnect()
            raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} is not "
                                    f"accepting requests")

    def _await(self, req_id: int, timeout_ms: int | None) -> p.Reply:
        assert self._sock is not None
        sock = self._sock
        deadline = time.monotonic() + (timeout_ms or self.config.timeout_ms) / 1000
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms, zmq.POLLIN):
                self.disconnect()
                raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} did not answer "
                                        f"within {timeout_ms or self.config.timeout_ms} ms")
            reply = p.decode_reply(sock.recv())
            if reply.req_id == req_id:
                if isinstance(reply, p.ErrorReply):
                    raise error_from_code(reply.code, reply.message)
                return reply
            self._unsolicited.append(reply)   # job completions and late replies


class _Heartbeat:
    """Sends ``Heartbeat(owner_id)`` every interval from its own socket and thread.

    A daemon that stops answering for ``timeout_ms`` or answers with another daemon id marks the
    transport stale, so its owner reconnects (and fails its in-flight jobs) on its next call.
    """

    def __init__(self, transport: Transport) -> None:
        self._t = transport
        self._owner: int | None = None
        self._daemon: str | None = None
        self._interval_s = 0.1
        self._cond = threading.Condition()
        self._stop = False
        self.is_stale = False
        self._thread: threading.Thread | None = None

    def watch(self, owner_id: int | None, daemon_id: str | None, interval_ms: int) -> None:
        with self._cond:
            self._owner, self._daemon = owner_id, daemon_id
            self._interval_s = max(interval_ms, 10) / 1000
            self.is_stale = False
            self._cond.notify()
        if owner_id is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpool-heartbeat",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        ctx = self._t._ctx
        sock = None
        last_reply = time.monotonic()
        watched: tuple[int | None, str | None] = (None, None)
        next_id = 1
        first_id = 1   # replies to heartbeats sent before the current connection are stale
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    owner, daemon, interval = self._owner, self._daemon, self._interval_s
                    if owner is None:
                        if sock is not None:
                            sock.close(linger=0)
                            sock = None
                        self._cond.wait()
                        last_reply = time.monotonic()
                        continue
                if (owner, daemon) != watched:
                    # A new connection gets a full timeout before silence counts against it,
                    # and answers to heartbeats of the old one say nothing about it.
                    watched = (owner, daemon)
                    last_reply = time.monotonic()
                    first_id = next_id
                if sock is None:
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.IMMEDIATE, 1)
                    sock.connect(f"ipc://{self._t.config.socket_path}")
                try:
                    sock.send(p.encode(p.Heartbeat(next_id, owner)), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                next_id += 1
                while sock.poll(0, zmq.POLLIN):
                    reply = p.decode_reply(sock.recv())
                    if reply.req_id < first_id:
                        continue
                    last_reply = time.monotonic()
                    if isinstance(reply, p.ErrorReply) or (
                            isinstance(reply, p.HeartbeatReply) and reply.daemon_id != daemon):
                        self._mark_stale(owner, daemon)
                if time.monotonic() - last_reply > self._t.config.timeout_ms / 1000:
                    self._mark_stale(owner, daemon)
                    last_reply = time.monotonic()
                with self._cond:
                    if not self._stop:
                        self._cond.wait(interval)
        except Exception:   # never let the heartbeat thread take anything down
            log.exception("kvpool heartbeat thread stopped")
        finally:
            if sock is not None:
                sock.close(linger=0)

    def _mark_stale(self, owner: int, daemon: str | None) -> None:
        # Owner ids restart at 1 in every daemon: only the (owner, daemon) pair this verdict
        # was formed under may be marked, never a connection made since.
        with self._cond:
            if self._owner == owner and self._daemon == daemon:
                self.is_stale = True
