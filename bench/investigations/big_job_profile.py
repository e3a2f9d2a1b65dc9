"""Where a big job's fixed cost goes, on a GPU host, with nothing else in the run (issue 36).

    python -m bench.investigations.big_job_profile [--reps 20] [--layout block_outer] [--out DIR]

``bench/gpu_transfer.py`` finds a 1024-block block-outermost store ~2.3 ms and a load ~1.7 ms
over their memcpy (0.96 leaves 1.6 ms), and a store's last 32-slot commit at 0.21-0.28 ms on the
H200 host where the same work takes ~30 us in process on a 2-core VM
(``big_job_path.py``). This runs only such jobs through a real kvpoold, each right after a
plain memcpy of its bytes as gpu_transfer does (both processes idle ~40 ms before each
request), ``--reps`` stores and loads alternated, and:

- reports gpu_transfer's ``big_jobs`` hops of these jobs (with the client's submit call split
  off: ``client_submit``, the call's own time; ``submitted_to_recv``, the transport and the
  request's decode) and the paired ratios;
- times the worker's submit call in parts (``client_submit_parts_us``: the store's event
  record, each request built and encoded, a connection check), each after 40 ms idle;
- with ``--pyspy``, samples the daemon and the worker with py-spy (``--rate`` Hz, only
  threads that are running: an idle loop's samples would drown the ~1 ms per job it works)
  during exactly these jobs, into folded-stack files, and sums the daemon's samples per thread
  and per top frame.

Writes ``<out>/big-job-profile-<date>.json`` and the py-spy files beside it.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from bench.gpu_transfer import (BLOCK_BYTES, LinkReference, Worker, big_jobs, read_trace,
                                pyspy_record, start_daemon, stop_daemon)


def summarize(path: Path, top: int = 25) -> dict:
    """Samples per thread, and per (thread, innermost frames) of the busiest ones."""
    per_thread: collections.Counter = collections.Counter()
    per_leaf: collections.Counter = collections.Counter()
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0]
        n = int(count)
        per_thread[thread] += n
        per_leaf[f"{thread} :: " + " <- ".join(reversed(frames[-3:]))] += n
    return {"samples_per_thread": dict(per_thread.most_common()),
            "top_stacks": dict(per_leaf.most_common(top))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/big-job-profile")
    ap.add_argument("--tmp", default="/tmp/kvpool-bjp")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layout", default="block_outer")
    ap.add_argument("--pool-size", default="12GiB")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the same flow on host memory, no GPU (the ratios mean nothing)")
    args = ap.parse_args()
    out, tmp = Path(args.out), Path(args.tmp)
    out.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    trace_path = tmp / "trace.txt"
    trace_path.unlink(missing_ok=True)
    cpu = args.dry_run_cpu
    proc, sock = start_daemon(tmp, args.pool_size, {"KVPOOL_TRACE": str(trace_path)},
                              cuda="off" if cpu else "on")
    n = args.blocks
    link = None if cpu else LinkReference(n * BLOCK_BYTES)
    w = Worker(-1 if cpu else 0, args.layout, n)
    res: dict = {"investigation": "big_job_profile", "date": dt.datetime.now(
        dt.timezone.utc).isoformat(), "blocks": n, "layout": args.layout, "reps": args.reps}
    spies: list[subprocess.Popen] = []
    try:
        w.call("connect", sock, args.layout.encode().ljust(16, b"\0")[:16], 0, 1)
        w.call("fill", 1)
        bench = lambda *a: w.call("bench", *a, timeout_s=300)  # noqa: E731
        blocks = list(range(n))
        bench("store", blocks[:64])
        bench("load", blocks[:64])
        for _ in range(3):                      # the pool past full: stores evict from here on
            bench("store", blocks)
        bench("job_stamps_reset")
        if args.pyspy:
            spies = [pyspy_record(proc.pid, out / "pyspy-daemon.txt", args.rate),
                     pyspy_record(w.proc.pid, out / "pyspy-worker.txt", args.rate)]
            time.sleep(1.0)                     # py-spy attached (it samples from then on)
        ratios: dict[str, list[float]] = {"store": [], "load": []}
        for _ in range(args.reps):
            for kind in ("store", "load"):
                ref = link.seconds(kind) if link is not None else 1.0
                ratios[kind].append(ref / bench(kind, blocks))
        for s in spies:
            s.send_signal(signal.SIGINT)
        for s in spies:
            try:
                s.wait(60)
            except subprocess.TimeoutExpired:
                s.kill()
        res["paired_ratio_median"] = {k: round(statistics.median(v), 4)
                                      for k, v in ratios.items()}
        res["paired_ratio_each"] = {k: [round(x, 4) for x in v] for k, v in ratios.items()}
        # the worker's submit call in parts, each after 40 ms idle
        res["client_submit_parts_us"] = bench("submit_parts", blocks, 20, 0.04)
        stamps = bench("job_stamps")
        timed = {(stamps["owner"], j[0]) for j in stamps["jobs"]}   # not the warm-up's jobs
        trace = {k: t for k, t in read_trace(trace_path).items() if k in timed}
        res["big_jobs"] = big_jobs(trace, stamps["owner"], n, stamps)
        if args.pyspy:
            res["pyspy_daemon"] = summarize(out / "pyspy-daemon.txt")
            res["pyspy_worker"] = summarize(out / "pyspy-worker.txt")
    finally:
        w.close()
        if link is not None:
            link.close()
        stop_daemon(proc)
    path = out / f"big-job-profile-{dt.date.today().isoformat()}-{os.getpid()}.json"
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("pyspy")}, indent=1))


if __name__ == "__main__":
    main()
