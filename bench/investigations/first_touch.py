"""Whether the first DMA into freshly registered host pages is slow, one GPU, no daemon.

    python -m bench.investigations.first_touch [--gib 8] [--chunk-mib 2048] [--out DIR]

On the H200 host every gpu_transfer run's first timed 1024-block store (2 GiB into slots
no copy had written yet) copied for 0.6-2.1 s where the next ones took ~39 ms, in old trees as
in new, long after the pool's registration had ended; the memcpy limits drop their first copy,
so they would not show it. This registers POSIX shared memory as the daemon does (pages written
once by the CPU, then ``cuMemHostRegister``) and times device -> host copies of ``--chunk-mib``
across it twice: a first pass onto pages no DMA has touched, then the same pages again; then
host -> device over a fresh region. Prints GB/s per chunk and pass, and writes
``first-touch-<date>.json`` with ``--out``. If the first pass is the slow one, a daemon could
touch its pool with a copy as it registers it (in the background, as registration runs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

from bench.shm_pool import ShmPool
from kvpool.daemon import cuda

MIB = 1 << 20


def timed_pass(stream: int, dev: int, host: int, total: int, chunk: int, to_host: bool
               ) -> list[float]:
    """GB/s of each ``chunk``-byte copy over ``[host, host + total)``, one at a time."""
    out = []
    for off in range(0, total, chunk):
        t0 = time.perf_counter()
        if to_host:
            cuda.memcpy_async(host + off, dev, chunk, stream)
        else:
            cuda.memcpy_async(dev, host + off, chunk, stream)
        cuda.stream_synchronize(stream)
        out.append(round(chunk / (time.perf_counter() - t0) / 1e9, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--chunk-mib", type=int, default=2048)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cuda.use_device(0)
    chunk = args.chunk_mib * MIB
    half = args.gib << 29           # two regions: one for stores, one for loads
    pool = ShmPool(2 * half, name="kvpool-first-touch")
    res: dict = {"investigation": "first_touch", "gib": args.gib, "chunk_mib": args.chunk_mib,
                 "date": dt.datetime.now(dt.timezone.utc).isoformat()}
    try:
        t0 = time.perf_counter()
        pool.array()[::4096] = 1                  # every page written once, as the daemon does
        res["cpu_touch_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        cuda.host_register(pool.base_address, pool.nbytes)
        res["register_s"] = round(time.perf_counter() - t0, 3)
        dev = cuda.mem_alloc(chunk)
        stream = cuda.stream_create()
        base = pool.base_address
        res["d2h_first_GBps"] = timed_pass(stream, dev, base, half, chunk, True)
        res["d2h_again_GBps"] = timed_pass(stream, dev, base, half, chunk, True)
        res["h2d_fresh_GBps"] = timed_pass(stream, dev, base + half, half, chunk, False)
        res["h2d_again_GBps"] = timed_pass(stream, dev, base + half, half, chunk, False)
        for k, v in res.items():
            print(k, v, flush=True)
        cuda.stream_destroy(stream)
        cuda.mem_free(dev)
        cuda.host_unregister(pool.base_address)
    finally:
        pool.close()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"first-touch-{dt.date.today().isoformat()}.json").write_text(
            json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
