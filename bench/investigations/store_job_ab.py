"""One store (or load) job's event-loop work under two trees, job by job in turn (CPU, issue
36).

    python -m bench.investigations.store_job_ab OLD_TREE NEW_TREE [--slots 128] [--jobs 300]
        [--pool-slots 65536] [--flush-mib 64] [--new-env VAR=VALUE ...] [--kind store|load]
        [--out DIR]

A change to the loop's per-block Python saves a few per cent of a job, and runs of one tree
after the other on this VM move 10% (``tp_store_cost.py`` alone, three pairs). So each tree
runs in a worker process of its own, both alive at once, and the parent asks them for one job
at a time, in a shuffled order: they see the same machine minute by minute. A job is what the
loop does for an engine's store on a full pool: ``open_store`` (room: its evictions, the
shared-memory index's withdrawals, the claims and their records) and ``end_store`` (the
commits, their records and index entries), on a real ``Index`` with the daemon's index
segment watching it, 4 KiB slots, ``--flush-mib`` of memory written before each step (a copy's
DMA leaves the slots cold). A tree is a checkout with its C extensions built in place
(``python setup.py build_ext --inplace``); the worker says which record and index writers it
got. Prints medians per tree (the first tenth of the jobs not counted) and new / old.
``--new-env`` sets variables in the new tree's worker alone: one tree twice weighs a setting.

``--kind load``: a job is what the loop does for a connector's load of ``--slots`` blocks
stored earlier (one of the last ten batches, on the same full pool): ``touch`` (the hits its
scheduler read in the shared-memory index, made recent), ``start`` (``resolve_load``, the
offsets for the engine, the pins) and ``end`` (``end_load``: the unpins), the memory written
before ``touch`` and before ``end``. ``--kind lease``: what the loop does for the loads of
``bench/host_scale.py``'s engines instead of the touch: a ``lookup`` with pins (a lease) of
such a batch, and its ``release``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NS = b"j" * 16
OWNER = 7
STEPS = {"store": ("open", "end"), "load": ("touch", "start", "end"),
         "lease": ("lookup", "release")}


def worker(slots: int, pool_slots: int, flush_mib: int, kind: str = "store") -> None:
    """Serve jobs on stdin ("job" lines), one line of step times (ns) each on stdout."""
    import numpy as np

    from kvpool.daemon import index_segment, loads as loads_mod, pool as pool_mod
    from kvpool.daemon.index import Index
    from kvpool.daemon.index_segment import IndexSegment, KeyLocations
    from kvpool.daemon.pool import Pool
    from kvpool.shared.config import DaemonConfig
    from kvpool.shared.layout import Layout

    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    cfg = DaemonConfig(pool_name=f"kvpool-job-ab-{tag}", extent_size="16MiB",
                       pool_size=f"{-(-pool_slots * 4 // 1024) + 32}MiB")
    pool = Pool.open(cfg)
    capacity = 1 << (2 * pool_slots - 1).bit_length()
    segment = IndexSegment(f"/kvpool-job-ab-ix-{tag}", capacity, tag)
    flush = np.zeros(flush_mib << 20, np.uint8) if flush_mib else None
    try:
        ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
        ix.register_namespace(NS, Layout(16, 1, "f16", (128,), "job-ab"))
        ix.table.watch(KeyLocations(segment, ix.namespaces, []))

        stored: list[list[bytes]] = []
        # (a tree from before the offsets' pass gave its loads numpy's fromiter)
        offsets = getattr(ix.table, "offsets", None) or getattr(loads_mod, "_offsets")

        def load(timed: bool) -> list[int]:
            keys = stored[-1 - random.randrange(10)]
            refs = ix.lookup(NS, [keys], False, OWNER, 0.0)[2][0]
            out = []
            found: list = []
            for step in STEPS["load"]:
                if timed and flush is not None and step != "start":
                    flush.fill(len(out))
                t0 = time.perf_counter_ns()
                if step == "touch":
                    ix.touch(NS, keys)
                elif step == "start":
                    found = ix.resolve_load(NS, refs, keys)
                    offsets(found)
                    ix.pin(found)
                else:
                    ix.end_load(found, True)
                out.append(time.perf_counter_ns() - t0)
            return out

        def lease(timed: bool) -> list[int]:
            keys = stored[-1 - random.randrange(10)]
            out = []
            leases: list[int] = []
            for step in STEPS["lease"]:
                if timed and flush is not None:
                    flush.fill(len(out))
                t0 = time.perf_counter_ns()
                if step == "lookup":
                    leases = ix.lookup(NS, [keys], True, OWNER, 0.0)[1]
                else:
                    ix.release_leases(leases, OWNER)
                out.append(time.perf_counter_ns() - t0)
            return out

        def job(timed: bool) -> list[int]:
            keys = [secrets.token_bytes(16) for _ in range(slots)]
            stored.append(keys)
            del stored[:-10]
            tickets = ix.reserve(NS, slots, OWNER, 0.0)
            out = []
            for step in STEPS["store"]:
                if timed and flush is not None:
                    flush.fill(len(out))
                t0 = time.perf_counter_ns()
                if step == "open":
                    opened = ix.open_store(NS, tickets, keys, 0, now=0.0)
                    if opened.finish is not None:
                        opened.finish()
                else:
                    ix.end_store(opened.slots, 0, True)
                out.append(time.perf_counter_ns() - t0)
            return out

        while not ix.table.stats.evictions:                # full before the first timed job
            job(False)
        for _ in range(10):
            job(False)
        job = {"load": load, "lease": lease}.get(kind, job)   # noqa: F811
        writers = {"records": "compiled" if getattr(pool_mod, "_pool_records", None) is not None
                   else "numpy",
                   "index": "compiled" if getattr(index_segment, "_index_writer", None)
                   is not None else "python",
                   "evictions": ix.table.stats.evictions,
                   "allocator": os.environ.get("PYTHONMALLOC", "pymalloc")}
        print(json.dumps(writers), flush=True)
        for line in sys.stdin:
            if line.strip() != "job":
                break
            print(" ".join(map(str, job(True))), flush=True)
    finally:
        segment.close()
        pool.close(unlink=True)


def import_tree(tree: Path, into: Path) -> Path:
    """A folder where ``import kvpool`` finds ``tree`` (the package-dir mapping of
    pyproject.toml, as tests/gpu/run.sh builds it)."""
    pkg = into / "kvpool"
    pkg.mkdir(parents=True)
    shutil.copy(tree / "kvpool" / "__init__.py", pkg)
    for d in ("shared", "daemon", "client"):
        (pkg / d).symlink_to(tree.resolve() / d)
    return into


def answer(name: str, proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the {name} tree's worker ended (exit {proc.wait(timeout=60)}): "
                         "its error is above")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs=2, type=Path, metavar="TREE", help="old, then new")
    ap.add_argument("--slots", type=int, default=128, help="slots per store job")
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--pool-slots", type=int, default=65536)
    ap.add_argument("--flush-mib", type=int, default=64)
    ap.add_argument("--new-env", nargs="*", default=[], metavar="VAR=VALUE",
                    help="set in the new tree's worker only (e.g. an allocator setting: give "
                         "the same tree twice to weigh it)")
    ap.add_argument("--kind", choices=sorted(STEPS), default="store")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    steps = STEPS[args.kind]
    names = ("old", "new")
    work = Path(tempfile.mkdtemp(prefix="kvpool-job-ab-"))
    procs = {}
    try:
        for name, tree in zip(names, args.trees):
            env = dict(os.environ, PYTHONPATH=str(import_tree(tree, work / name)))
            if name == "new":
                env.update(v.split("=", 1) for v in args.new_env)
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(args.slots), str(args.pool_slots),
                 str(args.flush_mib), args.kind], env=env, cwd=work, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        setup = {n: json.loads(answer(n, p)) for n, p in procs.items()}
        times: dict[str, list[list[int]]] = {n: [] for n in names}
        order = list(names)
        for _ in range(args.jobs):
            random.shuffle(order)
            for n in order:
                procs[n].stdin.write("job\n")
                procs[n].stdin.flush()
                times[n].append([int(x) for x in answer(n, procs[n]).split()])
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    skip = args.jobs // 10
    med = {n: {step: statistics.median(t[i] for t in times[n][skip:]) / 1e3
               for i, step in enumerate(steps)} for n in names}
    for n in names:
        med[n]["job"] = sum(med[n][s] for s in steps)
    result = {"trees": {n: str(t) for n, t in zip(names, args.trees)}, "setup": setup,
              "new_env": args.new_env,
              "args": {k: v for k, v in vars(args).items()
                       if k not in ("trees", "out", "new_env")},
              "median_us": {n: {k: round(v, 1) for k, v in m.items()} for n, m in med.items()},
              "new_over_old": {k: round(med["new"][k] / med["old"][k], 3) for k in med["new"]}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.kind}-job-ab-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
            json.dumps(result, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*map(int, sys.argv[2:5]), *sys.argv[5:6])
    else:
        main()
