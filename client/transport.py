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

import errno
import itertools
import logging
import math
import os
import socket
import threading
import time
from typing import Callable

import zmq

from kvpool.client.zmq_calls import HeldSocket
from kvpool.shared import protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import (DaemonUnavailable, HelloRequired, KvpoolError,
                                  SocketForbidden, error_from_code)
from kvpool.shared.zmq_context import shared_context

log = logging.getLogger(__name__)

# While connecting, how often to look for a sign that the daemon is gone.
_CONNECT_CHECK_MS = 20
# A refused probe is looked at again this many times, this far apart (a daemon between creating
# its socket and listening on it refuses too): at most 40 ms for a daemon that is really gone.
_PROBE_TRIES = 3
_PROBE_RETRY_S = 0.02
# How long ``close`` waits for the daemon to acknowledge the goodbye.
_BYE_WAIT_MS = 200
# ``connect_nowait`` on a connection that is up reads the monitor socket at most this often: the
# scheduler asks every step, and in its process each read costs tens of us (cold libzmq). A
# daemon restart is seen this much later at worst; a request sent meanwhile reaches the new
# daemon, which answers HelloRequired, handled as a restart.
_LOST_CHECK_S = 0.005


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
        self.index_segment = ""          # the daemon's shared-memory index, from its HelloReply
        self._ctx = shared_context()
        self._sock: zmq.Socket | None = None
        self._held: HeldSocket | None = None
        # ZeroMQ's events for our socket: DISCONNECTED (the daemon closed the connection: it
        # died or restarted, so nothing sent on it will be answered) or CONNECT_RETRIED (it is
        # not there).
        self._monitor: zmq.Socket | None = None
        self._held_monitor: HeldSocket | None = None
        self._lost = False
        self._lost_checked_at = float("-inf")
        # Replies the daemon owes on this connection (one per request sent; see ``drain``).
        self._owed = 0
        self._poller = zmq.Poller()
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
            except (HelloRequired, _ConnectionLost):
                # The daemon restarted under us: reconnect (replaying registrations) and retry.
                self.disconnect(backoff=False)
                if attempt:
                    raise DaemonUnavailable("daemon keeps forgetting this client") from None
        raise AssertionError("unreachable")

    def send(self, make: Callable[[int], p.Request]) -> int:
        """Send without waiting for the reply; returns the req_id."""
        self.ensure_connected()
        return self.send_connected(make)

    def send_connected(self, make: Callable[[int], p.Request]) -> int:
        """``send`` for a caller that has just seen ``connect_nowait`` return True: the
        connection's checks are not made twice (each reads the monitor socket, several us, and
        the scheduler's step sends several requests)."""
        req_id = self.next_id()
        self._send(make(req_id))
        return req_id

    def connection_lost(self) -> bool:
        """Whether the daemon closed our connection (died or restarted) since it was made:
        replies to anything in flight on it will never come. Never blocks, and keeps the GIL
        (read through ``HeldSocket``: the scheduler asks every step)."""
        mon = self._held_monitor
        if mon is None:
            return False
        try:
            while mon.recv() is not None:    # each part of each event; any event means lost
                self._lost = True
        except zmq.ZMQError:
            self._lost = True
        return self._lost

    def drain(self, owed_only: bool = False) -> list[p.Reply]:
        """Every reply that has arrived, without waiting (the answer to a Hello sent by
        ``connect_nowait`` is taken in here, not returned). ``owed_only``: when every request
        sent on this connection has had its answer, do not look: the daemon answers every
        request exactly once and sends nothing unasked (its rule, ``daemon/server.py``), and
        the look is a libzmq call that a scheduler step would otherwise pay for nothing."""
        out, self._unsolicited = self._unsolicited, []
        held = self._held
        if held is None or (owed_only and self._owed <= 0):
            return out
        while True:
            try:
                frame = held.recv()
            except zmq.ZMQError:
                self.disconnect()
                return out
            if frame is None:
                return out
            self._owed -= 1
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
        if self.is_connected and not self.is_stale:
            now = time.monotonic()
            if now < self._lost_checked_at + _LOST_CHECK_S:
                return True
            self._lost_checked_at = now
        if self.is_stale or (self.is_connected and self.connection_lost()):
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
            try:
                # One look, no retry (retries sleep): a socket file nobody listens on fails now.
                self._probe(tries=1)
            except DaemonUnavailable:
                self.disconnect()
                raise
            self._open_socket()
            self._connect_deadline = now + timeout_s
        elif self.connection_lost():
            # The daemon refused the connection or closed it before answering the Hello.
            self.disconnect()
            raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} closed the "
                                    f"connection while it was being made")
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
        if self.is_stale or self.connection_lost():
            self.disconnect(backoff=False)
        if self.is_connected:
            return
        if self._sock is not None:   # a connect_nowait in progress: start over, waiting
            self.disconnect(backoff=False)
        now = time.monotonic()
        if now < self._retry_at:
            raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} unavailable; next "
                                    f"try in {(self._retry_at - now) * 1000:.0f} ms")
        try:
            self._probe()
            self._open_socket()
            reply = self._hello()
        except DaemonUnavailable:
            self.disconnect()
            raise
        self._connected(reply)

    def _connected(self, reply: p.HelloReply) -> None:
        self._hello_id = None
        self.owner_id = reply.owner_id
        self.daemon_id = reply.daemon_id
        self.index_segment = reply.index_segment
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
            self._held_monitor = None
            self._poller.unregister(self._sock)
            self._poller.unregister(self._monitor)
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
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
        """Say goodbye (so the daemon releases what we hold now) and close; waits for the
        daemon's answer at most ``_BYE_WAIT_MS``."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.is_connected and not self.is_stale:
            try:
                req_id = self.next_id()
                self._send(p.ByeRequest(req_id))
                self._await(req_id, min(_BYE_WAIT_MS, self.config.timeout_ms))
            except KvpoolError:
                pass
        self.disconnect(backoff=False)

    # ---- internals -------------------------------------------------------------------------

    def _probe(self, tries: int = _PROBE_TRIES) -> None:
        """Fail at once when nobody listens on the socket, instead of after ``timeout_ms``: a
        killed daemon leaves its socket file behind, and ZeroMQ would keep knocking on it. Also
        names a permission problem, which ZeroMQ only shows as silence. ``tries=1`` never
        sleeps (a connect to a Unix socket does not wait for the listener to accept)."""
        path = self.config.socket_path
        for attempt in range(tries):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(self.config.timeout_ms / 1000)
            try:
                probe.connect(path)
                return
            except ConnectionRefusedError:
                # Also what a daemon that has just created its socket but not yet listens on
                # it answers: look again, briefly, before calling it gone.
                if attempt + 1 < tries:
                    time.sleep(_PROBE_RETRY_S)
                    continue
                raise DaemonUnavailable(f"kvpoold not reachable at {path}: nothing listens "
                                        f"there (not running)") from None
            except FileNotFoundError:
                raise DaemonUnavailable(f"kvpoold not reachable at {path}: nothing listens "
                                        f"there (not running)") from None
            except PermissionError:
                raise SocketForbidden(f"permission denied on {path}: this user may not "
                                      f"connect to kvpoold (see its socket_mode and group)"
                                      ) from None
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.ETIMEDOUT) and not isinstance(
                        e, TimeoutError):
                    raise DaemonUnavailable(f"cannot reach kvpoold at {path}: {e.strerror}"
                                            ) from None
                return   # a full accept backlog: the daemon is there but busy; ZeroMQ waits
            finally:
                probe.close()

    def _open_socket(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE: never queue requests for a daemon that is not there; fail fast instead.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.IDENTITY, os.urandom(8))
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED
                                                | zmq.EVENT_CONNECT_RETRIED)
        self._lost = False
        self._lost_checked_at = float("-inf")
        self._owed = 0
        sock.connect(f"ipc://{self.config.socket_path}")
        self._sock = sock
        self._held = HeldSocket(sock)
        self._held_monitor = HeldSocket(self._monitor)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _hello(self) -> p.HelloReply:
        assert self._sock is not None
        deadline = time.monotonic() + self.config.timeout_ms / 1000
        # Writable once the connection is up. A daemon that dies as we connect (the probe
        # reached it a moment before) shows up on the monitor instead: give up then, not at
        # the timeout.
        while not self._sock.poll(_CONNECT_CHECK_MS, zmq.POLLOUT):
            if self.connection_lost() or time.monotonic() > deadline:
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
        # A connection already seen lost is not used: libzmq may still take a send into the
        # closing pipe for a moment after the monitor reported it, and its reply never comes.
        try:
            sent = not self._lost and self._held.send(p.encode(msg))
        except zmq.ZMQError:
            sent = False
        self._owed += sent
        if not sent:
            # A connection the daemon closed (a restart not yet seen: connect_nowait looks
            # every _LOST_CHECK_S) is remade at once, as that look would have; a full queue or
            # a missing peer backs off.
            self.disconnect(backoff=not self.connection_lost())
            raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} is not "
                                    f"accepting requests")

    def _await(self, req_id: int, timeout_ms: int | None) -> p.Reply:
        assert self._sock is not None
        sock = self._sock
        deadline = time.monotonic() + (timeout_ms or self.config.timeout_ms) / 1000
        while True:
            # (rounded up: truncated, a call gave up to 1 ms before its timeout)
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            ready = dict(self._poller.poll(left_ms)) if left_ms > 0 else {}
            if self._monitor in ready and self.connection_lost():
                # The daemon went away mid-call: say so now, not at the timeout.
                self.disconnect(backoff=False)
                raise _ConnectionLost(f"kvpoold at {self.config.socket_path} closed the "
                                      f"connection (it stopped or restarted)")
            if sock not in ready:
                if left_ms > 0:
                    continue
                self.disconnect()
                raise DaemonUnavailable(f"kvpoold at {self.config.socket_path} did not answer "
                                        f"within {timeout_ms or self.config.timeout_ms} ms")
            reply = p.decode_reply(sock.recv())
            self._owed -= 1
            if reply.req_id == req_id:
                if isinstance(reply, p.ErrorReply):
                    raise error_from_code(reply.code, reply.message)
                return reply
            self._unsolicited.append(reply)   # job completions and late replies


class _ConnectionLost(DaemonUnavailable):
    """The daemon closed the connection a call was waiting on; ``call`` reconnects once."""


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
        awake = time.monotonic()
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
                now = time.monotonic()
                if now - awake > 1.5 * interval + 0.5:
                    # We were not running (SIGSTOP, a paused container, a long GIL hold): the
                    # silence was ours, not the daemon's. Listen afresh before judging it.
                    last_reply = now
                awake = now
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
                # Silence counts only past a few beats: a loaded daemon may answer one late.
                if time.monotonic() - last_reply > max(self._t.config.timeout_ms / 1000,
                                                       3 * interval):
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
