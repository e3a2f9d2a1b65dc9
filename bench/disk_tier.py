"""Disk tier benchmark (issue 12): demote/promote GB/s against the raw O_DIRECT rate of the same
directory, restart-to-ready with 100k blocks on disk, and torn blocks served after kill -9s.

All in one run, against real kvpoold processes (host copy path, no GPU needed):

1. **Raw rate.** The same directory, O_DIRECT, one thread: sequential 8 MiB writes then reads
   of ``--bytes`` from page-aligned memory, fdatasync included (the ceiling of the device).
   A shared virtio disk here varies 2x from one minute to the next, so steps 1-3 are repeated
   ``--reps`` times, each tier figure is divided by the raw rate measured just before it, and
   the medians are reported (every repetition is in the JSON).
2. **Demote.** An engine stores ``--bytes`` of 2 MiB blocks (Llama-8B-sized) into a running
   daemon with the tier, which writes every committed block down behind the store. The clock
   runs from submitting the stores until the tier's ``demoted_bytes``, polled every 2 ms,
   reaches the total (engine -> pool -> disk, the pool copy being the small part). One block
   is stored and demoted first, so the daemon's start (it imports torch on a thread once it
   serves) is behind us: this is the rate of a daemon at work.
3. **Promote.** That daemon is SIGKILLed and its pool dropped (a reboot); a new one adopts the
   disk; the engine looks every block up and loads it. ``promote_gbps``: from the lookup until
   the tier's ``promoted_bytes`` reaches the total (disk -> pool, verified);
   ``promote_to_engine_gbps``: until the last load job has the bytes in the engine's memory
   (disk -> pool -> engine, checked byte for byte; the host copy into the engine is the
   slow part on a 2-core machine).
4. **Ready.** 100k blocks of 4 KiB are written in the tier's own format (``DiskStore.write``);
   the clock runs from spawning kvpoold to its first answered ping (``ready``), and on to the
   tier listing every block (``indexed``: the same instant while the index is loaded before
   serving), beside the same with an empty directory. A lookup then checks that the blocks
   are served.
5. **Torn.** ``--kill-rounds`` times: store 64 blocks of 1 MiB, SIGKILL kvpoold at a random
   moment of their demotion, drop the pool, restart; every block any later daemon serves is
   compared byte for byte with what was stored. ``torn_blocks_served`` counts differences.
   The first round times a whole demotion (``demote_64_s``) and the others draw their kill
   moment from 0 to 1.5x that, so on any disk some kills land mid-demotion and some after a
   commit (a fixed window missed every commit on a slow disk).

Writes ``<out>/disk-<date><suffix>.json``. Run: ``nice -n 10 .venv/bin/python -m bench.disk_tier
--dir /path/on/the/nvme --out bench/results`` (about 2 minutes; needs ~3x ``--bytes`` of disk
and memory, and ~0.5 GB more disk for the 100k blocks).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import posix_ipc
import torch

ROOT = Path(__file__).resolve().parent.parent

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.daemon.disk_store import DiskStore  # noqa: E402
from bench.kvtest import DaemonProcess, HostKv, keyed_store  # noqa: E402
from bench.soak.common import wait_for  # noqa: E402
import bench.kvtest  # noqa: E402
from kvpool.client.host_memory import SharedHostMemory  # noqa: E402
from kvpool.shared.protocol import ENGINE_SHM_PREFIX  # noqa: E402

# The engine's KV memory under a name of its own (seen reaped on a shared host before the
# liveness lock), still with the engine prefix: the daemon opens no other name.
bench.kvtest.SharedHostMemory = lambda nbytes: SharedHostMemory(
    nbytes, f"{ENGINE_SHM_PREFIX}bench-{os.getpid()}-{os.urandom(4).hex()}")

GB = 1e9
CHUNK = 8 << 20
# 2 MiB blocks, the Llama-3.1-8B figure in DESIGN.md, as one K and one V segment each (so the
# host copy to the engine, which this 2-core host does slowly, stays out of the way).
BIG = dict(layers=1, block_tokens=16, heads=256, head_dim=128)
BIG_BYTES = 1 * 2 * 16 * 256 * 128 * 2


def raw_rates(directory: Path, nbytes: int) -> tuple[float, float]:
    """O_DIRECT sequential write and read GB/s of ``nbytes`` in ``CHUNK`` requests."""
    path = directory / "raw-odirect.bin"
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for pos in range(0, nbytes, CHUNK):
            assert os.pwritev(fd, [buf], pos) == CHUNK
        os.fdatasync(fd)
        write = nbytes / (time.perf_counter() - t0) / GB
        t0 = time.perf_counter()
        for pos in range(0, nbytes, CHUNK):
            assert os.preadv(fd, [buf], pos) == CHUNK
        read = nbytes / (time.perf_counter() - t0) / GB
    finally:
        os.close(fd)
        path.unlink()
    return write, read


def drop_pool(d: DaemonProcess) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + d.pool_name)
    except posix_ipc.ExistentialError:
        pass


def tier(sched: SchedulerClient):
    return sched.info().tiers[0]


def _until(sched: SchedulerClient, field: str, total: int) -> float:
    """Poll the tier until ``field`` reaches ``total``; returns the wall clock then."""
    t0 = time.time()
    while getattr(tier(sched), field) < total:
        assert time.time() - t0 < 600, f"{field} stuck below {total}"
        time.sleep(0.002)
    return time.time()


def demote_promote(work: Path, nbytes: int) -> dict:
    n = nbytes // BIG_BYTES
    pool = f"{(nbytes * 3 // 2) >> 20}MiB"
    (work / "d-rate").mkdir(parents=True)
    d = DaemonProcess(work / "d-rate", pool, ["--extent-size", "64MiB", "--log-level", "info"])
    disk = ["--disk-path", str(work / "disk-rate"), "--disk-size", "64GiB"]
    kv = None
    try:
        d.start(disk)
        kv = HostKv(blocks=n, **BIG)       # after the start: see kill_loop on shm names
        cfg = d.client_config(timeout_ms=60_000)
        worker, reg = kv.register(cfg)
        sched = SchedulerClient(cfg)
        keys = kv.keys(list(range(n * 16)))
        kv.kv.normal_()
        expect = kv.kv.clone()
        # One block first: its store waits for the copy engine's start, its demotion for the
        # tier's; the clock then sees only the steady write-behind.
        assert all(c.ok for c in worker.wait(
            [keyed_store(sched, worker, reg, kv.namespace, [0], keys[:1])], 600))
        _until(sched, "demoted_bytes", BIG_BYTES)
        t0 = time.time()
        jobs = [keyed_store(sched, worker, reg, kv.namespace, list(range(a, min(n, a + 64))),
                            keys[a:a + 64])
                for a in range(1, n, 64)]
        done = worker.wait(jobs, 600)
        # Every block written (the pool has room for all): a block not stored would not be
        # demoted, and the clock below would never stop.
        assert all(c.ok for c in done) and sum(c.nbytes for c in done) == (n - 1) * BIG_BYTES
        demote_s = _until(sched, "demoted_bytes", n * BIG_BYTES) - t0
        worker.close()
        sched.close()
        kv.close()
        # A reboot: the pool is gone. Look everything up and load it: disk -> pool -> engine.
        d.kill()
        drop_pool(d)
        d.restart(disk)
        kv = HostKv(blocks=n, **BIG)
        worker, reg = kv.register(cfg)
        sched = SchedulerClient(cfg)
        t0, wall0 = time.perf_counter(), time.time()
        hit = sched.lookup(kv.namespace, [keys], pin=True)
        assert hit.hits == [n], hit.hits
        jobs = [worker.submit_load(reg, hit.slots[0][a:a + 64], list(range(a, min(n, a + 64))),
                                   keys[a:a + 64]) for a in range(0, n, 64)]
        promote_s = _until(sched, "promoted_bytes", n * BIG_BYTES) - wall0
        assert all(c.ok for c in worker.wait(jobs, 600))
        end_to_end_s = time.perf_counter() - t0
        exact = bool(torch.equal(kv.kv, expect))
        sched.release(hit.leases)
        worker.close()
        sched.close()
        d.stop()
        return {"blocks": n, "block_bytes": BIG_BYTES, "bytes": n * BIG_BYTES,
                "demote_s": demote_s, "demote_gbps": (n - 1) * BIG_BYTES / demote_s / GB,
                "promote_s": promote_s, "promote_gbps": n * BIG_BYTES / promote_s / GB,
                "promote_to_engine_s": end_to_end_s,
                "promote_to_engine_gbps": n * BIG_BYTES / end_to_end_s / GB,
                "promoted_byte_exact": exact}
    finally:
        d.cleanup()
        if kv is not None:
            kv.close()


def ready_time(work: Path, blocks: int) -> dict:
    """Spawn-to-ping seconds with ``blocks`` 4 KiB blocks on disk, and with none."""
    kv = HostKv()                      # 4 KiB slots (only its layout and keys are used here)
    kv.close()
    slot = kv.layout.slot_bytes
    disk = work / "disk-100k"
    buf = mmap.mmap(-1, 1024 * slot)
    buf.write(os.urandom(1024 * slot))
    store = DiskStore.open(str(disk), buf)
    keys = [kv.namespace + k for k in kv.keys(list(range(blocks * 16)))]
    offsets = np.arange(1024, dtype=np.int64) * slot
    for a in range(0, blocks, 1024):
        part = keys[a:a + 1024]
        store.write(slot, np.arange(a, a + len(part), dtype=np.int64), offsets[:len(part)], part,
                    np.arange(a + 1, a + 1 + len(part), dtype=np.uint64), np.zeros(0, np.int64))
    store.close()
    out: dict = {"empty_all": [], "full_all": [], "full_indexed_all": []}
    for i, (label, path) in enumerate([("empty", work / "disk-empty"), ("full", disk)] * 3):
        (work / f"d-{label}-{i}").mkdir()
        d = DaemonProcess(work / f"d-{label}-{i}", "256MiB", ["--disk-path", str(path),
                                                          "--log-level", "info"])
        try:
            t0 = time.perf_counter()
            d.start()
            sched = SchedulerClient(d.client_config(timeout_ms=60_000))
            wait_for(lambda: sched.ping(), 60, "first ping", 0.002)
            out[f"{label}_all"].append(time.perf_counter() - t0)
            t = tier(sched)
            if label == "full":
                wait_for(lambda: tier(sched).blocks >= blocks, 60, "every block indexed", 0.002)
                out["full_indexed_all"].append(time.perf_counter() - t0)
                engine = HostKv()              # a new shm, just before it is registered
                worker, reg = engine.register(d.client_config())
                out["hits"] = sched.lookup(kv.namespace, [[k[16:] for k in keys[:64]]]).hits[0]
                out["adopted"] = t.adopted_blocks
                worker.close()
                engine.close()
                scan = [ln for ln in d.log().splitlines() if "disk tier" in ln and "adopted" in ln]
                out["tier_log"] = scan[-1].split(": ", 1)[-1] if scan else ""
            sched.close()
            d.stop()
        finally:
            d.cleanup()
    out["empty"] = statistics.median(out["empty_all"])
    out["full"] = statistics.median(out["full_all"])
    out["full_indexed"] = statistics.median(out["full_indexed_all"])
    return out


def kill_loop(work: Path, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    (work / "d-kill").mkdir()
    d = DaemonProcess(work / "d-kill", "256MiB", ["--extent-size", "16MiB", "--disk-path",
                                                  str(work / "disk-kill"), "--disk-size", "4GiB"])
    shape = dict(blocks=64, layers=2, block_tokens=16, heads=32, head_dim=128)   # 1 MiB blocks
    stored: dict[bytes, torch.Tensor] = {}
    prompts: list[list[bytes]] = []
    served = torn = kills_mid_demotion = 0
    demote_s = 0.0

    def check_all(kv, sched, worker, reg) -> tuple[int, int]:
        s = t = 0
        for keys in prompts:
            hit = sched.lookup(kv.namespace, [keys], pin=True)
            refs = hit.slots[0]
            for a in range(0, len(refs), 32):
                ids = list(range(len(refs[a:a + 32])))
                kv.poison(ids)
                c = worker.wait([worker.submit_load(reg, refs[a:a + 32], ids,
                                                    keys[a:a + len(ids)])],
                                60)[0]
                if not c.ok:
                    continue
                for b, k in zip(ids, keys[a:a + 32]):
                    s += 1
                    t += not torch.equal(kv.blocks_of([b]), stored[k])
            sched.release(hit.leases)
        return s, t

    try:
        d.start()
        for r in range(rounds + 1):
            # A new shm per daemon life: an old name may be gone (see tests/integration/test_disk_tier).
            kv = HostKv(**shape)
            cfg = d.client_config(timeout_ms=30_000)
            worker, reg = kv.register(cfg)
            sched = SchedulerClient(cfg)
            s, t = check_all(kv, sched, worker, reg)
            served, torn = served + s, torn + t
            if r == rounds:
                failures = tier(sched).verify_failures
                worker.close()
                sched.close()
                kv.close()
                break
            keys = kv.keys(list(range(10**6 * (r + 1), 10**6 * (r + 1) + 64 * 16)))
            kv.kv.normal_()
            for b, k in enumerate(keys):
                stored[k] = kv.blocks_of([b])
            prompts.append(keys)
            done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, list(range(64)),
                                            keys)], 60)[0]
            assert done.ok and done.nbytes == 64 * kv.layout.shard_bytes, done
            if r == 0:                                # calibrate: one whole demotion
                t0 = time.time()
                demote_s = _until(sched, "demoted_blocks", 64) - t0
            else:
                time.sleep(rng.random() * 1.5 * demote_s)
            kills_mid_demotion += tier(sched).demoted_blocks < 64
            worker.close()
            sched.close()
            kv.close()
            d.kill()
            drop_pool(d)
            d.restart()
        d.stop()
    finally:
        d.cleanup()
    return {"rounds": rounds, "demote_64_s": demote_s,
            "kills_before_demotion_done": kills_mid_demotion,
            "blocks_served": served, "torn_blocks_served": torn,
            "verify_failures_last_daemon": failures}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="", help="directory on the disk to measure (default: a "
                    "temporary directory under the current one)")
    ap.add_argument("--bytes", type=int, default=1 << 30, help="bytes to demote and promote")
    ap.add_argument("--ready-blocks", type=int, default=100_000)
    ap.add_argument("--kill-rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--suffix", default="", help="appended to the file name (a rerun the same "
                    "day: -rerun)")
    args = ap.parse_args()
    base = Path(args.dir or ".").resolve()
    work = Path(tempfile.mkdtemp(prefix="kvpool-disk-bench-", dir=base))
    try:
        reps = []
        for r in range(args.reps):
            rw, rr = raw_rates(work, args.bytes)
            rates = demote_promote(work / f"rep{r}", args.bytes)
            reps.append({"raw_write_gbps": rw, "raw_read_gbps": rr, **rates,
                         "demote_ratio": rates["demote_gbps"] / rw,
                         "promote_ratio": rates["promote_gbps"] / rr})
        ready = ready_time(work, args.ready_blocks)
        kills = kill_loop(work, args.kill_rounds, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in reps) for k in (
        "raw_write_gbps", "raw_read_gbps", "demote_gbps", "promote_gbps",
        "promote_to_engine_gbps", "demote_ratio", "promote_ratio")}
    fs = os.statvfs(base)
    res = {
        "date": dt.date.today().isoformat(),
        "host": f"{platform.machine()}, {os.cpu_count()} cores, {platform.release()}",
        "directory_fs_bytes": fs.f_blocks * fs.f_frsize,
        "command": " ".join(["python"] + sys.argv),
        "demote_ratio": med["demote_ratio"], "promote_ratio": med["promote_ratio"],
        "ready_s_100k_blocks": ready["full"], "ready_s_empty_disk": ready["empty"],
        "indexed_s_100k_blocks": ready["full_indexed"],
        "median": med, "block_bytes": BIG_BYTES, "bytes_per_rep": args.bytes,
        "promoted_byte_exact": all(r["promoted_byte_exact"] for r in reps),
        "reps": reps,
        "ready_s_starts": {"empty": ready["empty_all"], "100k": ready["full_all"],
                           "100k_indexed": ready["full_indexed_all"]},
        "ready_blocks": args.ready_blocks, "ready_adopted": ready.get("adopted"),
        "ready_hits_of_64": ready.get("hits"), "ready_tier_log": ready.get("tier_log"),
        **kills,
    }
    out = Path(args.out) / f"disk-{res['date']}{args.suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
