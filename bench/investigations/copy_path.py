"""Where a single big per-layer job loses its bandwidth (issue 36, item 4), on one GPU, no daemon.

``bench/gpu_transfer.py`` saw one direction of a single 1024-block per-layer job fall to
0.55-0.61 of pinned memcpy in each run while the 8-job variants held 0.82-0.85. This script
separates the candidate causes in one process:

1. ``memory``: the memcpy limit from three kinds of host memory (a POSIX shm file registered as
   the pool is, the same with ``MADV_HUGEPAGE`` asked before its first touch, and
   ``cuMemHostAlloc``), and a plain 1 GiB memcpy each way from every 1 GiB region of a pool-sized
   registered shm file: if some regions are slower one way, the drop follows the pool's pages
   (where the host put them), not the copy path.
2. ``engine``: the CUDA copy engine (``CudaCopyEngine``) over that pool, one 1024-block job per
   rep, per-layer and block-outermost, with one setting changed per variant (chunking, the
   inline first chunk, a store's progress callback, 1D instead of pitched copies, the batch
   attributes), stores and loads alternated, every rep kept: a bimodal rep list points at state
   that changes between jobs, a uniformly slow variant at the setting.

Writes ``<out>/copy-path-<device>-<date>.json`` and prints a short table.
Run: ``python -m bench.investigations.copy_path --out /tmp/out`` (needs a GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from bench.gpu_worker import ShmPool, Worker  # noqa: E402

from kvpool.daemon import cuda  # noqa: E402

GB = 1e9
BLOCK = 2 << 20
_MADV_HUGEPAGE = 14


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        return f"unreadable: {e}"


def host_facts() -> dict:
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {
        "numa_nodes": {n: read(f"/sys/devices/system/node/{n}/cpulist") for n in nodes},
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "shm_mount": next((ln for ln in read("/proc/mounts").splitlines()
                           if " /dev/shm " in ln), ""),
        "cpus": os.cpu_count(),
        "iommu_groups": len(list(Path("/sys/kernel/iommu_groups").glob("*"))),
    }


def pfn_of(addr: int) -> int:
    """The physical frame of the page at ``addr`` (root only; 0 where hidden)."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // mmap.PAGESIZE * 8)
            entry = int.from_bytes(f.read(8), "little")
        return entry & ((1 << 55) - 1) if entry >> 63 else -1
    except OSError:
        return 0


def shm_pmd_kb(base: int) -> int:
    """ShmemPmdMapped of the mapping at ``base`` (kB mapped by 2 MiB pages)."""
    hit = False
    for ln in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in ln.split(" ", 1)[0] and not ln.startswith(("Shmem", "Anon")):
            lo = int(ln.split("-", 1)[0], 16)
            hit = lo == base - base % mmap.PAGESIZE
        elif hit and ln.startswith("ShmemPmdMapped:"):
            return int(ln.split()[1])
    return -1


def timed_copy(dst: int, src: int, nbytes: int, stream: int, reps: int) -> float:
    """Median GB/s of ``reps`` synchronised ``cuMemcpyAsync`` calls (after one warm-up)."""
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        cuda.memcpy_async(dst, src, nbytes, stream)
        cuda.stream_synchronize(stream)
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts[1:]) / GB


def memory_kinds(nbytes: int, reps: int) -> dict:
    """The memcpy limit each way from shm (as the pool), shm + MADV_HUGEPAGE, cuMemHostAlloc."""
    dev = cuda.mem_alloc(nbytes)
    stream = cuda.stream_create()
    out = {}
    try:
        for kind in ("shm", "shm_hugepage", "host_alloc"):
            shm = None
            if kind == "host_alloc":
                base = cuda.host_alloc(nbytes)
            else:
                shm = ShmPool(nbytes, name=f"kvpool-probe-{kind}-{os.getpid()}")
                base = shm.base_address
                if kind == "shm_hugepage":
                    libc = ctypes.CDLL(None, use_errno=True)
                    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                    rc = libc.madvise(base, nbytes, _MADV_HUGEPAGE)
                    out["hugepage_madvise_rc"] = rc
                np.frombuffer(shm.buffer, np.uint8)[::mmap.PAGESIZE] = 1   # first touch
                cuda.host_register(base, nbytes)
            row = {"h2d_GBps": timed_copy(dev, base, nbytes, stream, reps),
                   "d2h_GBps": timed_copy(base, dev, nbytes, stream, reps)}
            if shm is not None:
                row["shmem_pmd_mapped_kB"] = shm_pmd_kb(base)
                cuda.host_unregister(base)
                shm.close()
            else:
                cuda.host_free(base)
            out[kind] = {k: round(v, 2) for k, v in row.items()}
            print(f"[memory] {kind}: {out[kind]}", flush=True)
    finally:
        cuda.stream_destroy(stream)
        cuda.mem_free(dev)
    return out


def region_scan(pool: ShmPool, region: int, reps: int) -> list[dict]:
    """A plain memcpy each way between the GPU and every ``region`` bytes of the pool."""
    dev = cuda.mem_alloc(region)
    stream = cuda.stream_create()
    rows = []
    try:
        for k in range(pool.nbytes // region):
            at = pool.base_address + k * region
            rows.append({"region": k, "pfn_first": pfn_of(at), "pfn_mid": pfn_of(at + region // 2),
                         "h2d_GBps": round(timed_copy(dev, at, region, stream, reps), 2),
                         "d2h_GBps": round(timed_copy(at, dev, region, stream, reps), 2)})
    finally:
        cuda.stream_destroy(stream)
        cuda.mem_free(dev)
    return rows


# name -> (engine attributes changed, whether stores tell progress as the daemon's do)
VARIANTS = {
    "default": ({}, True),
    "no_progress": ({}, False),
    "one_chunk": ({"chunk_blocks": 0}, True),
    "no_inline_first_chunk": ({"inline_first_chunk": False}, True),
    "chunk_256": ({"chunk_blocks": 256}, True),
    "batch64x4": ({"dma_2d_batch_ops": 64, "dma_batch_copies": 64}, True),
    "dma_1d": ({"pitched": False}, True),
    "flags_0": ({"_flags": 0}, True),
    "order_any_loads": ({"_order_any": True}, True),
}


def run_engine(eng, m, blocks: np.ndarray, offs: np.ndarray, reps: int, progress: bool
               ) -> dict:
    """``reps`` stores and loads of one job each, alternated; GB/s of each rep."""
    nbytes = len(blocks) * m.registration.layout.shard_bytes
    st, ld = [], []
    tell = (lambda n: None) if progress else None
    for _ in range(reps):
        t0 = time.perf_counter()
        eng.submit_store(m, blocks, offs, b"", tell).result(120)
        st.append(nbytes / (time.perf_counter() - t0) / GB)
        t0 = time.perf_counter()
        eng.submit_load(m, offs, blocks).result(120)
        ld.append(nbytes / (time.perf_counter() - t0) / GB)
    return {"store_GBps": [round(x, 2) for x in st], "load_GBps": [round(x, 2) for x in ld],
            "store_median": round(statistics.median(st), 2),
            "load_median": round(statistics.median(ld), 2)}


def apply(eng, changes: dict) -> dict:
    """Set ``changes`` on the engine (and the batch attributes), returning the old values."""
    old = {}
    for k, v in changes.items():
        if k == "_flags":
            old[k] = cuda._batch_attr.flags
            cuda._batch_attr.flags = v
        elif k == "_order_any":
            old[k] = cuda._batch_attr.srcAccessOrder
        else:
            old[k] = getattr(eng, k)
            setattr(eng, k, v)
    return old


def engine_variants(pool: ShmPool, blocks: int, reps: int, layouts: list[str],
                    variants: list[str], region_offset: int) -> dict:
    from kvpool.daemon.cuda_copy import CudaCopyEngine
    eng = CudaCopyEngine(pool)
    assert eng.registration.wait(300), "pool registration did not finish"
    eng._require_ready()
    eng._check_pitched(0)
    out: dict = {"pitched": eng.pitched, "pitched_3d": eng.pitched_3d}
    try:
        for layout in layouts:
            w = Worker(0, layout, blocks)
            try:
                reg = w.register_request()
                m = eng.attach(reg)
                w.call("fill", 3)
                ids = np.arange(blocks, dtype=np.int64)
                offs = region_offset + ids * reg.layout.slot_bytes
                eng.submit_store(m, ids[:64], offs[:64]).result(120)      # warm
                eng.submit_load(m, offs[:64], ids[:64]).result(120)
                for name in variants:
                    changes, progress = VARIANTS[name]
                    loads_any = changes.get("_order_any", False)
                    old = apply(eng, changes)
                    try:
                        if loads_any:
                            # loads only: the pool is never written while a load reads it
                            # (1D batches only: pitched records carry their own order)
                            cuda._batch_attr.srcAccessOrder = 3
                            ld = []
                            for _ in range(reps):
                                t0 = time.perf_counter()
                                eng.submit_load(m, offs, ids).result(120)
                                ld.append(len(ids) * reg.layout.shard_bytes
                                          / (time.perf_counter() - t0) / GB)
                            row = {"load_GBps": [round(x, 2) for x in ld],
                                   "load_median": round(statistics.median(ld), 2)}
                        else:
                            row = run_engine(eng, m, ids, offs, reps, progress)
                    finally:
                        for k, v in old.items():
                            if k == "_flags":
                                cuda._batch_attr.flags = v
                            elif k == "_order_any":
                                cuda._batch_attr.srcAccessOrder = v
                            else:
                                setattr(eng, k, v)
                    row["backend"] = eng.backend_for(m)
                    out[f"{layout}/{name}"] = row
                    print(f"[engine] {layout}/{name}: store {row.get('store_GBps')} "
                          f"load {row.get('load_GBps')}", flush=True)
                eng.detach(m, wait_s=30)
            finally:
                w.close()
    finally:
        eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/copy-path")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--pool-gib", type=int, default=12)
    ap.add_argument("--layouts", default="per_layer,block_outer")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--skip", default="", help="comma list of parts to skip: memory,regions,engine")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    import torch
    dev = torch.cuda.get_device_name(0)
    res: dict = {"device": dev, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                 "command": " ".join(sys.argv), "host": host_facts()}
    print("[host] " + json.dumps(res["host"]), flush=True)
    cuda.use_device(0)
    if "memory" not in skip:
        res["memory"] = memory_kinds(1 << 30, 5)
    pool = ShmPool(args.pool_gib << 30, name=f"kvpool-probe-pool-{os.getpid()}")
    try:
        if "regions" not in skip:
            np.frombuffer(pool.buffer, np.uint8)[::mmap.PAGESIZE] = 1
            cuda.host_register(pool.base_address, pool.nbytes)
            try:
                res["regions"] = [region_scan(pool, 1 << 30, 3) for _ in range(2)]
            finally:
                cuda.host_unregister(pool.base_address)
            for p, rows in enumerate(res["regions"]):
                print(f"[regions pass {p}] h2d " + " ".join(f"{r['h2d_GBps']:.1f}" for r in rows)
                      + " | d2h " + " ".join(f"{r['d2h_GBps']:.1f}" for r in rows), flush=True)
        if "engine" not in skip:
            # jobs into the pool's second GiB: clear of the tables a daemon's pool starts with
            res["engine"] = engine_variants(pool, args.blocks, args.reps,
                                            args.layouts.split(","), args.variants.split(","),
                                            1 << 30)
    finally:
        pool.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"copy-path-{dev.replace(' ', '_')}-{dt.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    print(f"written {out / stem}.json", flush=True)


if __name__ == "__main__":
    main()
