"""One kvpoold for every engine of a host (issue 28): N engine processes storing and loading
through one daemon at once, against what N processes copying at once can do on this host.

For each N of ``--engines``, with a fresh daemon:

- the limit: N processes copying contiguous buffers at once each way and both ways (GPU: pinned
  memcpy H2D / D2H / both on two streams, process i on GPU i mod ``--gpus`` and on that GPU's
  NUMA node; ``--host``: private memory <-> POSIX shared memory over the daemon's copy
  threads), with their bytes per CPU second: on shared cores the daemon's bytes per CPU
  second against those (``cpu_efficiency``) say what its copies cost where GB/s says only
  what share of the cores it got;
- per layout (Llama-3.1-8B, 2 MiB blocks, block-outermost and per-layer rows), N engine
  processes (``bench/gpu_worker.py``; ``--host``: KV in shared host memory), each with its
  own registration, storing on the engine's path (tickets reserved ahead, then keyed stores
  that find their slots, evicting, in the store's own dispatch). Before any timing each engine
  stores the blocks its loads will read and leases them (a lookup that pins: what loads in
  flight hold), then the engines fill the pool past full, so every timed store evicts
  (``pool``: its state then, the leased share). Then all storing, all loading, all doing both,
  four jobs in flight each, for ``--seconds``: aggregate GB/s, its ratio to the limit, the
  daemon's CPU seconds per GB moved (``/proc/<pid>/stat``) and, per phase, the busiest daemon
  thread's share of one core (``/proc/<pid>/task/*/schedstat``; the event loop is the main
  thread): a thread near 1.0 is where the daemon bounds the rate; and the NUMA nodes of the
  pool's pages, of each GPU, and the daemon's placement plan (``daemon/numa.py``);
- (GPU) a bf16 8192^3 GEMM loop in every engine's own process, alone and beside its own full
  offload, all engines at once: the slowdown per engine;
- the lookup of 256 committed keys by N scheduler processes at once while the engines offload
  (store): p50 / p99 (``lookup_hits`` is the one call that asks the daemon's index);
- a P/D hand-off (``bench/pd_handoff.py``'s, told per chunk) from engine 0 to engine 1 (GPU 0
  to GPU 1 where there are two), alone and while the other engines offload.

Writes ``<out>/host-scale-<device>-<date>.json`` (the keys of the issue for the largest N at
the top level) and a PNG beside it when matplotlib is importable.

Run: ``python -m bench.host_scale`` (every GPU), ``--engines 1,2,4 --gpus 1`` (engines sharing
one GPU), ``--host --engines 1,2 --quick`` (no CUDA: the host path).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# The shared helpers (engine stand-in, daemon start, lookup client, P/D hand-off) are imported
# here and only here, so that moving them elsewhere changes these lines alone.

from bench.gpu_transfer import start_daemon  # noqa: E402
from bench.gpu_worker import Worker, gpu_count, start_workers  # noqa: E402
from bench.pd_handoff import handoff  # noqa: E402
from bench.copy_limits import DIRECTIONS, GB, context, limits  # noqa: E402

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.shared.config import ClientConfig  # noqa: E402

BLOCK_BYTES = 2 << 20
# offload_for's kinds for each direction
KINDS = {"store": "stores", "load": "loads", "bidir": "both"}
TARGET_RATIO = 0.9
HEADLINE = ("engines", "aggregate_store_ratio", "aggregate_load_ratio", "aggregate_bidir_ratio",
            "gemm_slowdown_max", "lookup_p99_us", "daemon_cpu_s_per_GB",
            "daemon_busiest_thread_util", "daemon_busiest_thread_util_per_phase")
LOOKUP_KEYS = 256
# Leases of the blocks the loads read outlast the run (the default 30 s would let a long run's
# full pool evict them under the loads).
LEASE_TTL_S = 3600
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))
_T0 = time.monotonic()


def say(n: int, text: str) -> None:
    """A progress line, with the seconds since start (where a slow run spends its time)."""
    print(f"[N={n} +{time.monotonic() - _T0:.1f}s] {text}", flush=True)



def cpu_times(pid: int) -> tuple[float, dict[int, float], dict[int, str]]:
    """CPU seconds (user + system) of process ``pid``, and of each of its threads from the
    scheduler's own accounting (``schedstat``, ns: the tick-based ``stat`` is 10 ms coarse),
    with the threads' names."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) * _TICK_S
    threads, names = {}, {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                threads[int(tid)] = int(f.read().split()[0]) / 1e9
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except (OSError, ValueError, IndexError):
            pass                         # a thread that ended between listing and reading
    return total, threads, names


def on_all(engines: list[Worker], cmd: tuple, timeout_s: float) -> list[Future]:
    """``cmd`` sent to every engine at once, each answer awaited on a thread of its own."""
    ex = ThreadPoolExecutor(len(engines))
    futs = [ex.submit(w.call, *cmd, timeout_s=timeout_s) for w in engines]
    ex.shutdown(wait=False)
    return futs


def all_at_once(engines: list[Worker], cmd: tuple, timeout_s: float) -> list:
    """Every engine's answer to ``cmd``, the engines running it together."""
    return [f.result() for f in on_all(engines, cmd, timeout_s)]


def offload(engines: list[Worker], direction: str, args, blocks: list[int],
            daemon_pid: int) -> dict[str, Any]:
    """Every engine offloading in ``direction`` for ``args.seconds``: aggregate GB/s and what
    the daemon spent."""
    cpu0, th0, _ = cpu_times(daemon_pid)
    t0 = time.perf_counter()
    rates = all_at_once(engines, ("bench", "offload_for", args.seconds, args.per_job, blocks,
                                  blocks, KINDS[direction]), 120 + 4 * args.seconds)
    wall = time.perf_counter() - t0
    cpu1, th1, names = cpu_times(daemon_pid)
    per = [r * BLOCK_BYTES / GB for r in rates]
    moved_gb = sum(per) * args.seconds
    busy = {tid: (th1[tid] - th0.get(tid, 0.0)) / wall for tid in th1}
    busiest = max(busy, key=busy.get) if busy else daemon_pid
    return {"GBps": sum(per), "per_engine_GBps": [round(x, 2) for x in per],
            "daemon_cpu_s": cpu1 - cpu0, "moved_GB": moved_gb,
            "daemon_cpu_s_per_GB": (cpu1 - cpu0) / moved_gb if moved_gb else math.inf,
            "daemon_cores": (cpu1 - cpu0) / wall,
            "daemon_loop_util": busy.get(daemon_pid, 0.0),
            "daemon_busiest_thread_util": busy.get(busiest, 0.0),
            # (Python threads are all called "python" before 3.14)
            "daemon_busiest_thread": "event loop" if busiest == daemon_pid
            else f"{names.get(busiest, '?')} (tid {busiest})"}


def numa_nodes() -> dict[str, Any]:
    """The host's NUMA nodes and the node of each NVIDIA PCI function: on a two-socket host
    half the GPUs read a pool placed on one node across the socket link."""
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    gpus = {}
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        try:
            if (dev / "vendor").read_text().strip() == "0x10de" and \
                    (dev / "class").read_text().startswith("0x03"):
                gpus[dev.name] = int((dev / "numa_node").read_text())
        except OSError:
            continue
    return {"nodes": nodes, "gpu_numa_node": gpus}


def pool_pages_per_node(pid: int, pool_name: str) -> dict[str, int]:
    """Pages of the daemon's pool mapping on each NUMA node (``/proc/<pid>/numa_maps``)."""
    out: dict[str, int] = {}
    try:
        lines = Path(f"/proc/{pid}/numa_maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        if pool_name in line:
            for f in line.split():
                if f[0] == "N" and "=" in f:
                    node, pages = f.split("=")
                    out[node] = out.get(node, 0) + int(pages)
    return out


def start_engines(devices: list[int], layout: str, blocks: int, sock: str) -> list[Worker]:
    """One engine per entry of ``devices``, started together; engines 0 and 1 share a
    namespace (the P/D pair), every other engine has its own."""
    engines = start_workers([(d, layout, blocks) for d in devices])
    for i, w in enumerate(engines):
        w.call("connect", sock, namespace(layout, "pd" if i < 2 else f"engine{i}"), 0, 1)
    all_at_once(engines, ("fill", 1), 120)
    return engines


def namespace(layout: str, who: str) -> bytes:
    return hashlib.blake2b(f"scale-{layout}-{who}".encode(), digest_size=16).digest()


def gemm_beside_offload(engines: list[Worker], args, blocks: list[int]) -> dict[str, Any]:
    """Every engine's own GEMM alone and beside its own full offload, all engines at once."""
    rows = all_at_once(engines, ("bench", "gemm_offload", args.gemm_iters, args.per_job, blocks,
                                 blocks), 600)
    slow = [w / a for a, w, _ in rows]
    return {"per_engine_slowdown": [round(s, 4) for s in slow], "max_slowdown": max(slow),
            "alone_s": [a for a, _, _ in rows], "with_offload_s": [w for _, w, _ in rows],
            "offload_during_gemm_GBps": sum(r for _, _, r in rows) * BLOCK_BYTES / GB}


def lookup_hits(client: SchedulerClient, ns: bytes, keys: list[bytes]) -> int:
    """One scheduler's lookup of ``keys``: its leading hits, read in the daemon's shared-memory
    index in this process (issue 37), as the connector reads them; a round trip only where no
    index can be mapped (then ``lookup_mode`` in the results says so)."""
    got = client.find(ns, keys)
    if got is None:
        return client.lookup(ns, [keys]).hits[0]
    return got[0]


def lookup_process(sock: str, ns: bytes, keys: list[bytes], n: int, start: Any, q: Any,
                   ready: Any, done: Any) -> None:
    """A scheduler process: ``n`` lookups back to back once told, their seconds to ``q``."""
    client = SchedulerClient(ClientConfig(socket=sock, timeout_ms=10_000), "scale-lookup")
    client.ping()
    ready.put(os.getpid())
    start.wait()
    lat, missed = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        hits = lookup_hits(client, ns, keys)
        lat.append(time.perf_counter() - t0)
        missed += hits != len(keys)
    q.put((lat, missed))
    # Idle until every client is done: an exiting process would take CPU from the others.
    done.wait()
    client.close()


def lookups(engines: list[Worker], sock: str, ns: bytes, keys: list[bytes], args,
            blocks: list[int]) -> dict[str, Any]:
    """p50/p99 of N scheduler processes looking up 256 committed keys at once while the
    engines offload (store), on the pool that is full."""
    ctx = context(args.host)
    start, done, q, ready = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=lookup_process, args=(sock, ns, keys, args.lookups, start, q,
                                                      ready, done), daemon=True)
             for _ in engines]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=600)
        secs = args.lookup_seconds
        busy = on_all(engines, ("bench", "offload_for", secs, args.per_job, blocks, blocks,
                                "stores"), 120 + 4 * secs)
        t_end = time.monotonic() + secs
        start.set()
        answers = [q.get(timeout=600) for _ in procs]
        lat = [x * 1e6 for a, _ in answers for x in a]
        missed = sum(m for _, m in answers)
        overlapped = time.monotonic() <= t_end
        done.set()
        rates = [f.result() for f in busy]
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"clients": len(procs), "lookups_per_client": args.lookups, "keys": len(keys),
            "p50_us": pct(lat, 50), "p99_us": pct(lat, 99), "max_us": max(lat),
            "lookups_short_of_all_keys": missed, "during_offload": overlapped,
            "offload_kind": "stores", "offload_GBps": sum(rates) * BLOCK_BYTES / GB}


def pd(engines: list[Worker], sched: SchedulerClient, args, blocks: list[int],
       layout: str) -> dict[str, Any]:
    """Engine 0 hands half its blocks to engine 1 through the pool (8 chunks, told per chunk),
    alone and while every other engine offloads both ways."""
    n = len(blocks) // 2
    ns = namespace(layout, "pd")
    prefill, decode = engines[0], engines[1]
    handoff(prefill, decode, sched, ns, min(n, 32), 2, f"warm-{os.getpid()}")
    alone = [handoff(prefill, decode, sched, ns, n, 8, f"alone-{os.getpid()}-{r}")
             for r in range(args.pd_reps)]
    out: dict[str, Any] = {"blocks": n, "chunks": 8, "alone_s": statistics.median(alone),
                           "alone_GBps": n * BLOCK_BYTES / statistics.median(alone) / GB}
    others = engines[2:]
    if others:
        running = on_all(others, ("bench", "offload_for", args.seconds, args.per_job, blocks,
                                  blocks, "both"), 120 + 4 * args.seconds)
        t_end = time.monotonic() + args.seconds
        busy: list[float] = []
        while time.monotonic() < t_end or not busy:
            busy.append(handoff(prefill, decode, sched, ns, n, 8,
                                f"busy-{os.getpid()}-{len(busy)}"))
        rates = [f.result() for f in running]
        t = statistics.median(busy)
        out.update({"with_others_s": t, "with_others_GBps": n * BLOCK_BYTES / t / GB,
                    "with_others_handoffs": len(busy),
                    "slowdown_with_others": t / out["alone_s"],
                    "others_offload_GBps": sum(rates) * BLOCK_BYTES / GB})
    return out


def fill_pool(engines: list[Worker], sched: SchedulerClient, args) -> dict[str, Any]:
    """Every engine stores fresh blocks until the pool has been filled past full (the last
    tenth of them evicting), the blocks its loads read staying leased: the pool's state after.
    """
    info = sched.info()
    capacity = info.slots_committed + info.free_bytes // BLOCK_BYTES
    per_engine = -(-(capacity + capacity // 10 - info.slots_committed) // len(engines))
    stored = all_at_once(engines, ("bench", "fill", max(0, per_engine), args.per_job,
                                   list(range(args.blocks))), 600)
    after = sched.info()
    return {"capacity_blocks": capacity, "filled_blocks": sum(stored),
            "evictions_while_filling": after.evictions - info.evictions,
            "free_bytes": after.free_bytes, "is_full": after.evictions > info.evictions,
            "slots_committed": after.slots_committed, "slots_pinned": after.slots_pinned,
            "leased_share": after.slots_pinned / max(1, after.slots_committed)}


def daemon_placement(log_path: Path) -> dict[str, Any] | None:
    """The NUMA placement the daemon logged at its start (``daemon/numa.py``), the last one."""
    return _logged_json(log_path, "numa placement: ")


def daemon_loop_cpu(log_path: Path) -> int:
    """The CPU the daemon ran its event loop alone on (``loop_cpu``; -1: anywhere), from the
    effective configuration it logged at its start, the last one."""
    config = _logged_json(log_path, "effective configuration: ") or {}
    return int(config.get("loop_cpu", -1))


def _logged_json(log_path: Path, marker: str) -> Any:
    """The JSON the daemon's log carries after ``marker`` on its last line with it."""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
                 if marker in ln]
    except OSError:
        return None
    return json.loads(lines[-1].split(marker, 1)[1]) if lines else None


def run_n(n: int, args, devices: list[int], res_n: dict[str, Any]) -> None:
    """Everything for ``n`` engines, on one fresh daemon."""
    res_n["devices"] = devices
    res_n["limit"] = limits(devices, args.limit_bytes, args.copy_threads, args.limit_seconds)
    say(n, "limit " + json.dumps({k: round(v, 2) for k, v in res_n["limit"].items()
                                          if isinstance(v, float)}))
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    per_engine = args.blocks + 4 * args.per_job
    pool_mib = n * per_engine * (BLOCK_BYTES >> 20) * 5 // 4 + 512
    proc, sock = start_daemon(tmp, f"{pool_mib}MiB",
                              {"KVPOOL_METRICS_PORT": "0", "KVPOOL_LEASE_TTL_S": str(LEASE_TTL_S),
                               "KVPOOL_COPY_THREADS": str(args.copy_threads)},
                              tag=f"-scale{n}", cuda="off" if args.host else "on")
    sched = SchedulerClient(ClientConfig(socket=sock, timeout_ms=60_000), "scale-pd")
    try:
        blocks = list(range(args.blocks))
        res_n["layouts"] = {}
        for k, layout in enumerate(args.layouts):
            engines = start_engines(devices, layout, args.blocks, sock)
            say(n, f"{n} engines started, {layout}")
            try:
                all_at_once(engines, ("bench", "store", blocks[:args.per_job]), 300)   # warm
                all_at_once(engines, ("bench", "load", blocks[:args.per_job]), 300)
                # what the loads read: every engine's blocks, committed and leased
                all_at_once(engines, ("bench", "store", blocks), 300)
                r = res_n["layouts"][layout] = {"pool": fill_pool(engines, sched, args)}
                say(n, "pool before timing " + json.dumps(r["pool"]))
                for d in DIRECTIONS:
                    r[d] = offload(engines, d, args, blocks, proc.pid)
                    r[f"{d}_ratio"] = r[d]["GBps"] / res_n["limit"][f"{d}_GBps"]
                    # Where cores are shared, GB/s is a share of them: the daemon's bytes per
                    # CPU second against a plain copy's says what its copies cost instead.
                    r[f"{d}_cpu_efficiency"] = (1 / r[d]["daemon_cpu_s_per_GB"]
                                                / res_n["limit"][f"{d}_GB_per_cpu_s"])
                res_n["pool_pages_per_numa_node"] = pool_pages_per_node(
                    proc.pid, f"kvpool-bench-{os.getpid()}-scale{n}")
                moved = sum(r[d]["moved_GB"] for d in DIRECTIONS)
                r["daemon_cpu_s_per_GB"] = sum(r[d]["daemon_cpu_s"] for d in DIRECTIONS) / moved
                say(n, f"{layout}: " + ", ".join(
                    f"{d} {r[d]['GBps']:.2f} GB/s = {r[f'{d}_ratio']:.3f}x (daemon "
                    f"{r[d]['daemon_cores']:.2f} cores, loop {r[d]['daemon_loop_util']:.2f}, "
                    f"{r[f'{d}_cpu_efficiency']:.2f}x memcpy's GB per CPU s)"
                    for d in DIRECTIONS) + f", {r['daemon_cpu_s_per_GB']:.3f} daemon CPU s/GB")
                if k == 0:
                    ns = namespace(layout, "pd")           # engine 0's, with its leased keys
                    keys = engines[0].call("bench", "keys_committed")[:LOOKUP_KEYS]
                    if not args.host:
                        res_n["gemm"] = gemm_beside_offload(engines, args, blocks)
                        say(n, f"gemm slowdown per engine {res_n['gemm']['per_engine_slowdown']}")
                    res_n["lookup"] = lookups(engines, sock, ns, keys, args, blocks)
                    say(n, f"lookup of {LOOKUP_KEYS} keys, {n} schedulers: p50 "
                           f"{res_n['lookup']['p50_us']:.0f} us, p99 "
                           f"{res_n['lookup']['p99_us']:.0f} us")
                    if n >= 2:
                        res_n["pd"] = pd(engines, sched, args, blocks, layout)
                        say(n, "P/D hand-off " + json.dumps(
                            {k2: (round(v, 4) if isinstance(v, float) else v)
                             for k2, v in res_n["pd"].items()}))
            finally:
                for w in engines:
                    w.close()
    finally:
        res_n["numa_placement"] = daemon_placement(tmp / "kvpoold.log")
        res_n["loop_cpu"] = daemon_loop_cpu(tmp / "kvpoold.log")
        sched.close()
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:  # noqa: BLE001 - a daemon that will not stop is killed
            proc.kill()


def headline(n: int, r: dict[str, Any], host: bool) -> dict[str, Any]:
    """The issue's keys for one N: each ratio the worse of the layouts."""
    lay = r["layouts"].values()
    return {
        "engines": n,
        "aggregate_store_ratio": min(x["store_ratio"] for x in lay),
        "aggregate_load_ratio": min(x["load_ratio"] for x in lay),
        "aggregate_bidir_ratio": min(x["bidir_ratio"] for x in lay),
        "gemm_slowdown_max": None if host else r["gemm"]["max_slowdown"],
        "lookup_p99_us": r["lookup"]["p99_us"],
        "daemon_cpu_s_per_GB": max(x["daemon_cpu_s_per_GB"] for x in lay),
        # near 1.0: one daemon thread (the event loop is the main thread) bounds the rate
        "daemon_busiest_thread_util": max(x[d]["daemon_busiest_thread_util"]
                                          for x in lay for d in DIRECTIONS),
        "daemon_busiest_thread_util_per_phase": {
            d: max(x[d]["daemon_busiest_thread_util"] for x in lay) for d in DIRECTIONS},
        "daemon_loop_util_per_phase": {
            d: max(x[d]["daemon_loop_util"] for x in lay) for d in DIRECTIONS},
        "pool_full_before_timing": all(x["pool"]["is_full"] for x in lay),
        "leased_share": min(x["pool"]["leased_share"] for x in lay),
    }


def chart(res: dict[str, Any], path: Path) -> str:
    """Aggregate GB/s and ratios against N; returns why not when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return "no PNG: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = sorted(int(n) for n in res["runs"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {"store": "tab:blue", "load": "tab:orange", "bidir": "tab:green"}
    for d, c in colors.items():
        ax.plot(ns, [res["runs"][str(n)]["limit"][f"{d}_GBps"] for n in ns], ":", marker="x",
                color=c, label=f"{d} limit (N processes copying)")
        for layout, style in zip(res["layouts"], ("-", "--")):
            ax.plot(ns, [res["runs"][str(n)]["layouts"][layout][d]["GBps"] for n in ns],
                    style, marker="o", color=c, label=f"{d}, {layout}")
            bx.plot(ns, [res["runs"][str(n)]["layouts"][layout][f"{d}_ratio"] for n in ns],
                    style, marker="o", color=c, label=f"{d}, {layout}")
    bx.axhline(TARGET_RATIO, color="k", linewidth=1, label=f"target {TARGET_RATIO}")
    ax.set_xlabel("engines")
    ax.set_ylabel("aggregate GB/s")
    bx.set_xlabel("engines")
    bx.set_ylabel("ratio to the limit")
    for a in (ax, bx):
        a.set_xticks(ns)
        a.legend(fontsize=7)
    fig.suptitle(f"kvpool, N engines through one kvpoold: {res['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return ""


def engine_counts(spec: str, gpus: int, host: bool) -> list[int]:
    """``--engines``, or by default 1, 2, 4, 8 up to the GPUs used (and their number)."""
    if spec:
        return sorted({int(x) for x in spec.split(",")})
    if host:
        return [1, 2, 4, 8]
    return sorted({x for x in (1, 2, 4, 8) if x <= gpus} | {gpus})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="",
                    help="engine counts, e.g. 1,2,4,8 (default: 1, 2, 4, 8 up to --gpus)")
    ap.add_argument("--gpus", type=int, default=0,
                    help="GPUs to use (default all); engine i runs on GPU i mod this")
    ap.add_argument("--host", action="store_true",
                    help="no CUDA: engines keep KV in shared host memory (the host path)")
    ap.add_argument("--quick", action="store_true", help="small and short (CI, smoke runs)")
    ap.add_argument("--layouts", default="block_outer,per_layer")
    ap.add_argument("--blocks", type=int, default=0, help="2 MiB blocks per engine")
    ap.add_argument("--per-job", type=int, default=0, help="blocks per job (four in flight)")
    ap.add_argument("--seconds", type=float, default=0, help="seconds per offload phase")
    ap.add_argument("--gemm-iters", type=int, default=0)
    ap.add_argument("--lookups", type=int, default=0, help="lookups per scheduler process")
    ap.add_argument("--pd-reps", type=int, default=3)
    ap.add_argument("--copy-threads", type=int, default=2,
                    help="--host: the daemon's copy threads (KVPOOL_COPY_THREADS), and the "
                         "threads each limit process copies with")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default="/tmp/kvpool-scale")
    args = ap.parse_args()
    q = args.quick
    # GPU: 512 blocks (1 GiB) per engine, 256 MiB jobs (~5 ms of PCIe each). Host: a quarter,
    # the memory of a CI machine being shared by N engines, their pool and the limit's buffers.
    big = 128 if args.host else 512
    args.blocks = args.blocks or (big // 2 if q else big)
    args.per_job = args.per_job or max(8, args.blocks // 4)
    args.seconds = args.seconds or (1.5 if q else 3.0)
    args.limit_seconds = max(0.5, args.seconds / 2)
    args.limit_bytes = (64 if args.host else 256) << 20
    args.gemm_iters = args.gemm_iters or (100 if q else 200)
    args.lookups = args.lookups or (200 if q else 1000)
    args.lookup_seconds = 2 * args.seconds
    args.layouts = args.layouts.split(",")
    if args.host:
        gpus, device = 0, f"cpu-{os.cpu_count()}cores"
        label = f"cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    else:
        gpus = args.gpus or gpu_count()
        if gpus < 1:
            raise SystemExit("no GPU: run with --host for the host path")
        import torch
        name = torch.cuda.get_device_name(0)
        device = f"{name.replace(' ', '_').replace('/', '_')}_x{gpus}"
        label = f"{gpus} x {name}, {os.cpu_count()} cores"
    counts = engine_counts(args.engines, gpus, args.host)
    res: dict[str, Any] = {
        "device": label, "mode": "host" if args.host else "gpu", "gpus": gpus,
        "cores": os.cpu_count(), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": " ".join(shlex.quote(a) for a in sys.argv), "block_bytes": BLOCK_BYTES,
        "blocks_per_engine": args.blocks, "blocks_per_job": args.per_job,
        "seconds_per_phase": args.seconds, "layouts": args.layouts, "numa": numa_nodes(),
        "target_ratio": TARGET_RATIO,
        "note": "ratios: aggregate GB/s through one kvpoold over N processes copying at once on "
                "the same host; headline keys are the largest N's, each the worse layout",
        "runs": {}}
    for n in counts:
        devices = [-1] * n if args.host else [i % gpus for i in range(n)]
        run_n(n, args, devices, res["runs"].setdefault(str(n), {}))
    for n in counts:
        res["runs"][str(n)]["headline"] = headline(n, res["runs"][str(n)], args.host)
    res.update(res["runs"][str(counts[-1])]["headline"])
    if args.host:
        res["gemm_note"] = "host mode: no GPU, so no GEMM beside the offload"
    if args.host and (os.cpu_count() or 1) < 2 * counts[-1]:
        res["scaling_note"] = (f"{os.cpu_count()} cores for {counts[-1]} engines, their "
                               "copies and the daemon: these figures show the flow works, "
                               "not how a host scales")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"host-scale-{device}-{dt.date.today().isoformat()}"
    why = chart(res, out / f"{stem}.png")
    if why:
        res["png_note"] = why
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    print("[summary] " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                     for k, v in res.items()
                                     if k in HEADLINE}), flush=True)
    print(f"written {out / stem}.json", flush=True)


if __name__ == "__main__":
    main()
