"""What a store job's slot-record writes cost the event loop, compiled against numpy (CPU).

    python -m bench.investigations.record_writes [--slots 128] [--jobs 400] [--flush-mib 64]

A store on a full pool writes records three times on the loop: its victims FREE, its claims
WRITING with their generations, its commits' keys and generations. This times those three
writes of ``--slots`` scattered slots of a real pool, per job, with ``daemon/_pool_records.c``
and with the numpy path it falls back to, the two alternating job by job in one process (so a
noisy host moves both alike), after ``--flush-mib`` of memory is written before each job (a
copy's DMA leaves the loop's caches cold; 0: warm). Medians and 90th percentiles, in us.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import time

import numpy as np

import kvpool.daemon.pool as pool_module
from kvpool.shared.config import DaemonConfig


def run(slots: int, jobs: int, flush_mib: int) -> dict[str, list[int]]:
    """Nanoseconds per job, by ``compiled`` and ``numpy``, in job order."""
    compiled = pool_module._pool_records
    if compiled is None:
        raise SystemExit("daemon/_pool_records.c is not built: pip install -e . builds it")
    cfg = DaemonConfig(pool_name=f"kvpool-record-writes-{os.getpid()}", pool_size="2GiB",
                       extent_size="64MiB")
    pool = pool_module.Pool.open(cfg)
    times: dict[str, list[int]] = {"compiled": [], "numpy": []}
    try:
        for e in range(pool.geometry.num_extents):
            pool.assign_extent(e, 2 << 20)
        every = [e * pool.slot_id_stride + i for e in range(pool.geometry.num_extents)
                 for i in range(32)]
        rng = random.Random(36)
        flush = np.zeros(flush_mib << 20, np.uint8) if flush_mib else None
        for job in range(jobs):
            for mode in ("compiled", "numpy")[::1 if job % 2 else -1]:
                pool_module._pool_records = compiled if mode == "compiled" else None
                claims = rng.sample(every, slots)
                victims = rng.sample(every, slots)
                gens = [rng.randrange(1 << 31) for _ in claims]
                keys = [secrets.token_bytes(32) for _ in claims]
                if flush is not None:
                    flush.fill(job & 0xFF)
                t0 = time.perf_counter_ns()
                pool.write_states(victims, pool_module.FREE)
                pool.write_states(claims, pool_module.WRITING, gens)
                pool.commit_records(claims, keys, gens)
                times[mode].append(time.perf_counter_ns() - t0)
    finally:
        pool_module._pool_records = compiled
        pool.close(unlink=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--flush-mib", type=int, default=64)
    args = ap.parse_args()
    for mode, ns in run(args.slots, args.jobs, args.flush_mib).items():
        ns = sorted(ns[len(ns) // 10:])
        print(f"{mode:8s}: median {statistics.median(ns) / 1e3:6.1f} us, p90 "
              f"{ns[int(len(ns) * 0.9)] / 1e3:6.1f} us per job of {args.slots} slots "
              f"(three record writes)")


if __name__ == "__main__":
    main()
