"""What a store's per-slot passes cost as slot objects against numpy columns (CPU, issue 36).

    python -m bench.investigations.slot_columns [--slots 128] [--jobs 600] [--flush-mib 64]
        [--out DIR]

On a GPU host the event loop's Python during stores is mostly the slot table's passes over
the slots of each job (py-spy, 2026-11-29: a store's room and evictions 20% of the loop's GIL
samples, its claims 15%, its end 17%), over slot objects that the copies' DMA keeps out of
the caches. This times those passes as they are, in a real ``Index`` on a full pool (each job
evicts as many slots as it claims), and the same fields written as numpy columns indexed by
slot id, which is what a slot table in arrays would do instead:

- ``objects_claim`` / ``columns_claim``: a claim's per-slot fields (generation and ref, state,
  owner, deadline, units in flight, pin, ticket);
- ``objects_evict`` / ``columns_evict``: an eviction's (state, landed units; the queues'
  and the key table's removals are in the objects' figure only);
- ``objects_commit`` / ``columns_commit``: a commit's (state, ticket, last use; the queues
  and the records in the objects' figure only).

The objects' figures hold the dict and record batches that would stay as they are; the
columns' are the field writes alone. So the difference bounds what arrays could save, it
does not promise it. Each figure is the median over ``--jobs`` jobs (the first tenth not
counted), in microseconds; ``--flush-mib`` writes that much memory before each pass (0: warm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import statistics
import time
from pathlib import Path

import numpy as np

from kvpool.daemon.index import Index
from kvpool.daemon.pool import GENERATION_MASK, Pool
from kvpool.shared.config import DaemonConfig
from kvpool.shared.layout import Layout

NS = b"c" * 16
LAYOUT = Layout(16, 1, "f16", (4096,), "columns")     # 4 KiB slots, 64 per 1 MiB extent
OWNER = 7


class _Columns:
    """The per-slot fields a claim, a commit and an eviction write, as arrays by slot id."""

    def __init__(self, n: int) -> None:
        self.generation = np.zeros(n, np.uint32)
        self.state = np.zeros(n, np.uint8)
        self.owner = np.zeros(n, np.int32)
        self.deadline = np.zeros(n, np.float64)
        self.writing = np.zeros(n, np.uint16)
        self.landed = np.zeros(n, np.uint16)
        self.pins = np.zeros(n, np.int32)
        self.ticket = np.zeros(n, np.int64)
        self.last_use = np.zeros(n, np.int64)

    def claim(self, ids: np.ndarray, tickets: np.ndarray, deadline: float) -> np.ndarray:
        gen = self.generation[ids] = (self.generation[ids] + 1) & GENERATION_MASK
        self.state[ids] = 1
        self.owner[ids] = OWNER
        self.deadline[ids] = deadline
        self.writing[ids] = 1
        self.pins[ids] = 1
        self.ticket[ids] = tickets
        return (gen.astype(np.int64) << 32) | ids       # the refs

    def evict(self, ids: np.ndarray) -> None:
        self.state[ids] = 0
        self.landed[ids] = 0

    def commit(self, ids: np.ndarray, tick: int) -> None:
        self.state[ids] = 2
        self.ticket[ids] = 0
        self.last_use[ids] = tick


def run(slots: int, jobs: int, flush_mib: int = 0) -> dict[str, float]:
    # room for about eight jobs (and the pool's own header): every later job evicts
    cfg = DaemonConfig(pool_name=f"kvpool-bench-cols-{os.getpid()}-{secrets.token_hex(3)}",
                       pool_size=f"{-(-8 * slots // 64) + 4}MiB", extent_size="1MiB")
    pool = Pool.open(cfg)
    times: dict[str, list[int]] = {}
    flush = np.zeros(flush_mib << 20, np.uint8) if flush_mib else None

    def cool() -> None:
        if flush is not None:
            flush.fill(len(times.get("objects_claim", ())) & 0xFF)

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            cool()
            t0 = time.perf_counter_ns()
            out = fn(*a, **kw)
            times.setdefault(name, []).append(time.perf_counter_ns() - t0)
            return out
        return wrapper

    try:
        ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
        ix.register_namespace(NS, LAYOUT)
        table = ix.table
        # the store path calls these on the table object: timed where they are
        table.claim = timed("objects_claim", table.claim)
        table.evict_many = timed("objects_evict", table.evict_many)
        table.commit = timed("objects_commit", table.commit)
        cols = _Columns(pool.geometry.num_extents * pool.slot_id_stride)
        col_claim = timed("columns_claim", cols.claim)
        col_evict = timed("columns_evict", cols.evict)
        col_commit = timed("columns_commit", cols.commit)
        for j in range(jobs):
            keys = [b"%08d%08d" % (j, i) for i in range(slots)]
            tickets = ix.reserve(NS, slots, OWNER, 0.0)
            opened = ix.begin_store(NS, tickets, keys, 0, now=0.0)
            ix.end_store(opened, 0, ok=True)
            ids = np.fromiter((s.id for s in opened), np.int64, len(opened))
            col_evict(ids)
            col_claim(ids, np.asarray(tickets, np.int64), 60.0)
            col_commit(ids, j)
    finally:
        pool.close(unlink=True)
    skip = lambda v: v[len(v) // 10:]  # noqa: E731
    return {k: round(statistics.median(skip(v)) / 1e3, 1) for k, v in sorted(times.items())
            if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=128, help="slots per store job")
    ap.add_argument("--jobs", type=int, default=600)
    ap.add_argument("--flush-mib", type=int, default=64,
                    help="memory written before each pass (0: warm)")
    ap.add_argument("--out", default="", help="directory for the JSON (default: none)")
    args = ap.parse_args()
    res = {"warm": run(args.slots, args.jobs)}
    if args.flush_mib:
        res[f"after_{args.flush_mib}MiB_written"] = run(args.slots, args.jobs, args.flush_mib)
    print(f"per-slot passes of a {args.slots}-slot store job, median us "
          f"({platform.machine()}, {os.cpu_count()} cores)")
    for scene, figures in res.items():
        print(f"  {scene}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        date = datetime.date.today().isoformat()
        (out / f"slot-columns-{date}.json").write_text(json.dumps(
            {"investigation": "slot_columns", "date": date, "slots": args.slots,
             "jobs": args.jobs, "machine": platform.machine(), "cores": os.cpu_count(), **res},
            indent=1))


if __name__ == "__main__":
    main()
