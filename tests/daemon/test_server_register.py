"""Registration with its attach off the event loop, in process: a real ``Server`` serving its real
socket on this thread's loop, real clients (bare DEALER sockets) on another thread, and the host
copy engine with its attach held until the test lets it go (issue 36 item 6: an attach on the
loop held it 26-68 ms at first registrations on GPU hosts).

Each race the held attach opens has its test: the client released meanwhile (bye, silence,
process exit), the same registration sent again, the per-client limit, the daemon stopping, and
an attach that fails. "Nothing leaks" is checked on the engine's own mapping (its mmaps closed)
and on the daemon's tables as ``info`` reports them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading

import msgspec
import pytest
import zmq

from bench.soak.common import ShmBlocks, layout
from kvpool.daemon import server as server_module
from kvpool.daemon.host_copy import HostCopyEngine
from kvpool.daemon.pool import Pool
from kvpool.daemon.server import Server
from kvpool.shared import protocol as p
from kvpool.shared.errors import ErrorCode
from tests.conftest import wait_for, wait_for_async

# How long a held attach waits for the test at most: past it, code that attaches on the loop
# (and so never lets the test open the gate) fails its test rather than hanging it.
HELD_S = 5.0
# A reply that must come while an attach is held comes within this, or the loop is held.
PROMPT_S = 2.0


class HeldHostEngine(HostCopyEngine):
    """The host copy engine; its attach waits for ``gate`` (and what it mapped is kept, for the
    test to see it detached). Nothing else differs."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.gate = threading.Event()
        self.entered: list[int] = []          # req_id of each attach that began
        self.mapped = []

    def attach(self, registration, peer=None):
        self.entered.append(registration.req_id)
        self.gate.wait(HELD_S)
        mapped = super().attach(registration, peer)
        self.mapped.append(mapped)
        return mapped

    def mapped_for(self, req_id: int):
        return next(m for m in self.mapped if m.registration.req_id == req_id)


def is_detached(mapped) -> bool:
    return all(m.closed for m in mapped.maps)


class Client:
    """A bare DEALER socket: sends requests, reads replies, as a worker's transport would."""

    def __init__(self, socket_path: str, name: str = "test") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{socket_path}")
        self.name = name

    def send(self, msg) -> None:
        self.sock.send(p.encode(msg))

    def reply(self, timeout_s: float = PROMPT_S):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode_reply(self.sock.recv())

    def call(self, msg, timeout_s: float = PROMPT_S):
        self.send(msg)
        r = self.reply(timeout_s)
        assert r is not None, f"no reply to {type(msg).__name__} within {timeout_s} s"
        return r

    def hello(self, role: p.Role = p.Role.WORKER) -> None:
        assert isinstance(self.call(p.Hello(1, p.PROTOCOL_VERSION, role, self.name,
                                            os.getpid())), p.HelloReply)

    def close(self) -> None:
        self.sock.close(0)


OPERATOR = "operator"


class Rig:
    """A server on ``HeldHostEngine`` and a KV region to register, for one test."""

    def __init__(self, config, tmp_path) -> None:
        self.config = msgspec.structs.replace(config, socket=str(tmp_path / "kvpoold.sock"),
                                              metrics_port=0)
        self.pool = Pool.open(self.config)
        self.engine = HeldHostEngine(self.pool)
        self.server = Server(self.config, self.pool, {p.HostRegion: self.engine})
        self.kv = ShmBlocks(8)
        self.clients: list[Client] = []

    def client(self, name: str = "test", hello: bool = True) -> Client:
        c = Client(self.config.socket_path, name)
        self.clients.append(c)
        if hello:
            c.hello()
        return c

    def register(self, req_id: int, namespace: bytes = b"n" * 16, regions=None,
                 num_blocks: int = 8) -> p.RegisterRequest:
        return p.RegisterRequest(req_id, namespace, layout(), 0, num_blocks,
                                 regions or [self.kv.region()], self.kv.placement())

    def info(self) -> p.PoolInfo:
        """The daemon's tables as an operator sees them (a connection of its own, gone after,
        so the clients under test stay as they are)."""
        c = self.client(OPERATOR, hello=False)
        try:
            c.hello(p.Role.OPERATOR)
            return c.call(p.InfoRequest(2)).info
        finally:
            c.call(p.ByeRequest(3))
            self.clients.remove(c)
            c.close()

    def workers(self) -> list[p.ClientInfo]:
        return [c for c in self.info().clients if c.name != OPERATOR]

    def registrations(self) -> int:
        return sum(c.registrations for c in self.workers())

    def held(self, n: int) -> None:
        """Wait until ``n`` attaches have begun (and wait at the gate)."""
        wait_for(lambda: len(self.engine.entered) >= n, PROMPT_S * 5,
                 lambda: f"{n} attaches to begin: {self.engine.entered}")

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.should_exit.set)

    def run(self, scenario) -> None:
        """Serve on this thread while ``scenario(self)`` runs on another; returns once the
        server has stopped (the scenario may stop it first, ``stop``)."""
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.serving = asyncio.create_task(self.server.serve())
            await wait_for_async(lambda: self.server.is_serving or self.serving.done(), 10,
                                 "the server to serve")
            try:
                await asyncio.to_thread(scenario, self)
            finally:
                self.engine.gate.set()
                self.server.should_exit.set()
                await self.serving
        try:
            asyncio.run(main())
        finally:
            for c in self.clients:
                c.close()
            self.kv.close()


@pytest.fixture
def rig(pool_config, tmp_path):
    return Rig(pool_config, tmp_path)


def test_a_registration_whose_attach_is_slow_does_not_hold_the_loop(rig):
    """While one worker's memory attaches, the daemon answers everyone else; the worker's
    RegisterReply comes once its attach is done. (On the loop, the ping waited for the attach.)"""
    def scenario(rig: Rig) -> None:
        worker, other = rig.client("worker"), rig.client("other")
        worker.send(rig.register(2))
        rig.held(1)
        assert isinstance(other.call(p.Ping(3)), p.Pong), "answered while the attach is held"
        assert other.call(p.LookupRequest(4, b"n" * 16, [[b"k" * 16]])).hits == [0]
        assert worker.reply(0.05) is None, "no RegisterReply before the attach is done"
        assert rig.registrations() == 0
        rig.engine.gate.set()
        r = worker.reply(PROMPT_S * 5)
        assert isinstance(r, p.RegisterReply) and r.req_id == 2, r
        assert rig.registrations() == 1
        assert worker.call(p.UnregisterRequest(5, r.registration_id)).count == 1
        assert is_detached(rig.engine.mapped_for(2))

    rig.run(scenario)
    assert len(rig.server.attaches) == 0


@pytest.mark.parametrize("how", ["bye", "silence", "exit"])
def test_a_client_released_while_its_memory_attaches_leaves_nothing_behind(pool_config,
                                                                           tmp_path, how):
    """Its attach is detached when it comes back, answered ABORTED (read where the client is
    still there), and no registration is made."""
    if how == "silence":     # the worker never beats; the operator says Hello on each look
        pool_config = msgspec.structs.replace(pool_config, peer_timeout_ms=300)
    rig = Rig(pool_config, tmp_path)
    register = rig.register(2)

    def scenario(rig: Rig) -> None:
        worker = proc = None
        if how == "exit":    # a process of its own that registers, then dies when told
            proc = subprocess.Popen([sys.executable, "-c", _REGISTER_AND_DIE,
                                     rig.config.socket_path, p.encode(register).hex()],
                                    stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        else:
            worker = rig.client("worker")
            worker.send(register)
        rig.held(1)
        if how == "bye":
            assert worker.call(p.ByeRequest(3)).count == 1
        if proc is not None:
            _, err = proc.communicate(b"die\n", timeout=60)
            assert proc.returncode == 0, err.decode()
        # (well inside the default 10 s peer timeout: a bye or an exit releases at once)
        wait_for(lambda: not rig.workers(), PROMPT_S * 2,
                 lambda: f"the worker to be released ({how}): {rig.workers()}")
        rig.engine.gate.set()
        wait_for(lambda: rig.engine.mapped and is_detached(rig.engine.mapped[0]), PROMPT_S * 5,
                 "the attach that came back to be detached")
        assert rig.registrations() == 0
        if worker is not None:
            r = worker.reply(PROMPT_S)
            assert r is not None and r.code == ErrorCode.ABORTED and "released" in r.message, r

    rig.run(scenario)
    assert len(rig.server.attaches) == 0 and not rig.server.registry.registrations


# Says Hello and sends a RegisterRequest (argv: socket path, the request's bytes in hex), then
# dies without a goodbye once a line comes on stdin (the test sends it when the attach began:
# a process gone before its request was read would only be refused HELLO_REQUIRED).
_REGISTER_AND_DIE = """
import os, sys, zmq
from kvpool.shared import protocol as p
s = zmq.Context.instance().socket(zmq.DEALER)
s.connect("ipc://" + sys.argv[1])
s.send(p.encode(p.Hello(1, p.PROTOCOL_VERSION, p.Role.WORKER, "dying", os.getpid())))
assert s.poll(10000) and isinstance(p.decode_reply(s.recv()), p.HelloReply)
s.send(bytes.fromhex(sys.argv[2]))
sys.stdin.readline()
os._exit(0)
"""


def test_a_registration_sent_again_while_attaching_replaces_the_first(rig):
    """A worker that timed out sends its registration again: the later request wins, as a
    re-registration replaces (the first is answered ABORTED and its memory detached)."""
    def scenario(rig: Rig) -> None:
        worker = rig.client("worker")
        worker.send(rig.register(2))
        rig.held(1)
        worker.send(rig.register(3))
        rig.held(2)
        rig.engine.gate.set()
        replies = {r.req_id: r for r in (worker.reply(PROMPT_S * 5), worker.reply(PROMPT_S * 5))}
        assert replies[2].code == ErrorCode.ABORTED and "superseded" in replies[2].message
        assert isinstance(replies[3], p.RegisterReply), replies[3]
        assert rig.registrations() == 1
        assert is_detached(rig.engine.mapped_for(2)) and not is_detached(rig.engine.mapped_for(3))

    rig.run(scenario)


def test_attaches_in_flight_count_against_the_registration_limit(rig, monkeypatch):
    monkeypatch.setattr(server_module, "MAX_REGISTRATIONS_PER_CLIENT", 2)

    def scenario(rig: Rig) -> None:
        worker = rig.client("worker")
        worker.send(rig.register(2, b"a" * 16))
        worker.send(rig.register(3, b"b" * 16))
        rig.held(2)
        r = worker.call(rig.register(4, b"c" * 16))
        assert (r.req_id, r.code) == (4, ErrorCode.TOO_LARGE), r   # at once, while held
        rig.engine.gate.set()
        got = sorted((worker.reply(PROMPT_S * 5), worker.reply(PROMPT_S * 5)),
                     key=lambda r: r.req_id)
        assert [type(r) for r in got] == [p.RegisterReply] * 2, got
        r = worker.call(rig.register(5, b"c" * 16))
        assert r.code == ErrorCode.TOO_LARGE, "two made: still two"
        r = worker.call(rig.register(6, b"a" * 16), PROMPT_S * 5)
        assert isinstance(r, p.RegisterReply), "a re-registration replaces: not refused"
        assert rig.registrations() == 2

    rig.run(scenario)


def test_a_daemon_stopping_with_an_attach_in_flight_waits_for_it_and_detaches_it(rig):
    """Its shutdown waits (up to its grace) for the attach before the engines close, and
    detaches what it mapped; the worker is answered ABORTED, when the reply leaves before the
    socket closes (not checked: a socket closed at once drops what is queued)."""
    def scenario(rig: Rig) -> None:
        worker = rig.client("worker")
        worker.send(rig.register(2))
        rig.held(1)
        rig.stop()
        wait_for(lambda: not rig.server.is_serving, PROMPT_S * 5, "the server to stop serving")
        assert not rig.serving.done(), "stopped with the attach still held"
        rig.engine.gate.set()

    rig.run(scenario)
    assert rig.engine.mapped, "the attach never came back"
    assert is_detached(rig.engine.mapped_for(2)), "what it mapped outlived the daemon"
    assert len(rig.server.attaches) == 0 and not rig.server.registry.registrations


@pytest.mark.parametrize("bad", ["no such memory", "too few blocks"])
def test_an_attach_that_raises_answers_the_error_and_leaves_nothing(rig, bad):
    def scenario(rig: Rig) -> None:
        worker = rig.client("worker")
        rig.engine.gate.set()
        if bad == "no such memory":
            r = worker.call(rig.register(2, regions=[p.HostRegion(
                f"{p.ENGINE_SHM_PREFIX}gone-{os.getpid()}", rig.kv.n * rig.kv.block_bytes)]))
            assert r.code == ErrorCode.UNKNOWN_ID and "does not exist" in r.message, r
        else:     # more blocks than its region holds: the engine's placement check refuses it
            r = worker.call(rig.register(2, num_blocks=rig.kv.n + 1))
            assert r.code == ErrorCode.OUT_OF_RANGE and "past" in r.message, r
        assert rig.registrations() == 0
        assert isinstance(worker.call(rig.register(3)), p.RegisterReply), "serving on"

    rig.run(scenario)
    assert len(rig.server.attaches) == 0


def test_a_serving_daemon_has_frozen_its_startup_heap(rig):
    """Once it serves, the startup's heap is out of the collector's generations
    (daemon/heap.py), and the extents' slots made from then on follow it."""
    def scenario(rig: Rig) -> None:
        assert rig.server.heap.settled and gc.get_freeze_count() > 0
        assert rig.server.index.extents.on_new_slots == rig.server.heap.keep_new

    rig.run(scenario)
