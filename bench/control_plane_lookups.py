"""Lookups of 256 committed keys, as ``bench/control_plane.py`` times them: read in the daemon's
shared-memory index in the scheduler's own process (``SchedulerClient.find``), and as a round trip
through the daemon (``SchedulerClient.lookup``, the fallback), with the CPU each side of a round
trip spends.

Index phases: one scheduler, eight scheduler processes reading at once, each timing ``find`` back
to back, the daemon idle; then one scheduler while another process stores at full rate through
the daemon (``churn_writer``: 64-block keyed stores of new keys in a loop on the host path, two in
flight, into a namespace capped by a quota so that every store evicts: index entries are inserted
and removed all the time). Each ``find`` is timed in wall time (the figure of record) and in the
thread's CPU time (what the read itself costs; the difference is time the process did not run),
and the hits it saw are counted: all 256 while idle, or the phase fails.

Imports no torch at module level: the spawned clients import this module, and importing torch
costs ~3 s of CPU each on the 2-core machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.config import ClientConfig

LOOKUP_KEYS = 256
CLIENTS = 8
CHURN_JOB_BLOCKS = 64
CHURN_IN_FLIGHT = 2
CHURN_QUOTA_BYTES = 4 << 20        # 1024 blocks of 4 KiB: the churn evicts from its 17th job
BUSY_MAX_S = 60.0                  # the longest the busy phase waits for the index to move


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def timed_calls(fn: Callable[[], Any], n: int) -> list[float]:
    """Microseconds of ``n`` calls of ``fn``, after ``min(50, n)`` untimed."""
    for _ in range(min(50, n)):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


# ---- where a round trip's CPU goes -----------------------------------------------------------

def cpu_by_tid(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread of ``pid``: its name and seconds on CPU, from the scheduler's own accounting
    (``schedstat``, in ns)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = (name, int(f.read().split()[0]) / 1e9)
        except (OSError, ValueError, IndexError):
            continue           # a thread that ended meanwhile
    return out


def cpu_by_thread(pid: int) -> dict[str, float]:
    """Seconds on CPU of ``pid``'s main thread (``main``), ZeroMQ I/O threads (``io``) and any
    others (``other``)."""
    out = {"main": 0.0, "io": 0.0, "other": 0.0}
    for tid, (name, s) in cpu_by_tid(pid).items():
        out["main" if tid == pid else "io" if name.startswith("ZMQbg") else "other"] += s
    return out


def cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
                ) -> float:
    """CPU seconds spent between two ``cpu_by_tid`` readings by the threads alive at the second
    (a thread that ended in between took its seconds with it: summed by kind, its whole life
    came off the total and the difference went below zero)."""
    return sum(s - before.get(tid, ("", 0.0))[1] for tid, (_, s) in after.items())


def round_trip_cpu(fn: Callable[[], Any], n: int, daemon_pid: int) -> dict[str, float]:
    """Per call of ``fn`` (a round trip), us of CPU on each side: this process's main thread
    and I/O thread, the daemon's main thread and I/O thread."""
    c0, d0 = cpu_by_thread(os.getpid()), cpu_by_thread(daemon_pid)
    for _ in range(n):
        fn()
    c1, d1 = cpu_by_thread(os.getpid()), cpu_by_thread(daemon_pid)
    return {f"{side}_{kind}_us": (b[kind] - a[kind]) / n * 1e6
            for side, a, b in (("client", c0, c1), ("daemon", d0, d1)) for kind in ("main", "io")}


def _echo_serve(addr: str, ready) -> None:
    """A bare pyzmq ROUTER that sends every frame back: the Python-and-ZeroMQ floor of one
    request (no event loop, no decoding), for ``round_trip_cpu_us["bare_pyzmq_echo"]``."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(addr)
    ready.set()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        poller.poll()
        while True:
            try:
                identity, body = sock.recv(zmq.NOBLOCK), sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if body == b"bye":
                return
            sock.send(identity, zmq.SNDMORE)
            sock.send(body)


def echo_round_trip_cpu(tmp: str, n: int, body: bytes) -> dict[str, float]:
    """``round_trip_cpu`` of a plain DEALER against ``_echo_serve`` in a process of its own."""
    import zmq

    addr = f"ipc://{tmp}/echo.sock"
    ctx_mp = mp.get_context("spawn")
    ready = ctx_mp.Event()
    server = ctx_mp.Process(target=_echo_serve, args=(addr, ready))
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        if not ready.wait(120):
            raise RuntimeError("the echo server did not start")
        sock.connect(addr)

        def echo() -> None:
            sock.send(body)
            sock.recv()
        for _ in range(200):
            echo()
        return round_trip_cpu(echo, n, server.pid)
    finally:
        try:
            sock.send(b"bye", zmq.NOBLOCK)
        except zmq.Again:       # never connected: nobody to tell
            pass
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(10)
        sock.close(0)
        ctx.term()


# ---- clients in processes of their own --------------------------------------------------------

def _client(sock: str, name: str) -> SchedulerClient:
    client = SchedulerClient(ClientConfig(socket=sock, timeout_ms=10_000), name)
    if not client.connect():
        raise RuntimeError(f"{name}: kvpoold did not answer")
    return client


def roundtrip_lookup_worker(sock: str, ns: bytes, keys: list[bytes], n: int, start, q, ready,
                            done) -> None:
    client = _client(sock, "bench-roundtrip")
    ready.put(os.getpid())
    start.wait()
    q.put(timed_calls(lambda: client.lookup(ns, [keys]), n))
    # Stay idle until every client is done: an exiting process (interpreter teardown) would
    # take the CPU from those still timing.
    done.wait()
    client.close()


def timed_finds(client: SchedulerClient, ns: bytes, keys: list[bytes], n: int,
                warm: int = 50) -> tuple[list[float], list[float], Counter]:
    """``n`` calls of ``client.find`` of ``keys`` (after ``warm`` untimed): us of wall time and of
    the thread's CPU time each, and how many calls saw how many leading hits."""
    wall, cpu, hits = [], [], Counter()
    for i in range(warm + n):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        got = client.find(ns, keys)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        if got is None:
            raise RuntimeError("the scheduler cannot read the daemon's index")
        if i >= warm:
            wall.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
            hits[got[0]] += 1
    return wall, cpu, hits


def index_lookup_worker(sock: str, ns: bytes, keys: list[bytes], n: int, start, q, ready,
                        done) -> None:
    client = _client(sock, "bench-index")
    if client.find(ns, keys) is None:
        q.put(RuntimeError(f"pid {os.getpid()} cannot map the daemon's index"))
        ready.put(os.getpid())
        return
    ready.put(os.getpid())
    start.wait()
    try:
        q.put(timed_finds(client, ns, keys, n))
    except RuntimeError as e:
        q.put(e)
    done.wait()
    client.close()


def _in_processes(target, args: tuple, clients: int, timeout_s: float = 600) -> list:
    """Run ``target(*args, start, q, ready, done)`` in ``clients`` spawned processes, all timing
    at once: started only once every one is connected (a fixed sleep let the first ones time
    while the others were still importing). Returns what each put on ``q``."""
    ctx = mp.get_context("spawn")
    start, done, q, ready = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, q, ready, done))
             for _ in range(clients)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=timeout_s)
        start.set()
        got = [q.get(timeout=timeout_s) for _ in procs]
    finally:
        done.set()
        start.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got


def _hits(counts: Counter) -> dict[str, float]:
    total = sum(counts.values())
    return {"calls": total, "min": min(counts), "max": max(counts),
            "mean": sum(k * v for k, v in counts.items()) / total}


def _phase(prefix: str, wall: list[float], cpu: list[float], hits: Counter) -> dict[str, Any]:
    return {f"{prefix}_p50_us": pct(wall, 50), f"{prefix}_p99_us": pct(wall, 99),
            f"{prefix}_cpu_p50_us": pct(cpu, 50), f"{prefix}_cpu_p99_us": pct(cpu, 99),
            f"{prefix}_hits": _hits(hits)}


def _all_hit(phase: str, hits: Counter) -> None:
    if set(hits) != {LOOKUP_KEYS}:
        raise AssertionError(f"{phase}: the index answered {dict(hits)} (hits: calls), not "
                             f"{LOOKUP_KEYS} hits every time, with nothing evicting")


# ---- the phases -------------------------------------------------------------------------------

def roundtrip_lookups(sock: str, sched: SchedulerClient, ns: bytes, keys: list[bytes],
                      iters: int, daemon_pid: int) -> dict[str, Any]:
    """The round trip (``lookup``) with 1 client (this one) and ``CLIENTS`` processes, and
    the daemon main thread's CPU per lookup while they send."""
    look1 = timed_calls(lambda: sched.lookup(ns, [keys]), iters)
    per_client = iters // 2
    d0 = cpu_by_thread(daemon_pid)["main"]
    look8 = [x for got in _in_processes(roundtrip_lookup_worker, (sock, ns, keys, per_client),
                                        CLIENTS) for x in got]
    # Per request answered in the phase (each client's warm-up calls included): the daemon's
    # main thread serves one at a time, so with 8 clients always waiting the mean latency is
    # at least 8 x this (Little's law for a closed loop).
    daemon8 = ((cpu_by_thread(daemon_pid)["main"] - d0) * 1e6
               / (CLIENTS * (per_client + min(50, per_client))))
    return {"roundtrip_lookup256_1client_p50_us": pct(look1, 50),
            "roundtrip_lookup256_1client_p99_us": pct(look1, 99),
            "roundtrip_lookup256_8clients_p50_us": pct(look8, 50),
            "roundtrip_lookup256_8clients_p99_us": pct(look8, 99),
            "roundtrip_lookup256_8clients_mean_us": float(np.mean(look8)),
            "roundtrip_lookup256_8clients_daemon_main_us": daemon8,
            "roundtrip_lookup256_8clients_daemon_bound_us": CLIENTS * daemon8}


def index_lookups(sock: str, sched: SchedulerClient, ns: bytes, keys: list[bytes], iters: int,
                  daemon_pid: int) -> dict[str, Any]:
    """``find`` in the index with 1 scheduler (this one) and ``CLIENTS`` processes at once,
    the daemon idle (its CPU over the 8-client phase is recorded: it should be a heartbeat's)."""
    wall, cpu, hits = timed_finds(sched, ns, keys, iters)
    _all_hit("lookup256_1client", hits)
    out = _phase("lookup256_1client", wall, cpu, hits)
    d0, t0 = cpu_by_tid(daemon_pid), time.monotonic()
    got = _in_processes(index_lookup_worker, (sock, ns, keys, iters // 2), CLIENTS)
    d1, t1 = cpu_by_tid(daemon_pid), time.monotonic()
    wall8 = [x for w, _, _ in got for x in w]
    cpu8 = [x for _, c, _ in got for x in c]
    hits8 = sum((h for _, _, h in got), Counter())
    _all_hit("lookup256_8clients", hits8)
    out.update(_phase("lookup256_8clients", wall8, cpu8, hits8))
    out["lookup256_8clients_daemon_cpu_share"] = cpu_between(d0, d1) / max(t1 - t0, 1e-9)
    return out


def churn_writer(sock: str, ready, stop, q) -> None:
    """Store 64-block jobs of new keys at full rate, ``CHURN_IN_FLIGHT`` at once, into a
    namespace capped at ``CHURN_QUOTA_BYTES`` (so each store evicts), until ``stop``; put
    (jobs, blocks stored, failed jobs, seconds) on ``q``."""
    from collections import deque

    from bench.kvtest import HostKv

    cfg = ClientConfig(socket=sock, timeout_ms=10_000)
    kv = HostKv(blocks=CHURN_JOB_BLOCKS, model="bench-churn")
    worker = None
    sched = _client(sock, "bench-churn")
    try:
        from kvpool.client.worker import WorkerClient
        worker = WorkerClient(cfg, "bench-churn")
        reg = worker.register(kv.namespace, kv.layout, 0, kv.blocks, [kv.mem.region],
                              kv.placement, quota_bytes=CHURN_QUOTA_BYTES)
        ids = list(range(CHURN_JOB_BLOCKS))
        fresh = iter(range(1 << 62))
        in_flight: deque[int] = deque()
        jobs = blocks = failed = 0
        t0 = time.monotonic()
        ready.put(os.getpid())
        while not stop.is_set():
            grant = sched.reserve(kv.namespace, CHURN_JOB_BLOCKS)
            n = len(grant.slots)
            in_flight.append(worker.submit_store(
                reg, ids[:n], grant.slots, keys=[b"%016d" % next(fresh) for _ in range(n)],
                grant=grant.daemon_id))
            if len(in_flight) >= CHURN_IN_FLIGHT:
                done = worker.wait([in_flight.popleft()], 30)[0]
                jobs += 1
                blocks += done.nbytes // kv.layout.slot_bytes
                failed += not done.ok
        for c in worker.wait(list(in_flight), 30):
            jobs += 1
            blocks += c.nbytes // kv.layout.slot_bytes
            failed += not c.ok
        q.put((jobs, blocks, failed, time.monotonic() - t0))
    finally:
        if worker is not None:
            worker.close()
        sched.close()
        kv.close()


def busy_index_lookups(sock: str, sched: SchedulerClient, ns: bytes, keys: list[bytes],
                       iters: int) -> dict[str, Any]:
    """``find`` in the index by this scheduler while ``churn_writer`` stores at full rate. Timing
    starts once the churn evicts; it goes on past ``iters`` calls until the daemon has evicted
    and stored during the timed span (bounded by ``BUSY_MAX_S``)."""
    ctx = mp.get_context("spawn")
    ready, stop, q = ctx.Queue(), ctx.Event(), ctx.Queue()
    churn = ctx.Process(target=churn_writer, args=(sock, ready, stop, q))
    churn.start()
    try:
        ready.get(timeout=600)
        deadline = time.monotonic() + BUSY_MAX_S
        first = sched.info().evictions
        while sched.info().evictions == first:
            if time.monotonic() > deadline or not churn.is_alive():
                raise AssertionError(f"the churn did not make the daemon evict in {BUSY_MAX_S} s")
            time.sleep(0.01)
        before, t0 = sched.info(), time.monotonic()
        wall, cpu, hits = timed_finds(sched, ns, keys, iters)
        after = sched.info()
        while after.evictions == before.evictions or after.stored_blocks == before.stored_blocks:
            if time.monotonic() > deadline:
                raise AssertionError("the daemon neither evicted nor stored while timed")
            more = timed_finds(sched, ns, keys, 100, warm=0)
            wall += more[0]
            cpu += more[1]
            hits += more[2]
            after = sched.info()
        seconds = time.monotonic() - t0
    finally:
        stop.set()
    jobs, blocks, failed, churn_s = q.get(timeout=120)
    churn.join(30)
    out = _phase("lookup256_busy", wall, cpu, hits)
    out["lookup256_busy_churn"] = {
        "timed_s": seconds,
        "evictions": after.evictions - before.evictions,
        "stored_blocks": after.stored_blocks - before.stored_blocks,
        "index_keys_before": before.index_keys, "index_keys_after": after.index_keys,
        "writer_jobs": jobs, "writer_blocks": blocks, "writer_failed_jobs": failed,
        "writer_blocks_per_s": blocks / churn_s, "job_blocks": CHURN_JOB_BLOCKS,
        "quota_bytes": CHURN_QUOTA_BYTES}
    return out
