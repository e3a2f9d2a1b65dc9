"""The index's per-batch bookkeeping, without sockets: microseconds per operation.

    python -m bench.investigations.index_ops [--blocks 1024] [--repeat 50] [--out DIR]

Builds an ``Index`` on a real ``Pool`` in POSIX shm, as the daemon does, and times each hot
operation on ``--blocks`` blocks (lookups on 256 keys, as a scheduler step asks):

- ``reserve``: a scheduler's stock refill (tickets: no slot, no key);
- ``begin_store_keys`` / ``end_store_keys``: the first (only) rank's store giving those tickets
  slots for their keys, then its completion committing them;
- ``begin_store_keys_dup``: a store whose every key is held already (each ticket bound to a
  void: nothing written), and ``end_store_keys_dup`` forgetting those voids;
- ``begin_store_keys_evict``: the first rank's store into a full pool, each slot taken by
  evicting the least recently used block (its reservation not timed);
- ``lookup256_hit`` / ``lookup256_miss`` (no lease), ``lookup256_pin`` + ``release``
  (``release_leases`` of that lease);
- ``abort_store``: giving back a reservation nobody stored into.

Each sample is one call; the median and p90 of ``--repeat`` samples are printed. Between
samples the namespace is reset (untimed) so that every store takes free slots, except in
``begin_store_keys_evict``. 16 KiB slots in 2 MiB extents: 128 slots per extent, the ratio of
2 MiB Llama-3.1-8B blocks in the 256 MiB extents of a large pool. (Protocol 1's
``prepare_store``, keys bound at once by a round trip, is gone: every store binds tickets.)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import secrets
import sys
import time

import numpy as np

from kvpool.daemon.index import Index
from kvpool.daemon.pool import Pool
from kvpool.shared.config import DaemonConfig
from kvpool.shared.layout import Layout

SLOT_BYTES = 16 << 10
LAYOUT = Layout(16, 1, "bfloat16", (SLOT_BYTES,), "bench 16 KiB")
NS = b"N" * 16
OWNER = 1
LOOKUP_KEYS = 256


def fresh_keys(n: int, tag: int) -> list[bytes]:
    return [b"%08d%08d" % (tag, i) for i in range(n)]   # 16-byte block hashes


class Timer:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def run(self, name: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.samples.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        return {k: {"p50_us": float(np.percentile(v, 50)), "p90_us": float(np.percentile(v, 90)),
                    "samples": len(v)} for k, v in self.samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", default="", help="directory for a JSON of the results")
    args = ap.parse_args()
    n = args.blocks

    # Room for several batches of --blocks slots.
    pool_bytes = max(64 << 20, 16 * n * SLOT_BYTES)
    cfg = DaemonConfig(pool_name=f"kvpool-idxbench-{os.getpid()}-{secrets.token_hex(4)}",
                       pool_size=f"{pool_bytes >> 20}MiB", extent_size="2MiB")
    pool = Pool.open(cfg)
    try:
        ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
        ix.register_namespace(NS, LAYOUT)
        t = Timer()
        gc.collect()
        gc.freeze()
        for it in range(args.repeat + 3):
            timed = t if it >= 3 else Timer()     # three warm-up rounds
            now = float(it)
            # Reservation path: reserve, bind by the store's keys, commit.
            ks = fresh_keys(n, 2 * it)
            refs = timed.run("reserve", ix.reserve, NS, n, OWNER, now)
            assert len(refs) == n, len(refs)
            slots = timed.run("begin_store_keys", ix.begin_store, NS, refs, ks, 0, None, now)
            assert timed.run("end_store_keys", ix.end_store, slots, 0, True) == n
            # The same keys again: every ticket a duplicate (void), nothing written.
            refs = ix.reserve(NS, n, OWNER, now)
            slots = timed.run("begin_store_keys_dup", ix.begin_store, NS, refs, ks, 0, None,
                              now)
            assert all(s.void for s in slots)
            assert timed.run("end_store_keys_dup", ix.end_store, slots, 0, True) == 0
            # Lookups on committed blocks.
            look = ks[:LOOKUP_KEYS]
            hits = timed.run("lookup256_hit", ix.lookup, NS, [look], False, OWNER, now)[0]
            assert hits == [LOOKUP_KEYS]
            miss = fresh_keys(LOOKUP_KEYS, 2 * it + 1)
            assert timed.run("lookup256_miss", ix.lookup, NS, [miss], False, OWNER, now)[0] == [0]
            leases = timed.run("lookup256_pin", ix.lookup, NS, [look], True, OWNER, now)[1]
            timed.run("release", ix.release_leases, leases, OWNER)
            ix.reset(NS)
            # A reservation nobody stores into, given back.
            refs = ix.reserve(NS, n, OWNER, now)
            assert timed.run("abort_store", ix.abort_store, refs, OWNER) == n
        # A full pool: every slot a store binds comes from evicting the LRU block.
        cap = pool.geometry.num_extents * pool.slots_per_extent(SLOT_BYTES)
        for b in range(0, cap, n):
            ks = fresh_keys(min(n, cap - b), 10**6 + b)
            refs = ix.reserve(NS, len(ks), OWNER, 0.0)
            ix.end_store(ix.begin_store(NS, refs, ks, 0), 0, True)
        for it in range(args.repeat):
            ks = fresh_keys(n, 2 * 10**6 + it)
            refs = ix.reserve(NS, n, OWNER, 0.0)
            slots = t.run("begin_store_keys_evict", ix.begin_store, NS, refs, ks, 0)
            assert not any(s.void for s in slots), "a full pool of unpinned blocks found no room"
            ix.end_store(slots, 0, True)
        gc.unfreeze()
    finally:
        pool.close(unlink=True)

    res = t.summary()
    print(f"index ops, {n} blocks (lookups {LOOKUP_KEYS} keys), {args.repeat} samples, "
          f"python {platform.python_version()}")
    for name, r in res.items():
        print(f"  {name:22s} p50 {r['p50_us']:8.1f} us  p90 {r['p90_us']:8.1f} us")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "index-ops.json")
        with open(path, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "blocks": n,
                       "lookup_keys": LOOKUP_KEYS, "repeat": args.repeat,
                       "device": f"cpu {platform.machine()}, {os.cpu_count()} cores",
                       "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                       "ops": res}, f, indent=2)
        print(f"  written to {path}")


if __name__ == "__main__":
    main()
