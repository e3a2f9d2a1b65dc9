"""Disk tier benchmark (issue 12): demote/promote GB/s against the raw O_DIRECT rate of the same
directory, restart-to-ready with 100k blocks on disk, and torn blocks served after kill -9s.

All in one run, against real kvpoold processes (host copy path, no GPU needed):

1. **Raw rate.** The same directory, O_DIRECT, one thread: sequential 8 MiB writes then reads
   of ``--bytes`` from page-aligned memory, fdatasync included (the ceiling of the device).
   Measured before and after the tier runs; the ratios divide by the better of the two (a
   shared disk varies from one minute to the next, and this errs against the tier).
2. **Demote.** A daemon with a pool bigger than ``--bytes`` and the disk tier on; an engine
   stores ``--bytes`` of 2 MiB blocks (Llama-8B-sized); the clock runs from the first store
   sent until the tier has written every byte down (stores and demotion overlap, as in use).
3. **Promote.** That daemon is SIGKILLed and its pool dropped (a reboot); a new one adopts the
   disk; the engine looks every block up and loads it: the clock runs from the lookup until the
   last load job has put the bytes in the engine's memory (disk -> pool -> engine).
4. **Ready.** 100k blocks of 4 KiB are written in the tier's own format (``DiskStore.write``);
   the clock runs from spawning kvpoold to its first answered ping, beside the same with an
   empty directory. A lookup then checks that the blocks are served.
5. **Torn.** ``--kill-rounds`` times: store 64 blocks of 1 MiB, SIGKILL kvpoold at a random
   moment of their demotion, drop the pool, restart; every block any later daemon serves is
   compared byte for byte with what was stored. ``torn_blocks_served`` counts differences.

Writes ``<out>/disk-<date>.json``. Run: ``nice -n 10 .venv/bin/python bench/disk_tier.py
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
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import posix_ipc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.daemon.disk_store import DiskStore  # noqa: E402
from tests.conftest import DaemonProcess, wait_for  # noqa: E402
from tests.kvtest import HostKv  # noqa: E402

GB = 1e9
CHUNK = 8 << 20
# 2 MiB blocks, the Llama-3.1-8B figure in DESIGN.md: 8 layers x K/V x 16 tokens x 32 x 128 x 2.
BIG = dict(layers=8, block_tokens=16, heads=32, head_dim=128)
BIG_BYTES = 8 * 2 * 16 * 32 * 128 * 2


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


def demote_promote(work: Path, nbytes: int) -> dict:
    n = nbytes // BIG_BYTES
    pool = f"{(nbytes * 3 // 2) >> 20}MiB"
    d = DaemonProcess(work / "d-rate", pool, ["--extent-size", "64MiB", "--disk-path",
                                              str(work / "disk-rate"), "--disk-size", "64GiB",
                                              "--log-level", "info"])
    (work / "d-rate").mkdir()
    kv = HostKv(blocks=n, **BIG)
    try:
        d.start()
        cfg = d.client_config(timeout_ms=60_000)
        worker, reg = kv.register(cfg)
        sched = SchedulerClient(cfg)
        keys = kv.keys(list(range(n * 16)))
        kv.kv.normal_()
        expect = kv.kv.clone()
        t0 = time.perf_counter()
        jobs = []
        for a in range(0, n, 64):
            refs = sched.prepare_store(kv.namespace, keys[a:a + 64])
            jobs.append(worker.submit_store(reg, list(range(a, a + len(refs))), refs))
        assert all(c.ok for c in worker.wait(jobs, 600))
        stored = time.perf_counter() - t0
        wait_for(lambda: tier(sched).demoted_bytes >= n * BIG_BYTES, 600, "demotion", 0.005)
        demote_s = time.perf_counter() - t0
        worker.close()
        sched.close()
        d.kill()
        drop_pool(d)
        d.restart()
        worker, reg = kv.register(cfg)
        sched = SchedulerClient(cfg)
        kv.kv.zero_()
        t0 = time.perf_counter()
        hit = sched.lookup(kv.namespace, [keys], pin=True)
        assert hit.hits == [n], hit.hits
        jobs = [worker.submit_load(reg, hit.slots[0][a:a + 64], list(range(a, min(n, a + 64))))
                for a in range(0, n, 64)]
        assert all(c.ok for c in worker.wait(jobs, 600))
        promote_s = time.perf_counter() - t0
        exact = bool(torch.equal(kv.kv, expect))
        sched.release(hit.leases)
        t = tier(sched)
        worker.close()
        sched.close()
        d.stop()
        return {"blocks": n, "block_bytes": BIG_BYTES, "bytes": n * BIG_BYTES,
                "store_s": stored, "demote_s": demote_s, "promote_s": promote_s,
                "demote_gbps": n * BIG_BYTES / demote_s / GB,
                "promote_gbps": n * BIG_BYTES / promote_s / GB,
                "promoted_bytes": t.promoted_bytes, "promoted_byte_exact": exact}
    finally:
        d.cleanup()
        kv.close()


def ready_time(work: Path, blocks: int) -> dict:
    """Spawn-to-ping seconds with ``blocks`` 4 KiB blocks on disk, and with none."""
    kv = HostKv()                      # 4 KiB slots
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
    out = {}
    for label, path in (("empty", work / "disk-empty"), ("full", disk)):
        (work / f"d-{label}").mkdir()
        d = DaemonProcess(work / f"d-{label}", "256MiB", ["--disk-path", str(path),
                                                          "--log-level", "info"])
        try:
            t0 = time.perf_counter()
            d.start()
            sched = SchedulerClient(d.client_config(timeout_ms=60_000))
            wait_for(lambda: sched.ping(), 60, "first ping", 0.002)
            out[label] = time.perf_counter() - t0
            t = tier(sched)
            if label == "full":
                worker, reg = kv.register(d.client_config())
                out["hits"] = sched.lookup(kv.namespace, [[k[16:] for k in keys[:64]]]).hits[0]
                out["adopted"] = t.adopted_blocks
                worker.close()
                scan = [ln for ln in d.log().splitlines() if "disk tier" in ln and "adopted" in ln]
                out["tier_log"] = scan[-1].split(": ", 1)[-1] if scan else ""
            sched.close()
            d.stop()
        finally:
            d.cleanup()
    kv.close()
    return out


def kill_loop(work: Path, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    (work / "d-kill").mkdir()
    d = DaemonProcess(work / "d-kill", "256MiB", ["--extent-size", "16MiB", "--disk-path",
                                                  str(work / "disk-kill"), "--disk-size", "4GiB"])
    kv = HostKv(blocks=64, layers=2, block_tokens=16, heads=32, head_dim=128)   # 1 MiB blocks
    stored: dict[bytes, torch.Tensor] = {}
    prompts: list[list[bytes]] = []
    served = torn = 0
    kills_mid_demotion = 0

    def check_all(sched, worker, reg) -> tuple[int, int]:
        s = t = 0
        for keys in prompts:
            hit = sched.lookup(kv.namespace, [keys], pin=True)
            refs = hit.slots[0]
            for a in range(0, len(refs), 32):
                ids = list(range(len(refs[a:a + 32])))
                kv.poison(ids)
                c = worker.wait([worker.submit_load(reg, refs[a:a + 32], ids)], 60)[0]
                if not c.ok:
                    continue
                for b, k in zip(ids, keys[a:a + 32]):
                    s += 1
                    t += not torch.equal(kv.blocks_of([b]), stored[k])
            sched.release(hit.leases)
        return s, t

    try:
        d.start()
        for r in range(rounds):
            cfg = d.client_config(timeout_ms=30_000)
            worker, reg = kv.register(cfg)
            sched = SchedulerClient(cfg)
            s, t = check_all(sched, worker, reg)
            served, torn = served + s, torn + t
            keys = kv.keys(list(range(10**6 * (r + 1), 10**6 * (r + 1) + 64 * 16)))
            kv.kv.normal_()
            for b, k in enumerate(keys):
                stored[k] = kv.blocks_of([b])
            prompts.append(keys)
            refs = sched.prepare_store(kv.namespace, keys)
            assert worker.wait([worker.submit_store(reg, list(range(64)), refs)], 60)[0].ok
            time.sleep(rng.random() * 0.05)       # somewhere inside the demotion
            before = tier(sched)
            kills_mid_demotion += before.demoted_blocks < 64
            worker.close()
            sched.close()
            d.kill()
            drop_pool(d)
            d.restart()
        cfg = d.client_config(timeout_ms=30_000)
        worker, reg = kv.register(cfg)
        sched = SchedulerClient(cfg)
        s, t = check_all(sched, worker, reg)
        served, torn = served + s, torn + t
        failures = tier(sched).verify_failures
        worker.close()
        sched.close()
        d.stop()
    finally:
        d.cleanup()
        kv.close()
    return {"rounds": rounds, "kills_before_demotion_done": kills_mid_demotion,
            "blocks_served": served, "torn_blocks_served": torn,
            "verify_failures_last_daemon": failures}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="", help="directory on the disk to measure (default: a "
                    "temporary directory under the current one)")
    ap.add_argument("--bytes", type=int, default=1 << 30, help="bytes to demote and promote")
    ap.add_argument("--ready-blocks", type=int, default=100_000)
    ap.add_argument("--kill-rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    base = Path(args.dir or ".").resolve()
    work = Path(tempfile.mkdtemp(prefix="kvpool-disk-bench-", dir=base))
    try:
        raw_before = raw_rates(work, args.bytes)
        rates = demote_promote(work, args.bytes)
        raw_after = raw_rates(work, args.bytes)
        ready = ready_time(work, args.ready_blocks)
        kills = kill_loop(work, args.kill_rounds, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw_w, raw_r = max(raw_before[0], raw_after[0]), max(raw_before[1], raw_after[1])
    fs = os.statvfs(base)
    res = {
        "date": dt.date.today().isoformat(),
        "host": f"{platform.machine()}, {os.cpu_count()} cores, {platform.release()}",
        "directory_fs_bytes": fs.f_blocks * fs.f_frsize,
        "command": " ".join(["python"] + sys.argv),
        "raw_odirect_write_gbps_before_after": [raw_before[0], raw_after[0]],
        "raw_odirect_read_gbps_before_after": [raw_before[1], raw_after[1]],
        "raw_odirect_write_gbps": raw_w, "raw_odirect_read_gbps": raw_r,
        **rates,
        "demote_ratio": rates["demote_gbps"] / raw_w,
        "promote_ratio": rates["promote_gbps"] / raw_r,
        "ready_s_100k_blocks": ready["full"], "ready_s_empty_disk": ready["empty"],
        "ready_blocks": args.ready_blocks, "ready_adopted": ready.get("adopted"),
        "ready_hits_of_64": ready.get("hits"), "ready_tier_log": ready.get("tier_log"),
        **kills,
    }
    out = Path(args.out) / f"disk-{res['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
