"""Single-block round trip on the host path: one 2 MiB block stored or loaded, request to
completion seen by the worker, next to the empty-request floor (Ping).

    python -m bench.investigations.single_block [--reps 500] [--out DIR] [--trace]

Starts a real kvpoold (host path only, ``--cuda off``) on a temporary socket. The block is a
Llama-3.1-8B block (32 layers x K/V x 16 tokens x 8 heads x 128 x bf16 = 2 MiB, per-layer
layout). Each store sample is ``submit_store`` of one reserved ticket and its key through
``wait`` for its ``JobDone`` (the ``reserve`` before it is not timed; binding the ticket to a
slot is, as in an engine's store); each load sample is
``submit_load`` of one pinned committed slot through its completion (lookup and release not
timed). The host copy goes through the same daemon hops as a GPU job (dispatch, engine,
completion, reply), so this is where those hops are measured without a GPU.

``--trace`` runs the daemon with ``KVPOOL_TRACE`` and prints the median of each hop.
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
import sys
import tempfile
import time

import numpy as np

from bench.control_plane import kv_setup, pct, start_daemon, timed_calls  # noqa: E402

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.shared.config import ClientConfig  # noqa: E402

BLOCKS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--out", default="", help="directory for the JSON (default: none)")
    ap.add_argument("--trace", action="store_true", help="per-hop medians (KVPOOL_TRACE)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvpool-single-")
    sock = os.path.join(tmp, "kvpoold.sock")
    trace = os.path.join(tmp, "trace.txt")
    if args.trace:
        os.environ["KVPOOL_TRACE"] = trace
    daemon = start_daemon(sock, f"kvpool-single-{secrets.token_hex(4)}", "256MiB")
    os.environ.pop("KVPOOL_TRACE", None)
    results: dict = {"device": f"cpu {platform.processor() or platform.machine()}, "
                               f"{os.cpu_count()} cores", "date": datetime.date.today().isoformat(),
                     "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                     "reps": args.reps}
    try:
        cfg = ClientConfig(socket=sock, timeout_ms=60_000)
        mem, kv, layout, ns, worker, reg = kv_setup(cfg, BLOCKS, 32, 8, 128, 16, "bench-single")
        kv.view(-1)[:] = 1
        sched = SchedulerClient(cfg, "bench")
        fresh = iter(range(10**9))
        keys: list[bytes] = []

        def store_once() -> float:
            key = b"%016d" % next(fresh)
            grant = sched.reserve(ns, 1)
            t0 = time.perf_counter()
            done = worker.wait([worker.submit_store(reg, [next(fresh) % BLOCKS], grant.slots,
                                                    keys=[key], grant=grant.daemon_id)], 60)
            dt = time.perf_counter() - t0
            assert done[0].ok and done[0].nbytes, done[0]
            keys.append(key)
            return dt

        def load_once() -> float:
            hit = sched.lookup(ns, [[keys[-1]]], pin=True)
            assert hit.hits == [1]
            t0 = time.perf_counter()
            done = worker.wait([worker.submit_load(reg, hit.slots[0], [0])], 60)
            dt = time.perf_counter() - t0
            assert done[0].ok, done[0].message
            sched.release(hit.leases)
            return dt

        floor = timed_calls(sched.ping, args.reps)
        for _ in range(50):                  # warm: torch import, page faults
            store_once()
            load_once()
        if args.trace:
            open(trace, "w").close()
        store = [store_once() * 1e6 for _ in range(args.reps)]
        load = [load_once() * 1e6 for _ in range(args.reps)]
        results.update({
            "block_bytes": layout.shard_bytes,
            "floor_p50_us": pct(floor, 50), "floor_p99_us": pct(floor, 99),
            "single_block_store_p50_us": pct(store, 50),
            "single_block_store_p99_us": pct(store, 99),
            "single_block_load_p50_us": pct(load, 50),
            "single_block_load_p99_us": pct(load, 99),
        })
        for client in (worker, sched):
            client.close()
        del kv
        mem.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        if args.trace:
            results["hops_p50_us"] = hops(trace)
        shutil.rmtree(tmp, ignore_errors=True)

    r = results
    print(f"\nkvpool single block, host path ({r['device']}, {r['date']}), "
          f"{r['block_bytes'] >> 20} MiB, {r['reps']} reps")
    print(f"  round trip (floor)  p50 {r['floor_p50_us']:7.0f} us  p99 {r['floor_p99_us']:7.0f} us")
    for what in ("store", "load"):
        print(f"  single-block {what:5s}  p50 {r[f'single_block_{what}_p50_us']:7.0f} us  p99 "
              f"{r[f'single_block_{what}_p99_us']:7.0f} us")
    for kind, hop in r.get("hops_p50_us", {}).items():
        print(f"  {kind} hops p50 (us): " + ", ".join(f"{k} {v:.0f}" for k, v in hop.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = os.path.join(args.out, f"single-block-cpu-{r['date']}.json")
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"  written to {out}")


def hops(path: str) -> dict[str, dict[str, float]]:
    """Median of each hop of the daemon's job trace (see ``CopyJobs._job_done``, daemon/copy_jobs.py): received,
    submitted, the engine's stamps (copy started, launched, done), completion on the loop,
    reply sent (the fields after it, a store's commit and the chunks' stamps, are not read)."""
    out: dict[str, dict[str, float]] = {}
    rows: dict[str, list[list[int]]] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            rows.setdefault(parts[2], []).append([int(x) for x in parts[4:11]])
    for kind, rs in rows.items():
        a = np.asarray(rs, dtype=np.int64)
        recv, sub, start, launched, done, cb, sent = a.T
        named = {"recv->submitted": sub - recv, "recv->sent": sent - recv,
                 "loop->sent": sent - cb}
        if (start > 0).all():     # the engine stamped its hops (an inline copy starts before
            named.update({        # "submitted" is stamped: hence recv->copy start)
                "recv->copy start": start - recv, "copy": done - start,
                "copy done->loop": cb - done})
        out[kind] = {k: float(np.median(v)) / 1e3 for k, v in named.items()}
    return out

if __name__ == "__main__":
    main()
