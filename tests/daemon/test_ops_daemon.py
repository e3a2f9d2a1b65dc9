"""A real kvpoold with metrics and KV events on: one engine stores and loads, and /metrics,
/healthz, the event feed and ``kvpool top`` all see it."""

from __future__ import annotations

import inspect
import io
import json
import socket
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import torch
import zmq

import kvpool.daemon.server
from kvpool.client import host_memory, kv_layout, scheduler, worker
from kvpool.daemon.events import KVEventBatch
from kvpool.daemon.top import run_top
from kvpool.shared import keys, layout

pytestmark = pytest.mark.skipif(
    "Telemetry" not in inspect.getsource(kvpool.daemon.server),
    reason="daemon/server.py does not call Telemetry yet (integration pending)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_health_events_and_top_follow_real_traffic(daemon_factory, tmp_path):
    port = free_port()
    endpoint = f"ipc://{tmp_path}/events"
    d = daemon_factory(extra=["--metrics-port", str(port), "--events-endpoint", endpoint,
                              "--events-interval-ms", "5"])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while get(base + "/healthz")[0] != 200:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"engine-A")
    sub.connect(endpoint)
    mem = host_memory.SharedHostMemory(2 * 8 * 16 * 4 * 64 * 2)
    w = worker.WorkerClient(d.client_config(), name="tp0", engine_id="engine-A")
    s = scheduler.SchedulerClient(d.client_config(), name="sched", engine_id="engine-A")
    try:
        kv = mem.tensor.view(torch.float16).view(2, 8, 16, 4, 64).normal_()
        plan = kv_layout.plan_kv_memory([kv], [1], [(mem.base_address, mem.nbytes)])
        lay = layout.Layout(16, 1, "float16", plan.segment_bytes)
        ns = keys.make_namespace("ops-model", lay.fingerprint())
        reg = w.register(ns, lay, 0, 8, [mem.region], plan.placement)
        time.sleep(0.2)   # the SUB connect races the first batch; stores below come later
        hashes = keys.request_block_hashes(ns, list(range(64)), 16)
        done = w.wait([w.submit_store(reg, [0, 1, 2, 3], s.prepare_store(ns, hashes))], 10)
        assert all(c.ok for c in done), done
        hit = s.lookup(ns, [hashes + [b"\0" * 16]], pin=True)
        assert hit.hits == [4]
        assert all(c.ok for c in w.wait([w.submit_load(reg, hit.slots[0], [4, 5, 6, 7])], 10))
        s.release(hit.leases)

        stored = []
        deadline = time.monotonic() + 10
        while len(stored) < 4:
            assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), \
                f"BlockStored for 4 blocks not seen; got {stored}"
            topic, _, payload = sub.recv_multipart()
            assert topic == b"engine-A"
            for e in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
                if type(e).__name__ == "BlockStored":
                    assert e.medium == "CPU" and e.block_size == 16
                    stored += e.block_hashes
        assert stored == hashes

        deadline = time.monotonic() + 10   # gauges refresh once a second
        while True:
            text = get(base + "/metrics")[1]
            if metric(text, 'kvpool_slots{state="committed"}') == 4:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        assert metric(text, "kvpool_lookup_hit_blocks_total") == 4
        assert metric(text, "kvpool_lookup_miss_blocks_total") == 1
        assert metric(text, "kvpool_lookup_hit_tokens_total") == 64
        assert metric(text, "kvpool_store_bytes_total") == kv[:, :4].numel() * 2
        assert metric(text, "kvpool_load_bytes_total") == kv[:, :4].numel() * 2
        assert metric(text, 'kvpool_store_jobs_total{result="ok"}') == 1
        assert metric(text, "kvpool_engines") == 1
        assert metric(text, 'kvpool_clients{role="worker"}') == 1
        assert json.loads(get(base + "/healthz")[1])["status"] == "ok"

        out = io.StringIO()
        run_top(s.info, 0.05, out, iterations=2, sleep=time.sleep)
        assert "hit rate" in out.getvalue() and "engines 1" in out.getvalue()
    finally:
        w.close()
        s.close()
        mem.close()
        sub.close(linger=0)
        ctx.destroy(linger=0)

    assert d.stop() == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/healthz", timeout=2)
