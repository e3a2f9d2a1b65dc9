"""A stand-in engine process for integration tests: stores, loads or holds blocks via kvpool.

    python -m tests.integration.engine --socket S --mode store|load|hold --first-token N ...

Prints one JSON line on stdout when its work is done (``hold`` prints it and then waits to be
killed), so the test can act on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.config import ClientConfig
from bench.kvtest import HostKv, keyed_store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mode", choices=["store", "load", "hold"], required=True)
    ap.add_argument("--blocks", type=int, default=16, help="blocks in the prompt")
    ap.add_argument("--first-token", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--pin-first-token", type=int, default=0,
                    help="hold: pin the stored prompt that starts at this token")
    args = ap.parse_args()

    cfg = ClientConfig(socket=args.socket, timeout_ms=5000)
    kv = HostKv(blocks=max(64, 2 * args.blocks), heads=args.heads, head_dim=args.head_dim)
    worker, reg = kv.register(cfg, name=f"engine-{args.mode}")
    sched = SchedulerClient(cfg, name=f"engine-{args.mode}")
    tokens = list(range(args.first_token, args.first_token + args.blocks * kv.block_tokens))
    keys = kv.keys(tokens)
    ids = list(range(args.blocks))
    out: dict = {}
    if args.mode in ("store", "hold"):
        kv.fill_random(ids, args.seed)
        if args.mode == "store":
            done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, ids, keys)], 30)[0]
            assert done.ok, done
            # Keys the pool already held or had in flight were duplicates: not written.
            out["written"] = done.nbytes // kv.layout.slot_bytes
            out["duplicates"] = len(ids) - out["written"]
        out["checksum"] = hashlib.sha256(kv.blocks_of(ids).numpy().tobytes()).hexdigest()
    if args.mode == "load":
        hit = sched.lookup(kv.namespace, [keys], pin=True)
        n = hit.hits[0]
        dst = [args.blocks + i for i in range(n)]
        kv.poison(dst)
        if n:
            done = worker.wait([worker.submit_load(reg, hit.slots[0], dst)], 30)[0]
            assert done.ok, done
        sched.release(hit.leases)
        out["hits"] = n
        out["checksum"] = hashlib.sha256(kv.blocks_of(dst).numpy().tobytes()).hexdigest()
    if args.mode == "hold":
        # Pin what is there, start a long store, then wait to be killed mid-transfer.
        pinned = kv.keys(list(range(args.pin_first_token,
                                    args.pin_first_token + kv.block_tokens)))
        out["leases"] = sum(1 for x in sched.lookup(kv.namespace, [pinned], pin=True).leases if x)
        for b, k in zip(ids, keys):
            keyed_store(sched, worker, reg, kv.namespace, [b], [k])
    print(json.dumps(out), flush=True)
    if args.mode == "hold":
        while True:
            time.sleep(1)
    worker.close()
    sched.close()
    kv.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
