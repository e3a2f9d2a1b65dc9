"""Host copy path across TP sizes (issue 16): GB/s of one TP=2 rank's head range (its rows of
slots that hold every KV head) against a TP=1 rank's whole blocks, through ``HostCopyEngine``
alone (no daemon), for a per-layer (LBNHC) and a block-outermost head-major (BLHNC) cache of a
Llama-3.1-8B-like model (8 KV heads, 32 layers, 16 tokens, 512-byte K+V cells).

Run: ``python -m bench.investigations.tp_cross_host [--blocks 128] [--reps 5]``. CPU only; prints one line per
case (medians), nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import numpy as np  # noqa: E402

from kvpool.client.host_memory import SharedHostMemory  # noqa: E402
from kvpool.daemon.host_copy import HostCopyEngine  # noqa: E402
from kvpool.shared.protocol import RegisterRequest  # noqa: E402
from bench.kvtest import HeadKv  # noqa: E402


class _Pool:
    """What ``HostCopyEngine`` reads of a pool: its bytes and its name."""

    def __init__(self, nbytes: int) -> None:
        self.mem = SharedHostMemory(nbytes)
        self.name = self.mem.name

    def view(self) -> np.ndarray:
        return self.mem.tensor.numpy()


def run(order: str, tp: int, rank: int, blocks: int, reps: int) -> tuple[float, float, int]:
    kv = HeadKv(tp, rank, heads=8, layers=32, blocks=blocks, block_tokens=16, cell=256,
                order=order)
    pool = _Pool(blocks * kv.layout.slot_bytes)
    engine = HostCopyEngine(pool)
    reg = RegisterRequest(1, kv.namespace, kv.layout, rank, blocks, [kv.mem.region],
                          kv.placement)
    mapped = engine.attach(reg)
    ids = np.arange(blocks, dtype=np.int64)
    slots = ids * kv.layout.slot_bytes
    store, load = [], []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            engine.submit_store(mapped, ids, slots).result()
            store.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.submit_load(mapped, slots, ids).result()
            load.append(time.perf_counter() - t0)
    finally:
        engine.detach(mapped)
        engine.close()
        kv.close()
    n = blocks * kv.layout.shard_bytes
    return n / statistics.median(store[1:]) / 1e9, n / statistics.median(load[1:]) / 1e9, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    for order in ("LBNHC", "BLHNC"):
        for tp, rank in ((1, 0), (2, 1)):
            s, l, n = run(order, tp, rank, args.blocks, args.reps)
            print(f"host {order} TP={tp} rank {rank}: {n >> 20} MiB per job, store {s:.2f} GB/s, "
                  f"load {l:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
