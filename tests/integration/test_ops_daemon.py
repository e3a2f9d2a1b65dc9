"""A real kvpoold with metrics and KV events on: one engine stores and loads, and /metrics,
/healthz, the event feed and ``kvpool top`` all see it."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import torch
import zmq

from kvpool.client import host_memory, kv_layout, scheduler, worker
from kvpool.daemon.events import KVEventBatch
from kvpool.daemon.top import run_top
from kvpool.shared import keys, layout
from bench.kvtest import keyed_store
from tests.daemon.httptest import free_port, fetch







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
    # The socket (what the fixture waits for) appears just before the HTTP server starts.
    deadline = time.monotonic() + 30
    while True:
        try:
            if fetch(base + "/healthz")[0] == 200:
                break
        except urllib.error.URLError:
            pass
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    for topic in (b"engine-A", b"engine-B"):
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    mem = host_memory.SharedHostMemory(2 * 8 * 16 * 4 * 64 * 2)
    w = worker.WorkerClient(d.client_config(), name="tp0", engine_id="engine-A")
    w2 = worker.WorkerClient(d.client_config(), name="tp0", engine_id="engine-B")
    s = scheduler.SchedulerClient(d.client_config(), name="sched", engine_id="engine-A")

    def next_events(timeout_s: float) -> tuple[bytes, list]:
        if not sub.poll(int(timeout_s * 1000)):
            return b"", []
        topic, _, payload = sub.recv_multipart()
        evs = msgspec.msgpack.decode(payload, type=KVEventBatch).events
        print("EV", time.monotonic(), topic, [(type(e).__name__, [hashes.index(h) if h in hashes else h for h in getattr(e, "block_hashes", [])]) for e in evs], flush=True)
        return topic, evs

    try:
        kv = mem.tensor.view(torch.float16).view(2, 8, 16, 4, 64).normal_()
        plan = kv_layout.plan_kv_memory([kv], [1], [(mem.base_address, mem.nbytes)])
        lay = layout.Layout(16, 1, "float16", plan.segment_bytes)
        ns = keys.make_namespace("ops-model", lay.fingerprint())
        reg = w.register(ns, lay, 0, 8, [mem.region], plan.placement)
        hashes = keys.request_block_hashes(ns, list(range(80)), 16)   # 5 full blocks
        done = w.wait([keyed_store(s, w, reg, ns, [0, 1, 2, 3], hashes[:4])], 10)
        assert all(c.ok for c in done), done
        hit = s.lookup(ns, [hashes[:4] + [b"\0" * 16]], pin=True)
        assert hit.hits == [4]
        assert all(c.ok for c in w.wait([w.submit_load(reg, hit.slots[0], [4, 5, 6, 7])], 10))
        s.release(hit.leases)

        # engine-B joins the namespace: it is told the 4 committed blocks. PUB drops what it
        # sends before our subscription reaches it, so re-join until the announcement lands.
        deadline = time.monotonic() + 20
        announced: list = []
        while not announced:
            assert time.monotonic() < deadline, "engine-B never got the committed blocks"
            reg2 = w2.register(ns, lay, 0, 8, [mem.region], plan.placement)
            topic, events = next_events(0.5)
            while topic and topic != b"engine-B":
                topic, events = next_events(0.5)
            announced = [e for e in events if type(e).__name__ == "BlockStored"]
            if not announced:
                w2.unregister(reg2)
        assert announced[0].block_hashes == hashes[:4]
        assert announced[0].medium == "CPU" and announced[0].block_size == 16

        # Subscribed for sure now: a new block reaches both engines that can load it.
        print("STORE5", time.monotonic(), flush=True)
        done = w.wait([keyed_store(s, w, reg, ns, [4], hashes[4:])], 10)
        assert all(c.ok for c in done), done
        # (Earlier batches may still be queued: engine-A's first store, engine-B's re-joins.)
        seen: set[bytes] = set()
        while seen != {b"engine-A", b"engine-B"}:
            topic, events = next_events(10)
            print("EV", topic, [(type(e).__name__, len(getattr(e, "block_hashes", []))) for e in events], flush=True)
            assert topic, f"BlockStored of the 5th block reached only {seen}"
            if any(type(e).__name__ == "BlockStored" and e.block_hashes == hashes[4:]
                   for e in events):
                seen.add(topic)

        deadline = time.monotonic() + 10   # gauges refresh once a second
        while True:
            text = fetch(base + "/metrics")[1]
            if metric(text, 'kvpool_slots{state="committed"}') == 5:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        assert metric(text, "kvpool_lookup_hit_blocks_total") == 4
        assert metric(text, "kvpool_lookup_miss_blocks_total") == 1
        assert metric(text, "kvpool_lookup_hit_tokens_total") == 64
        assert metric(text, "kvpool_store_bytes_total") == kv[:, :5].numel() * 2
        assert metric(text, "kvpool_load_bytes_total") == kv[:, :4].numel() * 2
        assert metric(text, 'kvpool_store_jobs_total{result="ok"}') == 2
        assert metric(text, "kvpool_engines") == 2
        assert metric(text, 'kvpool_clients{role="worker"}') == 2
        assert json.loads(fetch(base + "/healthz")[1])["status"] == "ok"

        out = io.StringIO()
        run_top(s.info, 0.05, out, iterations=2, sleep=time.sleep)
        assert "hit rate" in out.getvalue() and "engines 2" in out.getvalue()
    finally:
        w.close()
        w2.close()
        s.close()
        mem.close()
        sub.close(linger=0)
        ctx.destroy(linger=0)

    assert d.stop() == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/healthz", timeout=2)
