"""The round-trip floor under kvpool's requests: two bare processes, no kvpool code.

    python -m bench.investigations.transport_floor [--reps 3000] [--idle-ms 0] [--out DIR]

A client process sends a 64-byte message and waits for the 64-byte answer of an echo process,
``--reps`` times, over the transport kvpool uses (ZeroMQ DEALER -> ROUTER over ipc://) and,
side by side in the same run, over a plain Unix stream socket; each one with both ends
sleeping in the kernel until a message comes (how kvpoold and its clients wait) and with both
ends spinning on non-blocking reads (no thread wake-ups). Prints p50/p99 per variant.
``--idle-ms``: the client sleeps that long before each round trip, as a big job's copy (~40 ms
for 2 GiB) leaves both ends idle between its request and its reply: a thread woken after a long
sleep (a halted virtual CPU, a deep idle state) takes longer to run than one woken a moment
after its last message.

What it answers: how much of a single-block round trip (issue 15's target: <= 150 us, copy
included) the transport alone takes on this host. A ZeroMQ message crosses libzmq's I/O
thread on each side, so each direction wakes three threads (sender's I/O thread, receiver's
I/O thread, receiver); a Unix socket wakes one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import tempfile
import time

MSG = b"x" * 64
WARMUP = 200        # round trips left out of the figures


def _zmq_recv(s, spin: bool) -> bytes:
    if not spin:
        return s.recv()
    import zmq
    while True:
        try:
            return s.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass


def _zmq_context(cpu: int | None):
    """A context whose I/O thread runs on ``cpu`` with this process (None: anywhere)."""
    import zmq
    ctx = zmq.Context()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    return ctx


def _zmq_echo(addr: str, spin: bool, ready, cpu: int | None = None) -> None:
    import zmq
    ctx = _zmq_context(cpu)
    s = ctx.socket(zmq.ROUTER)
    s.bind(addr)
    ready.set()
    while True:
        ident = _zmq_recv(s, spin)
        body = s.recv()
        if body == b"stop":
            break
        s.send(ident, zmq.SNDMORE)
        s.send(body)
    s.close(linger=0)
    ctx.term()


def _zmq_client(addr: str, spin: bool, reps: int, idle_s: float,
                cpu: int | None = None) -> list[float]:
    import zmq
    ctx = _zmq_context(cpu)
    s = ctx.socket(zmq.DEALER)
    s.connect(addr)
    out = []
    for i in range(WARMUP + reps):
        if idle_s and i >= WARMUP:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        s.send(MSG)
        _zmq_recv(s, spin)
        if i >= WARMUP:
            out.append(time.perf_counter() - t0)
    s.send(b"stop")
    s.close(linger=1000)
    ctx.term()
    return out


def _recv_exact(conn: socket.socket, n: int, spin: bool) -> bytes:
    buf = b""
    while len(buf) < n:
        try:
            part = conn.recv(n - len(buf), socket.MSG_DONTWAIT if spin else 0)
        except BlockingIOError:
            continue
        if not part:
            return buf
        buf += part
    return buf


def _unix_echo(path: str, spin: bool, ready) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    while True:
        body = _recv_exact(conn, len(MSG), spin)
        if len(body) < len(MSG):
            break
        conn.sendall(body)
    conn.close()
    srv.close()


def _unix_client(path: str, spin: bool, reps: int, idle_s: float) -> list[float]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    out = []
    for i in range(WARMUP + reps):
        if idle_s and i >= WARMUP:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        c.sendall(MSG)
        _recv_exact(c, len(MSG), spin)
        if i >= WARMUP:
            out.append(time.perf_counter() - t0)
    c.close()
    return out


def run_variant(kind: str, spin: bool, reps: int, path: str, idle_s: float = 0.0,
                cpus: tuple[int, int] | None = None) -> dict:
    """``cpus``: (echo's, client's) CPU, each process and its ZeroMQ I/O thread on its own."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    if kind == "zmq":
        target, client, addr = _zmq_echo, _zmq_client, f"ipc://{path}"
    else:
        target, client, addr = _unix_echo, _unix_client, path
    pin = () if cpus is None else (cpus[0],)
    echo = ctx.Process(target=target, args=(addr, spin, ready, *pin), daemon=True)
    echo.start()
    assert ready.wait(60), f"{kind} echo did not start"
    try:
        xs = client(addr, spin, reps, idle_s, *(() if cpus is None else (cpus[1],)))
    finally:
        echo.join(10)
        if echo.is_alive():
            echo.kill()
    q = statistics.quantiles(xs, n=100)
    return {"p50_us": round(statistics.median(xs) * 1e6, 1), "p99_us": round(q[98] * 1e6, 1),
            "reps": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2, help="alternating passes over the variants")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="the client sleeps this long before each timed round trip")
    ap.add_argument("--out", default="", help="directory for the JSON (default: print only)")
    args = ap.parse_args()
    # zmq_pinned: each process on one CPU of its own with its ZeroMQ I/O thread (a wake-up
    # of the I/O thread by the process's own thread, or the other way, stays on that CPU)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = (cpus[-1], cpus[-2]) if len(cpus) > 1 else None
    variants = [("zmq", False, None), ("unix", False, None), ("zmq", True, None),
                ("unix", True, None)] + ([("zmq", False, pinned)] if pinned else [])
    name_of = {v: f"{v[0]}_{'pinned' if v[2] else 'spin' if v[1] else 'sleep'}" for v in variants}
    results: dict = {name_of[v]: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="kvpool-floor-") as tmp:
        for r in range(args.rounds):
            for v in variants:
                kind, spin, on = v
                name = name_of[v]
                res = run_variant(kind, spin, args.reps, os.path.join(tmp, f"{name}-{r}.sock"),
                                  args.idle_ms / 1e3, on)
                results[name].append(res)
                print(f"round {r}: {name:10s} p50 {res['p50_us']:7.1f} us  p99 "
                      f"{res['p99_us']:7.1f} us", flush=True)
    best = {name: min(rs, key=lambda x: x["p50_us"]) for name, rs in results.items()}
    out = {"device": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": "python -m bench.investigations.transport_floor " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
           "rounds": results, "best_round": best,
           "zmq_sleep_over_unix_sleep": round(best["zmq_sleep"]["p50_us"]
                                              / best["unix_sleep"]["p50_us"], 2),
           "note": "round trip of a 64-byte message between two processes; no kvpool code"}
    print(json.dumps({k: out[k] for k in ("best_round", "zmq_sleep_over_unix_sleep")}, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        idle = f"-idle{args.idle_ms:g}ms" if args.idle_ms else ""
        name = f"transport-floor-{datetime.date.today().isoformat()}{idle}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
