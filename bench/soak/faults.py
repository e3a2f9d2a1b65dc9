"""Parts 2, 3 and 5: processes that die or stall under load.

- ``worker_kills``: an engine worker is SIGKILLed with jobs in flight, again and again, next to a
  bystander that keeps checking its own blocks; the daemon must release everything the dead one
  held within a second and the bystander must not notice.
- ``daemon_kills``: the daemon is SIGKILLed under load and restarted on the same pool; every
  block whose store was acknowledged must load back byte-exact, no half-written block may ever
  be visible, and clients must never wait long while it is down.
- ``stall``: a worker SIGSTOPped mid-transfer for longer than a compile step, then SIGCONT.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from bench.soak.common import (Daemon, client_result, key, namespace, read_line, spawn_client,
                               unlink_shm, wait_for)
from kvpool.client.scheduler import SchedulerClient


# ---- part 2: worker SIGKILL --------------------------------------------------------------------

def worker_kills(workdir: Path, kills: int = 100, seed: int = 7, pool_size: str = "32MiB",
                 peer_timeout_ms: int | None = None) -> dict:
    rng = random.Random(seed)
    extra = ["--peer-timeout-ms", str(peer_timeout_ms)] if peer_timeout_ms else []
    d = Daemon(workdir / "worker-kills", pool_size=pool_size, extent_size="4MiB", extra=extra)
    d.start()
    bystander = spawn_client("integrity", workdir / "worker-kills-bystander.log", socket=d.socket,
                             seed=1000 + seed, transfers=1 << 62, seconds=24 * 3600, keys=4000,
                             max_batch=16, lease_ttl_s=30.0, abandon=False,
                             stop=str(workdir / "worker-kills.stop"))
    probe = SchedulerClient(d.client_config(timeout_ms=5000), "soak-probe", heartbeat=False)
    release_s: list[float] = []
    mid_transfer = 0
    try:
        for k in range(kills):
            v = spawn_client("victim", workdir / "worker-kills-victim.log", socket=d.socket,
                             seed=k + 1, batch=256, block_bytes=4096)
            ready = read_line(v, 60)
            # Kill it while a job of it is running, as the daemon sees it.
            delay = rng.uniform(0.0, 0.2)
            t_end = time.monotonic() + delay
            busy = False
            while True:
                me = [c for c in probe.info().clients if c.pid == v.pid]
                busy = bool(me) and sum(c.jobs_in_flight for c in me) > 0
                if busy and time.monotonic() >= t_end:
                    break
                if time.monotonic() > t_end + 5:
                    break
            os.kill(v.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            mid_transfer += busy

            def released() -> bool:
                return not any(c.pid == v.pid for c in probe.info().clients)
            wait_for(released, 30, f"the daemon to release killed worker {v.pid}", every_s=0.001)
            release_s.append(time.monotonic() - t_kill)
            v.wait(10)
            v.stdout.close()
            unlink_shm(ready["shm"])      # a SIGKILLed engine cannot unlink its own KV segment
        assert bystander.poll() is None, "the bystander died"
        (workdir / "worker-kills.stop").write_text("")
        by = client_result(bystander, 120)
        assert d.alive, f"kvpoold died:\n{d.log_tail()}"
        from bench.soak.integrity import leftovers
        probe.close()
        leaked, state = leftovers(d)
    finally:
        probe.close()
        if bystander.poll() is None:
            bystander.kill()
        d.stop()
        d.cleanup()
    release_s.sort()
    return {
        "worker_kills": len(release_s),
        "worker_kill_release_max_s": round(release_s[-1], 4),
        "worker_kill_detail": {
            "killed_with_jobs_in_flight": mid_transfer,
            "release_p50_s": round(release_s[len(release_s) // 2], 4),
            "bystander_transfers": by["transfers"], "bystander_corrupted": by["corrupted"],
            "bystander_failed_jobs": by["failed_loads"] + by["failed_stores"],
            "bystander_failure_codes": by["codes"], "bystander_unavailable": by["unavailable"],
            "leaked_after_exit": leaked, "after_exit": state},
    }
