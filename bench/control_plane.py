"""Control-plane and host-path benchmark: ratios measured side by side in one run.

    python -m bench.control_plane [--blocks 1024] [--iters 2000] [--out DIR]

Starts a real kvpoold (host path only) on a temporary socket and prints:
- lookups of 256 committed keys in the scheduler's own process, read in the daemon's
  shared-memory index (``SchedulerClient.find``): with 1 scheduler and with 8 scheduler
  processes reading at once, the daemon idle (``lookup256_1client_*``, ``lookup256_8clients_*``),
  and with another process storing at full rate through the daemon, its namespace capped so that
  every store evicts (``lookup256_busy_*``): p50/p99 of wall and of thread CPU time, the hits each
  lookup saw, and how much the daemon stored and evicted while it was timed
  (``bench/control_plane_lookups.py``; targets: 8 clients and busy p99 <= 100 us);
- the same lookups as a round trip through the daemon (``roundtrip_lookup256_*``: the fallback
  where the index cannot be mapped, and the figures of runs before the index), and the
  empty-request round trip (Ping) p50/p99: the floor every request pays;
- where a round trip's CPU goes (``round_trip_cpu_us``): per Ping and per 256-key lookup, the
  CPU time of the client's thread, the daemon's main thread and each side's ZeroMQ I/O thread,
  the same for a bare pyzmq echo server (``bare_pyzmq_echo``: the floor of Python and ZeroMQ),
  and, from the 8-client round trips, the daemon main thread's CPU per lookup
  (``roundtrip_lookup256_8clients_daemon_main_us``) and eight times it (``..._bound_us``): the
  least mean latency 8 clients that send back to back can see, since the daemon answers one
  request at a time (``roundtrip_lookup256_8clients_mean_us`` is what they saw);
- the connector's scheduler-side methods under vLLM 0.33's real ``Scheduler`` and
  ``AsyncScheduler`` with 256 running requests, and vLLM's own CPU offload connector
  (``OffloadingConnector``) under the same load in the same run: per method p50/p99/max, the
  worst p99 of each (``connector_method_p99_us``, ``vllm_connector_method_p99_us``), their
  ``build_connector_meta`` p99 and the ratio ``connector_vs_vllm_p99_ratio`` (target <= 1.25);
  ours again with store planning off (``connector_no_store_planning``)
  (``bench/connector_methods.py``);
- a reservation of 256 tickets p50/p99 (``reserve256``: one ``reserve`` round trip each, the
  abort that gives them back not timed), and ``take_slots`` of 256 from the scheduler's local
  stock (no round trip: what the connector pays);
- host-path store and load of ``--blocks`` Llama-3.1-8B blocks (32 layers x K/V x 16 tokens x
  8 heads x 128 x bf16 = 2 MiB each, per-layer layout), request to completion, next to a plain
  memcpy of the same bytes and a naive per-block copy loop (target: >= 0.8x memcpy). A store
  names tickets reserved before the clock starts; binding them to slots for their keys (and
  the evictions that makes room for, once the pool is full) is in the timed span, as it is in
  an engine's store.

torch is imported only where the host path needs it: the lookup phases' spawned processes
import this module again, and torch costs ~3 s of CPU each on the 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.control_plane_lookups import (LOOKUP_KEYS, busy_index_lookups,  # noqa: E402
                                         echo_round_trip_cpu, index_lookups, pct,
                                         round_trip_cpu, roundtrip_lookups, timed_calls)
from bench.connector_methods import CONNECTOR_REQUESTS, connector_figures  # noqa: E402
from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.client.worker import WorkerClient  # noqa: E402
from kvpool.shared import protocol  # noqa: E402
from kvpool.shared.config import ClientConfig  # noqa: E402
from kvpool.shared.keys import make_namespace, request_block_hashes  # noqa: E402
from kvpool.shared.layout import Layout  # noqa: E402


def start_daemon(sock: str, pool_name: str, pool_size: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.daemon", "--socket", sock,
                             "--pool-name", pool_name, "--pool-size", pool_size, "--cuda", "off",
                             "--log-level", "warning", "--metrics-port", "0",
                             "--peer-timeout-ms", "5000"])
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("kvpoold did not start")
        time.sleep(0.05)
    return proc


def kv_setup(cfg: ClientConfig, blocks: int, layers: int, heads: int, dim: int, tokens: int,
             name: str):
    import torch

    from kvpool.client.host_memory import SharedHostMemory
    from kvpool.client.kv_layout import plan_kv_memory

    nbytes = layers * 2 * blocks * tokens * heads * dim * 2
    mem = SharedHostMemory(nbytes)
    kv = mem.tensor.view(torch.bfloat16).view(layers, 2, blocks, tokens, heads, dim)
    plan = plan_kv_memory([kv[i] for i in range(layers)], [1] * layers,
                          [(mem.base_address, nbytes)])
    layout = Layout(tokens, 1, "bfloat16", plan.segment_bytes, f"{name} L{layers} flash")
    ns = make_namespace(name, layout.fingerprint())
    worker = WorkerClient(cfg, name)
    reg = worker.register(ns, layout, 0, blocks, [mem.region], plan.placement)
    return mem, kv, layout, ns, worker, reg


def lookup_setup(cfg: ClientConfig, name: str):
    """``LOOKUP_KEYS`` committed keys to look up, stored through a small host-memory
    registration: (``kv_setup``'s tuple, a scheduler client, the namespace, the keys). The
    caller closes the clients and the memory."""
    from bench.kvtest import keyed_store

    small = kv_setup(cfg, LOOKUP_KEYS, 2, 2, 16, 16, name)
    _, _, _, ns, worker, reg = small
    sched = SchedulerClient(cfg, name)
    keys = request_block_hashes(ns, list(range(LOOKUP_KEYS * 16)), 16)
    if not worker.wait([keyed_store(sched, worker, reg, ns, list(range(LOOKUP_KEYS)), keys)],
                       60)[0].ok:
        raise RuntimeError("the lookup keys' store failed")
    if sched.lookup(ns, [keys]).hits != [LOOKUP_KEYS]:
        raise RuntimeError("the lookup keys are not all committed")
    return small, sched, ns, keys


def reserve_calls(sched: SchedulerClient, ns: bytes, n: int) -> list[float]:
    """Microseconds of ``n`` reservations of ``LOOKUP_KEYS`` tickets (after 50 untimed), each
    given back untimed so that the client's stock of tickets never reaches its cap."""
    out = []
    for i in range(n + 50):
        t0 = time.perf_counter()
        grant = sched.reserve(ns, LOOKUP_KEYS)
        dt = (time.perf_counter() - t0) * 1e6
        assert len(grant.slots) == LOOKUP_KEYS, f"{len(grant.slots)} of {LOOKUP_KEYS} tickets"
        sched.abort_store(grant.slots)
        if i >= 50:
            out.append(dt)
    return out


def take_slots_calls(sched: SchedulerClient, ns: bytes, n: int) -> list[float]:
    """Microseconds of ``n`` ``take_slots`` of ``LOOKUP_KEYS`` from the scheduler's local stock
    (the connector's path: no round trip), the stock full enough each time (the refills, in
    the background, not timed)."""
    sched.keep_stock(ns)
    sched.abort_nowait(sched.take_slots(ns, LOOKUP_KEYS)[0])   # sets the stock's target
    take = []
    for _ in range(n):
        deadline = time.monotonic() + 10
        while sched.stock(ns) < LOOKUP_KEYS:
            assert time.monotonic() < deadline, "the stock did not refill"
            sched.poll()
            sched.take_slots(ns, 0)      # asks for more when below half the target
            time.sleep(0.0002)
        t0 = time.perf_counter()
        got = sched.take_slots(ns, LOOKUP_KEYS)[0]
        take.append((time.perf_counter() - t0) * 1e6)
        assert len(got) == LOOKUP_KEYS
        sched.abort_nowait(got)
    return take


def host_path(cfg: ClientConfig, sched: SchedulerClient, blocks: int) -> dict[str, Any]:
    """Store and load of ``blocks`` 2 MiB blocks against memcpy and a per-block loop; the bytes
    a load put back are checked against what was stored."""
    import torch

    fresh = iter(range(10**9))
    mem, kv, layout, ns2, w2, reg2 = kv_setup(cfg, blocks, 32, 8, 128, 16, "bench-llama")
    kv.copy_(torch.randn(kv.shape, dtype=torch.float32).to(torch.bfloat16))
    ids = list(range(blocks))
    nbytes = blocks * layout.shard_bytes

    def store_once() -> float:
        ks = [b"%016d" % next(fresh) for _ in ids]
        grant = sched.reserve(ns2, len(ks))
        assert len(grant.slots) == len(ks), f"{len(grant.slots)} tickets for {len(ks)}"
        t0 = time.perf_counter()
        done = w2.wait([w2.submit_store(reg2, ids, grant.slots, keys=ks,
                                        grant=grant.daemon_id)], 600)[0]
        dt = time.perf_counter() - t0
        # A block that found no room is not written and would make the store look fast.
        assert done.ok and done.nbytes == nbytes, done
        store_once.keys = ks
        return dt

    def load_once() -> float:
        hit = sched.lookup(ns2, [store_once.keys], pin=True)
        t0 = time.perf_counter()
        assert w2.wait([w2.submit_load(reg2, hit.slots[0], ids)], 600)[0].ok
        dt = time.perf_counter() - t0
        sched.release(hit.leases)
        return dt

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.copy_(mem.tensor[:nbytes])
    dst = torch.empty_like(src)
    dst.fill_(1)

    def memcpy_once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    flat = kv.view(32, 2, blocks, -1)
    per_block = dst.view(torch.bfloat16).view(blocks, 32, 2, -1)

    def naive_once() -> float:
        # What a per-block Python loop costs: one tensor copy per block into its own place
        # in a destination as large as the job (still batched over layers, so kinder than
        # a per-chunk loop).
        t0 = time.perf_counter()
        for b in ids:
            per_block[b].copy_(flat[:, :, b])
        return time.perf_counter() - t0

    store_once(); load_once(); memcpy_once()   # warm: page faults, thread pools
    runs = {"store": [], "load": [], "memcpy": [], "naive": []}
    for _ in range(3):
        runs["memcpy"].append(memcpy_once())
        runs["store"].append(store_once())
        runs["load"].append(load_once())
        runs["naive"].append(naive_once())
    gbps = {k: nbytes / min(v) / 1e9 for k, v in runs.items()}
    results = {
        "host_blocks": blocks, "host_block_bytes": layout.shard_bytes,
        "memcpy_GBps": gbps["memcpy"], "host_store_GBps": gbps["store"],
        "host_load_GBps": gbps["load"], "naive_per_block_GBps": gbps["naive"],
        "host_store_ratio": gbps["store"] / gbps["memcpy"],
        "host_load_ratio": gbps["load"] / gbps["memcpy"],
        "naive_ratio": gbps["naive"] / gbps["memcpy"],
    }
    # Verify what was timed: the last load put back exactly what was stored.
    before = kv.clone()
    kv.fill_(0)
    load_once()
    assert torch.equal(kv, before), "host path returned different bytes"
    w2.close()
    return results


def lookup_figures(sock: str, tmp: str, sched: SchedulerClient, ns: bytes, keys: list[bytes],
                   iters: int, daemon_pid: int) -> dict[str, Any]:
    """The round trips, their CPU, reservations, then the lookups in the index."""
    floor = timed_calls(sched.ping, iters)
    out: dict[str, Any] = {"floor_p50_us": pct(floor, 50), "floor_p99_us": pct(floor, 99)}
    out.update(roundtrip_lookups(sock, sched, ns, keys, iters, daemon_pid))
    out["roundtrip_lookup256_1client_ratio"] = \
        out["roundtrip_lookup256_1client_p50_us"] / out["floor_p50_us"]
    out["roundtrip_lookup256_8clients_ratio"] = \
        out["roundtrip_lookup256_8clients_p50_us"] / out["floor_p50_us"]
    out["round_trip_cpu_us"] = {
        "ping": round_trip_cpu(sched.ping, iters, daemon_pid),
        "lookup256": round_trip_cpu(lambda: sched.lookup(ns, [keys]), iters, daemon_pid),
        "bare_pyzmq_echo": echo_round_trip_cpu(        # a lookup request's size
            tmp, iters, bytes(len(protocol.encode(protocol.LookupRequest(1, ns, [keys])))))}
    reserve = reserve_calls(sched, ns, max(200, iters // 5))
    out.update({"reserve256_p50_us": pct(reserve, 50), "reserve256_p99_us": pct(reserve, 99),
                "reserve256_note": "each sample is one reserve(256) round trip; the "
                                   "abort_store that gives the tickets back is not timed"})
    out.update(index_lookups(sock, sched, ns, keys, iters, daemon_pid))
    out.update(busy_index_lookups(sock, sched, ns, keys, iters))
    take = take_slots_calls(sched, ns, max(200, iters // 5))
    out.update({"take_slots256_p50_us": pct(take, 50), "take_slots256_p99_us": pct(take, 99)})
    return out


def _us(r: dict, key: str) -> str:
    return f"p50 {r[key + '_p50_us']:7.0f} us  p99 {r[key + '_p99_us']:7.0f} us"


def print_summary(r: dict[str, Any]) -> None:
    print(f"\nkvpool control plane + host path ({r['device']}, {r['date']}, load average "
          f"{r['load_average'][0]:.1f})")
    print("  lookup 256 keys in the index (scheduler's process), wall / thread CPU:")
    for what, key in (("1 client", "lookup256_1client"), ("8 clients", "lookup256_8clients"),
                      ("busy daemon", "lookup256_busy")):
        h = r[key + "_hits"]
        print(f"    {what:12s} {_us(r, key)}  cpu p50 {r[key + '_cpu_p50_us']:5.0f} p99 "
              f"{r[key + '_cpu_p99_us']:6.0f} us  hits {h['min']}-{h['max']} of {LOOKUP_KEYS}"
              + ("  (target p99 <= 100)" if what != "1 client" else ""))
    c = r["lookup256_busy_churn"]
    print(f"    busy: the writer stored {c['writer_blocks_per_s']:.0f} blocks/s; while timed "
          f"({c['timed_s']:.2f} s) the daemon stored {c['stored_blocks']} and evicted "
          f"{c['evictions']}; index keys {c['index_keys_before']} -> {c['index_keys_after']}")
    print(f"    8 clients: the daemon used {r['lookup256_8clients_daemon_cpu_share']:.3f} of a "
          f"core meanwhile")
    print(f"  round trip (floor)          {_us(r, 'floor')}")
    print(f"  lookup 256, round trip, 1   {_us(r, 'roundtrip_lookup256_1client')}  = "
          f"{r['roundtrip_lookup256_1client_ratio']:.2f}x floor")
    print(f"  lookup 256, round trip, 8   {_us(r, 'roundtrip_lookup256_8clients')}  = "
          f"{r['roundtrip_lookup256_8clients_ratio']:.2f}x floor")
    print("  CPU per round trip (us)  client thread / client I/O / daemon main / daemon I/O:")
    for what, cpu in r["round_trip_cpu_us"].items():
        print(f"    {what:10s} {cpu['client_main_us']:6.0f} / {cpu['client_io_us']:5.0f} / "
              f"{cpu['daemon_main_us']:6.0f} / {cpu['daemon_io_us']:5.0f}")
    print(f"  8 round-trip clients: daemon main thread "
          f"{r['roundtrip_lookup256_8clients_daemon_main_us']:.0f} us per lookup; mean latency "
          f"{r['roundtrip_lookup256_8clients_mean_us']:.0f} us, at least "
          f"{r['roundtrip_lookup256_8clients_daemon_bound_us']:.0f} us (8 x the daemon's)")
    print(f"  reserve 256 tickets         {_us(r, 'reserve256')}")
    print(f"  take_slots 256 (stock)      {_us(r, 'take_slots256')}")
    print(f"  host path, {r['host_blocks']} x {r['host_block_bytes'] >> 20} MiB blocks:")
    print(f"    memcpy (limit)  {r['memcpy_GBps']:6.2f} GB/s")
    print(f"    kvpool store    {r['host_store_GBps']:6.2f} GB/s = {r['host_store_ratio']:.2f}x "
          f"memcpy (target >= 0.8x)")
    print(f"    kvpool load     {r['host_load_GBps']:6.2f} GB/s = {r['host_load_ratio']:.2f}x memcpy")
    print(f"    naive per-block {r['naive_per_block_GBps']:6.2f} GB/s = {r['naive_ratio']:.2f}x "
          f"memcpy")
    if "connector_methods" not in r:
        return
    for title, key in (("kvpool", "connector_methods"), (r["vllm_connector"],
                                                          "vllm_connector_methods")):
        print(f"  {title} connector, {r['connector_requests']} running requests (us):")
        for sched_name, ms in r[key].items():
            rows = [(m, v) for m, v in ms.items() if not m.startswith("_")]
            rows += [(f"({m})", v) for m, v in ms["_other"].items()]
            for meth, m in rows:
                print(f"    {sched_name:15s} {meth:32s} calls {m['calls']:6d}  p50 "
                      f"{m['p50_us']:7.1f}  p99 {m['p99_us']:7.1f}  max {m['max_us']:8.1f}"
                      f"  cpu p50 {m['cpu_p50_us']:6.1f} p99 {m['cpu_p99_us']:7.1f}")
            print(f"    {sched_name:15s} {ms['_steps']} steps timed, "
                  f"{ms['_loaded_requests']} requests loaded a hit")
    for sched_name, m in r["connector_no_store_planning"].items():
        print(f"    {sched_name:15s} kvpool build_connector_meta, no store planning: p50 "
              f"{m['p50_us']:7.1f}  p99 {m['p99_us']:7.1f}")
    print(f"  worst p99: kvpool {r['connector_method_p99_us']:.1f} "
          f"({r['connector_method_p99_worst']}), vLLM {r['vllm_connector_method_p99_us']:.1f} "
          f"({r['vllm_connector_method_p99_worst']}): ratio "
          f"{r['connector_vs_vllm_p99_ratio']:.2f} (target <= 1.25)")
    print(f"  build_connector_meta p99: kvpool {r['build_connector_meta_p99_us']:.1f}, vLLM "
          f"{r['vllm_build_connector_meta_p99_us']:.1f}; other hooks' worst p99: kvpool "
          f"{r['connector_other_methods_p99_us']:.1f}, vLLM "
          f"{r['vllm_connector_other_methods_p99_us']:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=CONNECTOR_REQUESTS,
                    help="requests running at once in the connector arm")
    ap.add_argument("--decode", type=int, default=256, help="tokens each of them decodes")
    ap.add_argument("--out", default="", help="directory for the JSON (default bench/results)")
    ap.add_argument("--skip-connector", action="store_true",
                    help="leave out the connector methods (no vLLM needed)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvpool-bench-")
    sock = os.path.join(tmp, "kvpoold.sock")
    pool_name = f"kvpool-bench-{secrets.token_hex(4)}"
    block_bytes = 32 * 2 * 16 * 8 * 128 * 2
    pool_size = f"{(args.blocks * block_bytes * 5 // 4 + (256 << 20)) >> 20}MiB"
    daemon = start_daemon(sock, pool_name, pool_size)
    results: dict = {"device": f"cpu {platform.processor() or platform.machine()}, "
                               f"{os.cpu_count()} cores", "date": datetime.date.today().isoformat(),
                     "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                     "load_average_at_start": os.getloadavg()}
    try:
        cfg = ClientConfig(socket=sock, timeout_ms=60_000)
        small, sched, ns, keys = lookup_setup(cfg, "bench-small")
        results.update(lookup_figures(sock, tmp, sched, ns, keys, args.iters, daemon.pid))
        if not args.skip_connector:
            results.update(connector_figures(args.requests, args.decode, sock=sock, tmp=tmp))
        results.update(host_path(cfg, sched, args.blocks))
        results["load_average"] = os.getloadavg()
        small[4].close()
        sched.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)

    print_summary(results)
    out_dir = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"control-plane-cpu-{results['date']}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
