"""How long one store job's key-table work can hold the event loop: one dict against the key
table (``daemon/key_table.py``), side by side in one run (CPU, issue 36).

    python -m bench.investigations.table_stall [--blocks 1000000] [--churn 2] [--batch 128]
        [--out DIR]

A job's table work is a batch of ``--batch`` evictions out and as many commits in. The run
fills each table to ``--blocks`` (a fresh daemon's first fill), then churns it ``--churn``
times over (a full pool's steady stores). Both tables take the same batches, in turn. A dict
rebuilds itself whole as it grows and as it sheds its deletions' holes, so its slowest batch
is one rebuild of every block; the key table rebuilds a 256th at a time. Prints per table and
phase the median, p99.9 and slowest batch, and the slowest's ratio (key table / dict). Then
the pool's slots by id as a fresh pool's extents are assigned (``by_id_fill``): one dict of
every slot, which rebuilds itself as it grows, against ``Extents.slots``'s row per extent.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import deque

from kvpool.daemon.key_table import KeyTable


class _Dict:
    """The one dict the slot table used to keep, with the batch calls it made."""

    def __init__(self) -> None:
        self.d: dict[bytes, int] = {}

    def put_many(self, keys, values):
        self.d.update(zip(keys, values))

    def delete_many(self, keys):
        deque(map(self.d.__delitem__, keys), 0)


def _stats(us: list[float]) -> dict:
    s = sorted(us)
    return {"batches": len(s), "median_us": round(statistics.median(s), 1),
            "p999_us": round(s[int(len(s) * 0.999)], 1), "max_us": round(s[-1], 1)}


def _by_id_fill(blocks: int, rng: random.Random, per_extent: int = 32, stride: int = 4096
                ) -> dict:
    """The slots by id as a fresh pool's extents are assigned one by one (``per_extent``
    slots each), in a random order: a dict of every slot against ``Extents.slots``'s rows
    (an extent's slots one list item). Each assignment timed; the slowest of each."""
    extents = rng.sample(range(blocks // per_extent), blocks // per_extent)
    rows: list = [None] * len(extents)
    by_id: dict[int, object] = {}
    slowest = {"dict": 0.0, "rows": 0.0}
    for e in extents:
        slots = [object() for _ in range(per_extent)]
        ids = range(e * stride, e * stride + per_extent)
        t0 = time.perf_counter()
        by_id.update(zip(ids, slots))
        t1 = time.perf_counter()
        rows[e] = slots
        t2 = time.perf_counter()
        slowest["dict"] = max(slowest["dict"], (t1 - t0) * 1e6)
        slowest["rows"] = max(slowest["rows"], (t2 - t1) * 1e6)
    return {"slots": blocks, "slowest_assignment_us": {k: round(v, 1) for k, v in slowest.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--churn", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = random.Random(0)
    tables = {"dict": _Dict(), "key_table": KeyTable()}
    held = {name: deque() for name in tables}
    times: dict[str, dict[str, list[float]]] = {n: {"fill": [], "churn": []} for n in tables}
    total = int(args.blocks * (1 + args.churn))
    made = 0
    while made < total:
        keys = [rng.randbytes(16) for _ in range(args.batch)]
        phase = "fill" if made < args.blocks else "churn"
        order = list(tables)
        rng.shuffle(order)
        for name in order:
            t, q = tables[name], held[name]
            out = [q.popleft() for _ in range(args.batch)] if phase == "churn" else []
            t0 = time.perf_counter()
            if out:
                t.delete_many(out)
            t.put_many(keys, range(made, made + args.batch))
            times[name][phase].append((time.perf_counter() - t0) * 1e6)
            q.extend(keys)
        made += args.batch
    by_id = _by_id_fill(args.blocks, rng)
    result = {"args": vars(args), "cpus": os.cpu_count(), "by_id_fill": by_id,
              "tables": {n: {p: _stats(v) for p, v in ph.items() if v} for n, ph in times.items()}}
    tables = result["tables"]
    result["slowest_ratio"] = {
        p: round(tables["key_table"][p]["max_us"] / tables["dict"][p]["max_us"], 4)
        for p in ("fill", "churn") if p in tables["dict"]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table-stall.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
