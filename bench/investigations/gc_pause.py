"""The cyclic collector's longest pause while a fresh pool's slots are made, with and without
the daemon's heap (``daemon/heap.py``), side by side (CPU, issue 36).

    python -m bench.investigations.gc_pause [--slots 1000000] [--per-extent 32] [--torch]
        [--runs 3] [--out DIR]

Each run is a fresh process per variant, in turn: ``plain`` (the collector as CPython runs
it) and ``heap`` (the startup's heap frozen, then each extent's slots as they are made). A run
makes ``--slots`` slot objects an extent (``--per-extent``) at a time, as ``Extents`` does
while a pool fills, with ``--torch`` imported first as a CUDA daemon has, and records every
collection of the oldest generation (``gc.callbacks``) and the slowest extent. Prints per
variant the medians over runs, and heap / plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def full_collections() -> list[float]:
    """A list that gets the milliseconds of every collection of the oldest generation from
    now on (a ``gc.callbacks`` entry)."""
    import gc

    full: list[float] = []
    began = [0.0]

    def watch(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                full.append((time.perf_counter() - began[0]) * 1e3)

    gc.callbacks.append(watch)
    return full


def _one(variant: str, slots: int, per_extent: int, torch: bool) -> dict:
    import gc

    if torch:
        import torch as _  # noqa: F401  (its objects, as a CUDA daemon's heap holds them)
    from kvpool.daemon.extents import SizeClass
    from kvpool.daemon.heap import Heap
    from kvpool.daemon.slot_record import RECORDS

    full = full_collections()
    heap = Heap()
    if variant == "heap":
        heap.settle()
    cls = SizeClass(4096)
    rows = []
    slowest = 0.0
    for e in range(slots // per_extent):
        t0 = time.perf_counter()
        rows.append(RECORDS.make_slots(e * 4096, e, 0, 4096, cls, [0] * per_extent))
        heap.keep_new()
        slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
    return {"variant": variant, "full_collections": len(full),
            "longest_full_collection_ms": round(max(full, default=0.0), 1),
            "slowest_extent_ms": round(slowest, 1), "records": RECORDS.name,
            "tracked_at_end": len(gc.get_objects())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=1_000_000)
    ap.add_argument("--per-extent", type=int, default=32)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.slots, args.per_extent, args.torch)))
        return
    runs: dict[str, list[dict]] = {"plain": [], "heap": []}
    for _ in range(args.runs):
        for variant in runs:
            cmd = [sys.executable, "-m", "bench.investigations.gc_pause", "--one", variant,
                   "--slots", str(args.slots), "--per-extent", str(args.per_extent)]
            cmd += ["--torch"] if args.torch else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    median = {v: {k: statistics.median(r[k] for r in rs)
                  for k in ("full_collections", "longest_full_collection_ms", "slowest_extent_ms")}
              for v, rs in runs.items()}
    result = {"args": {k: v for k, v in vars(args).items() if k != "one"}, "cpus": os.cpu_count(),
              "runs": runs, "median": median,
              "heap_over_plain_slowest_extent": round(
                  median["heap"]["slowest_extent_ms"] / median["plain"]["slowest_extent_ms"], 4)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gc-pause.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
