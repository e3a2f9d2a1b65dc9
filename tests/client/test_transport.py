"""``client/transport.py`` against a stand-in daemon: a ROUTER socket on a thread that answers
Hello and, unless told to stay silent, Ping. What is checked is the transport's own contract:
one Hello per connection, replies matched to their calls, a bounded wait, and fast failure with
a backoff when no daemon listens."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvpool.client.transport import Transport
from kvpool.shared import protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import DaemonUnavailable
from tests.conftest import wait_for


class FakeDaemon:
    """Answers every Hello; answers Ping unless ``silent``. Counts what it received by type."""

    def __init__(self, path: str, silent: bool = False) -> None:
        self.path = path
        self.silent = silent
        self.seen: dict[str, int] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(f"ipc://{path}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, frame = self._sock.recv_multipart()
            msg = p.decode_request(frame)
            name = type(msg).__name__
            self.seen[name] = self.seen.get(name, 0) + 1
            if isinstance(msg, p.Hello):
                reply = p.HelloReply(msg.req_id, p.PROTOCOL_VERSION, "fake", 7, 1 << 20, 1000,
                                     1 << 20)
            elif isinstance(msg, p.Ping) and not self.silent:
                reply = p.Pong(msg.req_id, "fake", 1.0)
            else:
                continue
            self._sock.send_multipart([identity, p.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "kvpoold.sock")


def transport(path: str, **kw) -> Transport:
    cfg = ClientConfig(socket=path, **{"timeout_ms": 1000, "reconnect_backoff_ms": 500, **kw})
    return Transport(cfg, p.Role.SCHEDULER, "test", heartbeat=False)


def test_calls_get_their_replies_over_one_connection(sock_path):
    daemon = FakeDaemon(sock_path)
    t = transport(sock_path)
    try:
        replies = [t.call(lambda rid: p.Ping(rid)) for _ in range(3)]
        assert all(isinstance(r, p.Pong) for r in replies)
        assert len({r.req_id for r in replies}) == 3
        assert daemon.seen == {"Hello": 1, "Ping": 3}
        assert t.is_connected and t.owner_id == 7 and t.daemon_id == "fake" and t.epoch == 1
    finally:
        t.close()
        daemon.close()


def test_no_daemon_fails_at_once_then_within_the_backoff(sock_path):
    t = transport(sock_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="nothing listens"):
            t.call(lambda rid: p.Ping(rid))
        assert time.monotonic() - t0 < 0.5          # not a timeout: nobody is there
        with pytest.raises(DaemonUnavailable, match="next try in"):
            t.call(lambda rid: p.Ping(rid))
        assert not t.is_connected
    finally:
        t.close()


def test_a_silent_daemon_costs_one_timeout_not_more(sock_path):
    daemon = FakeDaemon(sock_path, silent=True)
    t = transport(sock_path, timeout_ms=300)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            t.call(lambda rid: p.Ping(rid))
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 2.0, waited
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="next try in"):
            t.call(lambda rid: p.Ping(rid))
        assert time.monotonic() - t0 < 0.1
    finally:
        t.close()
        daemon.close()


def test_an_owed_only_drain_takes_every_reply_and_skips_the_look_when_none_is_owed(sock_path):
    daemon = FakeDaemon(sock_path)
    t = transport(sock_path)
    try:
        t.call(lambda rid: p.Ping(rid))                       # connected
        sent = {t.send(lambda rid: p.Ping(rid)) for _ in range(2)}
        got: set[int] = set()
        wait_for(lambda: got.update(r.req_id for r in t.drain(owed_only=True)) or got == sent,
                 5.0, lambda: f"both Pongs drained (got {got} of {sent})")

        def looked() -> bytes | None:
            raise AssertionError("drain read the socket with no reply owed")
        t._held.recv = looked
        assert t.drain(owed_only=True) == []
    finally:
        t.close()
        daemon.close()


def test_connect_nowait_still_sees_the_daemon_go_away(sock_path):
    # The monitor is read at most every _LOST_CHECK_S on a connection that is up: a daemon
    # that closes it is still noticed by the next steps, not only by a timeout.
    daemon = FakeDaemon(sock_path)
    t = transport(sock_path)
    try:
        t.call(lambda rid: p.Ping(rid))
        assert t.connect_nowait()
        daemon.close()

        def gone() -> bool:
            try:
                return not t.connect_nowait()
            except DaemonUnavailable:
                return True
        wait_for(gone, 5.0, "connect_nowait noticing the closed connection")
        assert not t.is_connected
    finally:
        t.close()


def test_a_send_on_a_connection_the_daemon_closed_reconnects_without_a_backoff(sock_path):
    # A restarted daemon that connect_nowait has not looked for yet (it looks every
    # _LOST_CHECK_S): the failed send must not make the client wait out a backoff.
    daemon = FakeDaemon(sock_path)
    t = transport(sock_path, reconnect_backoff_ms=60_000)
    try:
        t.call(lambda rid: p.Ping(rid))
        daemon.close()
        wait_for(t.connection_lost, 5.0, "the monitor reporting the closed connection")
        with pytest.raises(DaemonUnavailable, match="not accepting"):
            t.send_connected(lambda rid: p.Ping(rid))    # as a scheduler step sends
        daemon = FakeDaemon(sock_path)
        assert isinstance(t.call(lambda rid: p.Ping(rid)), p.Pong)
        assert t.epoch == 2
    finally:
        t.close()
        daemon.close()
