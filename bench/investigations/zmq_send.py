"""What a scheduler's non-blocking send costs, with kvpool's zmq thread policy and without.

    python -m bench.investigations.zmq_send [--reps 300] [--rounds 2] [--out DIR]

Starts a real kvpoold, then for each variant (``KVPOOL_ZMQ_SCHED_BATCH`` 1 and 0, alternating
``--rounds`` times, each in a fresh process since the policy is fixed when a context starts)
times ``SchedulerClient.lookup_start`` of 16, 256 and 512 keys as vLLM's scheduler step makes
it: right after ``ready()``, the reply taken in by ``poll()`` before the next one. The send is
split into encoding and handing the frame to libzmq; the second is where the wake-up of
libzmq's I/O thread shows on a busy host. Also the waiting round trip (Ping) each way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

from bench.control_plane import start_daemon, timed_calls  # noqa: E402

SIZES = (16, 256, 512)


def measure(sock: str, reps: int) -> dict:
    """One variant, in this process (the caller set the environment)."""
    from kvpool.client import transport
    from kvpool.client.scheduler import SchedulerClient
    from kvpool.shared import protocol as p
    from kvpool.shared.config import ClientConfig

    encode_s: list[float] = []
    hand_s: list[float] = []

    def timed_send(self, msg) -> None:
        t0 = time.perf_counter()
        data = p.encode(msg)
        t1 = time.perf_counter()
        ok = self._held.send(data)
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        hand_s.append(t2 - t1)
        if not ok:
            raise RuntimeError("send refused")

    transport.Transport._send = timed_send
    client = SchedulerClient(ClientConfig(socket=sock, timeout_ms=10_000), "bench")
    client.ping()
    us = lambda xs, q=50: round(float(statistics.quantiles(xs, n=100)[q - 1]) * 1e6, 1)  # noqa: E731
    out: dict = {"ping_p50_us": round(statistics.median(timed_calls(client.ping, reps)), 1)}
    for n in SIZES:
        keys = [[os.urandom(16) for _ in range(n // 16)] for _ in range(16)]
        total: list[float] = []
        encode_s.clear()
        hand_s.clear()
        for _ in range(reps):
            client.ready()
            t0 = time.perf_counter()
            call = client.lookup_start(b"n" * 16, keys, True)
            total.append(time.perf_counter() - t0)
            deadline = time.monotonic() + 10
            while call.result() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("no lookup reply in 10 s")
                client.poll()
            time.sleep(0.002)       # a scheduler step's spacing, roughly
        out[f"send{n}"] = {"p50_us": us(total), "p99_us": us(total, 99),
                           "encode_p50_us": us(encode_s), "hand_to_libzmq_p50_us": us(hand_s),
                           "hand_to_libzmq_p90_us": us(hand_s, 90)}
    client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="", help="directory for the JSON (default: none)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.reps)))
        return

    tmp = tempfile.mkdtemp(prefix="kvpool-send-")
    sock = os.path.join(tmp, "kvpoold.sock")
    daemon = start_daemon(sock, f"kvpool-send-{secrets.token_hex(4)}", "256MiB")
    res: dict = {"device": f"cpu {platform.processor() or platform.machine()}, "
                           f"{os.cpu_count()} cores", "date": datetime.date.today().isoformat(),
                 "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                 "rounds": []}
    try:
        for _ in range(args.rounds):
            row = {}
            for batch in ("1", "0"):
                env = dict(os.environ, KVPOOL_ZMQ_SCHED_BATCH=batch)
                done = subprocess.run([sys.executable, "-m", "bench.investigations.zmq_send", "--child", sock,
                                       "--reps", str(args.reps)], env=env, check=True,
                                      capture_output=True, text=True, timeout=600)
                row["batch" if batch == "1" else "default"] = json.loads(
                    done.stdout.strip().splitlines()[-1])
            res["rounds"].append(row)
    finally:
        daemon.terminate()
        daemon.wait()
    print(f"kvpool scheduler sends ({res['device']}, {res['date']}), {args.reps} reps, p50 us")
    for i, row in enumerate(res["rounds"]):
        for name, r in row.items():
            sends = "  ".join(f"{n} keys {r[f'send{n}']['p50_us']:6.1f} (libzmq "
                              f"{r[f'send{n}']['hand_to_libzmq_p50_us']:6.1f})" for n in SIZES)
            print(f"  round {i} {name:8s} ping {r['ping_p50_us']:6.1f}  {sends}")
        b, d = row["batch"], row["default"]
        print(f"  round {i} default/batch, 256 keys: "
              f"{d['send256']['p50_us'] / b['send256']['p50_us']:.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"zmq-send-cpu-{res['date']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"  written to {path}")


if __name__ == "__main__":
    main()
