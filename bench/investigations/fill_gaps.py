"""The event loop's longest gap in a real daemon while its fresh pool of many small slots fills
and then churns, under two trees in turn (CPU, issue 36: nothing may hold the loop 50 ms).

    python -m bench.investigations.fill_gaps OLD_TREE NEW_TREE [--pool 2GiB] [--churn 1.0]
        [--per-job 128] [--runs 1] [--events] [--out DIR]

Each run starts a daemon of one tree (its own import tree, as ``store_job_ab.py`` makes them)
on the host path with a pool of ``--pool``, and one worker (this checkout's client) stores
jobs of ``--per-job`` new blocks, four in flight, until the pool has taken ``1 + --churn``
times its slots (full at its first eviction). Its blocks are 4 KiB, but an extent has
records for 16 KiB slots (``MIN_PACKED_SLOT_BYTES``), so a pool of 8 GiB holds 522K slots.
Then a second engine's registration (with ``--events``, the feed announces every block of
the namespace to it) makes the daemon log its loop watch's summary
(``daemon/loop_watch.py``: the longest gap since start, run-queue waits taken out), which is
read back with every gap it warned of. The stalls this measures grow
with the pool's slot count: a dict of every block rebuilding itself, the collector walking
every slot; the benches' 12 GiB pools of 2 MiB slots are too small to meet them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.investigations.store_job_ab import import_tree
from bench.kvtest import DaemonProcess, HostKv, keyed_store

_LONGEST = re.compile(r"longest event-loop gap since start ([0-9.]+) ms")


def _start(daemon: DaemonProcess, folder: Path, env_path: str, again: bool = False) -> None:
    """Start (``again``: restart, adopting the pool) ``daemon`` from ``folder`` with
    ``env_path`` as its PYTHONPATH. (From its own folder: Python puts the working directory
    first on the path, and a checkout's root there would be the kvpool it imports.)"""
    old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = env_path
    os.chdir(folder)
    try:
        daemon.restart() if again else daemon.start()
    finally:
        os.chdir(cwd)
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def _after_restart(daemon: DaemonProcess, folder: Path, env_path: str) -> dict:
    """Kill ``daemon`` (its pool stays, as after a crash), start it again, adopting every
    block, and register an engine at once and another two seconds later: the longest gap of
    that life (the adoption's work on the loop once it serves: the index's publication of
    every block, the lower tiers' offer) and how long it took to serve."""
    daemon.kill()
    mark = daemon.log_path.stat().st_size
    began = time.monotonic()
    _start(daemon, folder, env_path, again=True)
    serving_s = time.monotonic() - began
    from kvpool.client.scheduler import SchedulerClient
    cfg = daemon.client_config(timeout_ms=30000)
    held = []
    for engine in ("after-restart", "after-restart-2s"):
        kv = HostKv(layers=2, blocks=8)
        worker, _ = kv.register(cfg, name=engine, engine_id=engine)
        held.append((worker, kv))
        if engine == "after-restart":
            time.sleep(2.0)
    sched = SchedulerClient(cfg)
    adopted = sched.info().slots_committed
    sched.close()
    for worker, kv in held:
        worker.close()
        kv.close()
    with open(daemon.log_path, "rb") as f:
        f.seek(mark)
        log = f.read().decode(errors="replace")
    return {"restart_serving_s": round(serving_s, 2), "restart_adopted": adopted,
            "restart_longest_gap_ms": max(map(float, _LONGEST.findall(log)), default=-1.0),
            "restart_gap_warnings": [line for line in log.splitlines()
                                     if "event loop did not run" in line][:20]}


def _one(tree: Path, name: str, work: Path, pool: str, churn: float, per_job: int,
         events: bool = False, restart: bool = False, disk: str = "") -> dict:
    d = work / f"{name}-{secrets.token_hex(3)}"
    d.mkdir()
    env_path = str(import_tree(tree, d / "pp"))
    extra = ["--extent-size", "8MiB"]
    if events:              # the second registration is then told every committed block
        extra += ["--events-endpoint", f"ipc://{d}/events.sock"]
    if disk:                # a disk tier under the pool, in the run's folder
        extra += ["--disk-path", str(d / "disk"), "--disk-size", disk]
    daemon = DaemonProcess(d, pool, extra)
    _start(daemon, d, env_path)
    after: dict = {}
    kv = HostKv(layers=2, blocks=4 * per_job)           # 4 KiB blocks, four jobs' worth
    try:
        from kvpool.client.scheduler import SchedulerClient
        cfg = daemon.client_config(timeout_ms=30000)
        worker, reg = kv.register(cfg)
        sched = SchedulerClient(cfg)
        stored, jobs, began = 0, [], time.monotonic()
        target = held = 0           # until the pool is full: its first eviction says so
        while not target or stored < target:
            n = len(jobs) % 4
            keys = [secrets.token_bytes(16) for _ in range(per_job)]
            jobs.append(keyed_store(sched, worker, reg, kv.namespace,
                                    list(range(n * per_job, (n + 1) * per_job)), keys))
            stored += per_job
            if len(jobs) >= 4:
                done = worker.wait(jobs, 60)
                assert all(c.ok for c in done), done
                jobs = []
                if not target:
                    now = sched.info()
                    if now.evictions:
                        held = now.slots_committed
                        target = stored + int(held * churn)
        if jobs:
            worker.wait(jobs, 60)
        seconds = time.monotonic() - began
        other = HostKv(layers=2, blocks=8)
        # (an engine of its own: the daemon's KV event feed, where on, announces every block
        # of the namespace to it, on the loop; a registration of the first engine's id would
        # announce nothing, as the runs before 2026-12-08 did) It logs the loop watch's
        # summary, with that announcement's turn counted.
        again, _ = other.register(cfg, name="again", engine_id="fill-gaps-again")
        info = sched.info()
        again.close()
        other.close()
        worker.close()
        sched.close()
        if restart:
            log_before = daemon.log_path.read_text(errors="replace")
            after = _after_restart(daemon, d, env_path)
    finally:
        daemon.stop()
        daemon.cleanup()
        kv.close()
    log = log_before if restart else daemon.log_path.read_text(errors="replace")
    longest = [float(m) for m in _LONGEST.findall(log)]
    warned = [line for line in log.splitlines() if "event loop did not run" in line]
    return {"tree": name, "pool_slots": held, "slots_held_at_end": info.slots_committed,
            "stored_blocks": stored,
            "seconds": round(seconds, 1),
            "evictions": info.evictions, "longest_gap_ms": max(longest, default=-1.0),
            "gap_warnings": warned[:20], **after}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--pool", default="2GiB")
    ap.add_argument("--churn", type=float, default=1.0)
    ap.add_argument("--per-job", type=int, default=128)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--events", action="store_true", help="a KV event feed on")
    ap.add_argument("--disk", default="", metavar="SIZE",
                    help="a disk tier of SIZE under the pool (in the run's folder)")
    ap.add_argument("--restart", action="store_true",
                    help="then kill the daemon, start it again on its pool and read that life's "
                         "longest gap too")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fill-gaps-"))
    try:
        runs = []
        for _ in range(args.runs):
            for name, tree in (("old", args.old), ("new", args.new)):
                r = _one(tree, name, work, args.pool, args.churn, args.per_job, args.events,
                         args.restart, args.disk)
                print(json.dumps(r), file=sys.stderr, flush=True)
                runs.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(),
              "runs": runs}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fill-gaps.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
