"""The cyclic collector's longest pause while a disk tier's catalog fills and churns, under two
trees in turn (CPU, issue 36: nothing may hold the loop 50 ms).

    python -m bench.investigations.disk_gc OLD_TREE NEW_TREE [--blocks 1000000] [--churn 1.0]
        [--per-job 128] [--torch] [--runs 3] [--out DIR]

Each run is a fresh process of one tree (its own import tree, as ``store_job_ab.py`` makes
them), in turn. It makes a ``DiskCatalog`` (``daemon/disk_catalog.py``) of ``--blocks`` blocks
of 4 KiB and writes jobs of ``--per-job`` new keys through it as the disk tier does (claim,
then each block landed), until it has taken ``1 + --churn`` times its blocks: every claim past
full evicts. The daemon's heap is settled first, as a serving daemon's is
(``daemon/heap.py``), with ``--torch`` imported before, as a CUDA daemon has it. Records every
collection of the oldest generation (``gc.callbacks``) and the slowest job. A block record
the collector tracks survives into the oldest generation and is walked by each full
collection; their churn is what starts them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.investigations.gc_pause import full_collections
from bench.investigations.store_job_ab import import_tree

_KEYS = ("full_collections", "longest_full_collection_ms", "slowest_job_ms")


def _one(blocks: int, churn: float, per_job: int, torch: bool) -> dict:
    import gc
    import secrets

    if torch:
        import torch  # noqa: F401  (its objects, as a CUDA daemon's heap holds them)
    from kvpool.daemon.disk_catalog import DiskCatalog
    from kvpool.daemon.heap import Heap

    catalog = DiskCatalog(blocks * 4096)
    size = catalog.size(4096)
    Heap().settle()
    full = full_collections()
    slowest, written = 0.0, 0
    ns = secrets.token_bytes(16)
    while written < blocks * (1 + churn):
        keys = [ns + secrets.token_bytes(16) for _ in range(per_job)]
        t0 = time.perf_counter()
        claimed, _replaced = catalog.claim(keys, size)
        for b in claimed:
            catalog.landed(b, 0)
        slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
        written += len(claimed)
    return {"full_collections": len(full),
            "longest_full_collection_ms": round(max(full, default=0.0), 1),
            "slowest_job_ms": round(slowest, 1), "blocks_held": catalog.blocks,
            "evicted": catalog.evicted_blocks, "tracked_at_end": len(gc.get_objects())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="*", type=Path, metavar="TREE", help="old, then new")
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--churn", type=float, default=1.0)
    ap.add_argument("--per-job", type=int, default=128)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.blocks, args.churn, args.per_job, args.torch)))
        return
    if len(args.trees) != 2:
        ap.error("give two trees: old, then new")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="kvpool-disk-gc-") as tmp:
        paths = {name: str(import_tree(tree, Path(tmp) / name))
                 for name, tree in zip(runs, args.trees)}
        for _ in range(args.runs):
            for name in runs:
                cmd = [sys.executable, "-m", "bench.investigations.disk_gc", "--one",
                       "--blocks", str(args.blocks), "--churn", str(args.churn),
                       "--per-job", str(args.per_job)] + (["--torch"] if args.torch else [])
                # (the tree's kvpool first; this checkout's bench scripts after it)
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([paths[name], os.getcwd()]))
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env,
                                     cwd=tmp).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
                print(name, json.dumps(runs[name][-1]), flush=True)
    median = {v: {k: statistics.median(r[k] for r in rs) for k in _KEYS}
              for v, rs in runs.items()}
    result = {"args": {k: str(v) for k, v in vars(args).items() if k != "one"},
              "cpus": os.cpu_count(), "runs": runs, "median": median}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "disk-gc.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
