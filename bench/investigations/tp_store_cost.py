"""What the event loop spends per store job of a TP=1 engine and of a TP=2 one (CPU, issue 36).

    python -m bench.investigations.tp_store_cost [--slots 64] [--jobs 400] [--flush-mib 0]

A TP=2 hand-off sends twice the store jobs per GiB of a TP=1 one: each rank stores its half
of every slot. The first rank's store binds the tickets (room, evictions, claims), the other
rank's only checks what it bound; each rank's end commits its half. This times those steps in
a real ``Index`` on a full pool (every job evicts as many slots as it claims), per job, in
microseconds (medians over ``--jobs``, the first tenth not counted; ``--flush-mib`` writes
that much memory before each step, 0: warm caches).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time

import numpy as np

from kvpool.daemon.index import Index
from kvpool.daemon.pool import Pool
from kvpool.shared.config import DaemonConfig
from kvpool.shared.layout import Layout

NS = b"t" * 16
OWNER = 7


def run(tp: int, slots: int, jobs: int, flush_mib: int) -> dict[str, float]:
    # room for about eight jobs: every later job evicts
    cfg = DaemonConfig(pool_name=f"kvpool-tp-cost-{os.getpid()}-{secrets.token_hex(3)}",
                       pool_size=f"{-(-8 * slots // 64) + 4}MiB", extent_size="1MiB")
    pool = Pool.open(cfg)
    flush = np.zeros(flush_mib << 20, np.uint8) if flush_mib else None
    times: dict[str, list[int]] = {"bind": [], "check": [], "end": []}

    def timed(name: str, fn, *a, **kw):
        if flush is not None:
            flush.fill(len(times[name]) & 0xFF)
        t0 = time.perf_counter_ns()
        out = fn(*a, **kw)
        times[name].append(time.perf_counter_ns() - t0)
        return out

    def bind(tickets, keys):
        opened = ix.open_store(NS, tickets, keys, 0, now=0.0)
        if opened.finish is not None:
            opened.finish()
        return opened

    def end(opened):
        for rank, o in enumerate(opened):
            ix.end_store(o.slots, rank, True)

    try:
        ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
        # 4 KiB slots either way: a TP=2 rank stores a 2 KiB shard of each
        ix.register_namespace(NS, Layout(16, tp, "f16", (4096 // tp,), "tp-cost"))
        for j in range(jobs):
            keys = [b"%08d%08d" % (j, i) for i in range(slots)]
            tickets = ix.reserve(NS, slots, OWNER, 0.0)
            opened = [timed("bind", bind, tickets, keys)]
            if tp == 2:
                opened.append(timed("check", ix.open_store, NS, tickets, keys, 1, now=0.0))
            timed("end", end, opened)
    finally:
        pool.close(unlink=True)
    return {k: round(statistics.median(v[len(v) // 10:]) / 1e3, 1)
            for k, v in times.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=64, help="slots per store job")
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--flush-mib", type=int, default=0)
    args = ap.parse_args()
    for tp in (1, 2):
        r = run(tp, args.slots, args.jobs, args.flush_mib)
        print(f"TP={tp}: {r} us per {args.slots}-slot job; {sum(r.values()):.1f} us a job")


if __name__ == "__main__":
    main()
