"""Part 1, integrity: checksummed transfers from several client processes on a pool small
enough to evict all the time; every load equals its key's pattern or reports failure, and
nothing is left pinned, leased, half-written or reserved once every client is gone."""

from __future__ import annotations

import time
from pathlib import Path

from bench.soak.common import Daemon, client_result, spawn_client, wait_for
from kvpool.client.scheduler import SchedulerClient


def leftovers(daemon: Daemon, timeout_s: float = 30) -> tuple[int, dict]:
    """Leases + pinned + writing slots + unused tickets once no client is connected (waits
    for that)."""
    probe = SchedulerClient(daemon.client_config(timeout_ms=5000), "soak-probe", heartbeat=False)
    try:
        # The probe itself is a client: wait until it is the only one.
        wait_for(lambda: len(probe.info().clients) <= 1, timeout_s,
                 "every client to be released")
        info = probe.info()
        return (info.leases + info.slots_pinned + info.slots_writing + info.slots_reserved,
                dict(leases=info.leases, pinned=info.slots_pinned, writing=info.slots_writing,
                     tickets=info.slots_reserved, committed=info.slots_committed,
                     evictions=info.evictions, errors=info.errors,
                     duplicate_blocks=info.duplicate_blocks, no_room_blocks=info.no_room_blocks))
    finally:
        probe.close()


def run(workdir: Path, transfers: int = 1_000_000, clients: int = 4, seconds: float = 3600,
        keys: int = 50_000, max_batch: int = 32, pool_size: str = "8MiB",
        lease_ttl_s: float = 1.0) -> dict:
    d = Daemon(workdir / "integrity", pool_size=pool_size,
               extra=["--lease-ttl-s", str(lease_ttl_s)])
    d.start()
    t0 = time.monotonic()
    try:
        procs = [spawn_client("integrity", workdir / f"integrity-client{i}.log",
                              socket=d.socket, seed=i + 1, transfers=-(-transfers // clients),
                              seconds=seconds, keys=keys, max_batch=max_batch,
                              lease_ttl_s=lease_ttl_s, abandon=(i == clients - 1))
                 for i in range(clients)]
        results = [client_result(pr, seconds + 120) for pr in procs]
        elapsed = time.monotonic() - t0
        leaked, state = leftovers(d)
        assert d.alive, f"kvpoold died:\n{d.log_tail()}"
    finally:
        d.stop()
        d.cleanup()
    total = {k: sum(r[k] for r in results) for k in results[0] if k != "codes"}
    codes: dict[str, int] = {}
    for r in results:
        for k, v in r["codes"].items():
            codes[k] = codes.get(k, 0) + v
    return {
        "transfers": total["transfers"],
        "corrupted_blocks": total["corrupted"],
        "leaked_after_exit": leaked,
        "integrity_clients": clients,
        "integrity_seconds": round(elapsed, 1),
        "integrity_detail": {**total, "failure_codes": codes, "after_exit": state,
                             "pool_size": pool_size, "key_universe": keys,
                             "lease_ttl_s": lease_ttl_s},
    }
