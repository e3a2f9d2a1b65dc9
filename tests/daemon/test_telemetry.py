"""daemon/telemetry.py: the server's hooks reach /metrics, /healthz and the events socket."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from kvpool.daemon.events import KVEventBatch
from kvpool.daemon.telemetry import Telemetry
from kvpool.shared.config import DaemonConfig, build_config
from kvpool.shared.errors import ConfigError, ErrorCode
from kvpool.shared.protocol import PoolInfo
from tests.daemon.httptest import free_port, fetch

NS = b"n" * 16


def info(evictions: int = 0) -> PoolInfo:
    return PoolInfo("d", 1.0, 1 << 20, 0, 1 << 20, 0, 0, 0, 0, 0, evictions, 0, 0, 0, 0, 0, 0, [])






class _Table:
    """The slot table as ``Telemetry.watch`` sees it: something to watch."""

    watcher = None

    def watch(self, watcher):
        self.watcher = watcher


def _blocks(*hashes):
    """Slots of ``NS`` holding ``hashes``, as the slot table tells its watchers about them."""
    return [SimpleNamespace(ns=NS, key=NS + h, block_hash=h) for h in hashes]


def test_off_by_default_except_metrics():
    cfg = DaemonConfig()
    assert cfg.metrics_host == "127.0.0.1" and cfg.metrics_port == 9471
    assert cfg.events_endpoint == ""
    t = Telemetry.start(build_config(DaemonConfig, {"metrics_port": 0}))
    try:
        table = _Table()
        t.watch(table)
        assert t.http is None and t.events is None and table.watcher is None
        t.tick(time.monotonic(), info)
    finally:
        t.close(pool_kept=True)


def test_hooks_reach_metrics_health_and_events(tmp_path):
    cfg = build_config(DaemonConfig, {"metrics_port": free_port(),
                                      "events_endpoint": f"ipc://{tmp_path}/ev",
                                      "events_interval_ms": 5})
    t = Telemetry.start(cfg)
    table = _Table()
    t.watch(table)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        base = f"http://127.0.0.1:{cfg.metrics_port}"
        assert fetch(base + "/healthz")[0] == 503
        t.serving(info())
        assert fetch(base + "/healthz")[0] == 200

        sub.setsockopt(zmq.SUBSCRIBE, b"pid-42")
        sub.connect(cfg.events_endpoint)
        t.registration_added("", 42, NS, 16, lambda: [])
        deadline = time.monotonic() + 10
        while not sub.poll(20):   # PUB drops until the subscription lands: repeat a probe
            assert time.monotonic() < deadline, "subscriber never connected"
            table.watcher.committed(_blocks(b"p" * 16))
            t.tick(time.monotonic(), info)
            t.events.flush()
        while sub.poll(100):
            sub.recv_multipart()

        t.lookup([2, 0], [[b"a", b"b", b"c"], [b"d"]], block_tokens=16)
        t.job_done(True, 4096, time.monotonic() - 0.001, 2, True)
        t.job_done(False, 0, time.monotonic(), 1, False)
        t.error(ErrorCode.LEASE_EXPIRED)
        table.watcher.committed(_blocks(b"x" * 16, b"y" * 16))
        table.watcher.removed(_blocks(b"x" * 16))
        t.tick(time.monotonic() + 5, lambda: info(evictions=3))
        t.events.flush()

        text = fetch(base + "/metrics")[1]
        for line in ("kvpool_lookup_hit_tokens_total 32.0", "kvpool_lookup_miss_blocks_total 2.0",
                     "kvpool_store_bytes_total 4096.0",
                     'kvpool_load_jobs_total{result="failed"} 1.0',
                     'kvpool_errors_total{code="LEASE_EXPIRED"} 1.0',
                     "kvpool_evicted_blocks_total 3.0"):
            assert line in text, line

        events = []
        while len(events) < 2:
            assert sub.poll(10_000), events
            events += msgspec.msgpack.decode(sub.recv_multipart()[2], type=KVEventBatch).events
        assert [(type(e).__name__, e.block_hashes) for e in events] == [
            ("BlockStored", [b"x" * 16, b"y" * 16]), ("BlockRemoved", [b"x" * 16])]

        t.stopping()
        assert fetch(base + "/healthz")[0] == 503
        t.close(pool_kept=False)
        assert sub.poll(10_000)
        cleared = msgspec.msgpack.decode(sub.recv_multipart()[2], type=KVEventBatch).events
        assert [type(e).__name__ for e in cleared] == ["AllBlocksCleared"]
    finally:
        sub.close(linger=0)
        t.close(pool_kept=True)
        ctx.destroy(linger=0)


def test_busy_metrics_port_fails_start_naming_the_setting(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = build_config(DaemonConfig, {"metrics_port": s.getsockname()[1]})
        with pytest.raises(ConfigError, match="metrics_port"):
            Telemetry.start(cfg)


def test_joining_engine_gets_queued_blocks_once(tmp_path):
    cfg = build_config(DaemonConfig, {"metrics_port": 0, "events_interval_ms": 5,
                                      "events_endpoint": f"ipc://{tmp_path}/ev"})
    t = Telemetry.start(cfg)
    table = _Table()
    t.watch(table)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"B")
        sub.connect(cfg.events_endpoint)
        deadline = time.monotonic() + 10
        t.registration_added("B", 1, NS, 16, lambda: [])
        while not sub.poll(20):   # PUB drops until the subscription lands: repeat a probe
            assert time.monotonic() < deadline, "subscriber never connected"
            table.watcher.committed(_blocks(b"p" * 16))
            t.tick(time.monotonic(), info)
        t.registration_removed("B", 1, NS, lambda: [])
        t.events.flush()
        while sub.poll(100):
            sub.recv_multipart()

        t.registration_added("A", 2, NS, 16, lambda: [])
        table.watcher.committed(_blocks(b"q" * 16))   # committed, not yet forwarded
        # B joins before the next tick: the committed block reaches it in the snapshot only.
        t.registration_added("B", 1, NS, 16, lambda: [b"q" * 16])
        t.tick(time.monotonic(), info)
        t.events.flush()
        got = []
        while sub.poll(300):
            got += msgspec.msgpack.decode(sub.recv_multipart()[2], type=KVEventBatch).events
        assert [(type(e).__name__, e.block_hashes) for e in got] == [
            ("BlockStored", [b"q" * 16])]
    finally:
        sub.close(linger=0)
        t.close(pool_kept=True)
        ctx.destroy(linger=0)
