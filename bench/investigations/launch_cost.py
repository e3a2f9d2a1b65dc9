"""What enqueueing a chunk of DMA costs before the GPU moves its first byte (issue 36), one GPU,
no daemon.

    python -m bench.investigations.launch_cost [--reps 30] [--out DIR] [--idle-ms 40 --flush-mib 256]

A big block-outermost job's first chunk (32 blocks of 2 MiB) took 0.26-0.40 ms on the H200 host
from its launch's start to its enqueue's end (the trace's ``launch``), about 8 us per op where a
single block's whole launch took ~29 us. ``cuMemcpyBatchAsync`` hands the copies to the GPU when
it returns, so that time is not hidden by the copy. This separates the driver's cost per op from
the cost per byte, from registered POSIX shared memory (as the pool is), each direction:

- ``call_us``: the host time of one ``cuMemcpyBatchAsync`` of ``ops`` copies of ``op_bytes``;
- ``wall_us``: that call to the stream's end (synchronised), against ``one_op_wall_us``, one
  copy of the same total bytes: their difference is what the batch costs on the copy's path;
- ``one_op_call_us``: the host time of that one copy's ``cuMemcpyAsync``;
- ``split_*``: the same chunk enqueued as batches of growing size (1, 3, 12, the rest), each
  one's enqueue meant to fit inside the copy of the one before.

``--idle-ms`` and ``--flush-mib`` set, before each timed call, the scene a daemon meets a job
in: it slept through a copy whose DMA evicted the CPU's caches (in the daemon a 32-op chunk's
enqueue took 0.4 ms where this warm figure is ~25 us).

Medians of ``--reps``. Prints a table and writes ``launch-cost-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench.shm_pool import ShmPool
from kvpool.daemon import cuda

MIB = 1 << 20


def batch(dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int,
          splits: list[int] | None = None) -> None:
    bounds = [0] + (splits or []) + [len(size)]
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            cuda.memcpy_batch_async(dst[a:b], src[a:b], size[a:b], stream)


def measure(host: int, dev: int, ops: int, op_bytes: int, to_host: bool, reps: int,
            stream: int, settle=lambda: None) -> dict[str, float]:
    """One row; ``settle()`` runs before each timed call (``--idle-ms``)."""
    offs = (np.arange(ops, dtype=np.uint64) * np.uint64(op_bytes))
    h, d = offs + np.uint64(host), offs + np.uint64(dev)
    dst, src = (h, d) if to_host else (d, h)
    size = np.full(ops, op_bytes, dtype=np.uint64)
    out: dict[str, list[float]] = {"call_us": [], "wall_us": [], "one_op_call_us": [],
                                   "one_op_wall_us": [], "split_call_us": [], "split_wall_us": []}
    splits = [s for s in (1, 4, 16) if s < ops]
    for _ in range(reps):
        cuda.stream_synchronize(stream)
        settle()
        t0 = time.perf_counter()
        batch(dst, src, size, stream)
        t1 = time.perf_counter()
        cuda.stream_synchronize(stream)
        t2 = time.perf_counter()
        out["call_us"].append((t1 - t0) * 1e6)
        out["wall_us"].append((t2 - t0) * 1e6)
        d0, s0 = int(dst[0]), int(src[0])
        settle()
        t0 = time.perf_counter()
        cuda.memcpy_async(d0, s0, ops * op_bytes, stream)
        out["one_op_call_us"].append((time.perf_counter() - t0) * 1e6)
        cuda.stream_synchronize(stream)
        out["one_op_wall_us"].append((time.perf_counter() - t0) * 1e6)
        settle()
        t0 = time.perf_counter()
        batch(dst, src, size, stream, splits)
        t1 = time.perf_counter()
        cuda.stream_synchronize(stream)
        t2 = time.perf_counter()
        out["split_call_us"].append((t1 - t0) * 1e6)
        out["split_wall_us"].append((t2 - t0) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="sleep this long before each timed call")
    ap.add_argument("--flush-mib", type=int, default=0,
                    help="and write this many MiB of host memory before that sleep")
    args = ap.parse_args()
    junk = np.zeros(args.flush_mib << 20, np.uint8)

    def settle() -> None:
        if len(junk):
            junk[::64] += 1
        if args.idle_ms:
            time.sleep(args.idle_ms / 1e3)
    cuda.use_device(0)
    total = 64 * MIB
    pool = ShmPool(total, name="kvpool-launch-cost")
    try:
        cuda.host_register(pool.base_address, pool.nbytes)
        dev = cuda.mem_alloc(total)
        stream = cuda.stream_create()
        rows = []
        for op_bytes in (2 * MIB, 256 << 10, 32 << 10):
            for ops in (1, 4, 32):
                if ops * op_bytes > total:
                    continue
                for to_host in (True, False):
                    r = measure(pool.base_address, dev, ops, op_bytes, to_host, args.reps,
                                stream, settle)
                    r.update(ops=ops, op_bytes=op_bytes, direction="d2h" if to_host else "h2d")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        cuda.stream_destroy(stream)
        cuda.mem_free(dev)
        cuda.host_unregister(pool.base_address)
    finally:
        pool.close()
    res = {"investigation": "launch_cost", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
           "idle_ms": args.idle_ms, "flush_mib": args.flush_mib, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        idle = f"-idle{args.idle_ms:g}ms" if args.idle_ms else ""
        (Path(args.out) / f"launch-cost-{dt.date.today().isoformat()}{idle}.json").write_text(
            json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
