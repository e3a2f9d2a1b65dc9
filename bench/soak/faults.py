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

from bench.soak.common import (Daemon, client_result, read_line, spawn_client, stop_process,
                               unlink_shm, wait_for)
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.errors import ErrorCode


# ---- part 2: worker SIGKILL --------------------------------------------------------------------

def worker_kills(workdir: Path, kills: int = 100, seed: int = 7, pool_size: str = "32MiB",
                 peer_timeout_ms: int | None = None, victim_block_bytes: int = 16 << 10) -> dict:
    """The victims' blocks are of another size than the bystander's, so each new victim also
    needs pool extents taken from a busy model (see ``SlotTable._make_room``)."""
    rng = random.Random(seed)
    # Leases the bystander lets expire on purpose last 2 s: a drain for the victims' size
    # waits for them.
    extra = ["--lease-ttl-s", "2"]
    extra += ["--peer-timeout-ms", str(peer_timeout_ms)] if peer_timeout_ms else []
    d = Daemon(workdir / "worker-kills", pool_size=pool_size, extent_size="4MiB", extra=extra)
    d.start()
    bystander = spawn_client("integrity", workdir / "worker-kills-bystander.log", socket=d.socket,
                             seed=1000 + seed, transfers=1 << 62, seconds=24 * 3600, keys=4000,
                             max_batch=16, lease_ttl_s=2.0, abandon=False,
                             stop=str(workdir / "worker-kills.stop"))
    probe = SchedulerClient(d.client_config(timeout_ms=5000), "soak-probe", heartbeat=False)
    release_s: list[float] = []
    mid_transfer = 0
    try:
        for k in range(kills):
            # 256 blocks of 16 KiB: 4 MiB jobs, over the host path's inline limit (2 MiB), so
            # they run on a copy thread and the daemon sees them in flight when the kill lands
            # (64-block jobs were copied and answered within one dispatch: never in flight).
            v = spawn_client("victim", workdir / "worker-kills-victim.log", socket=d.socket,
                             seed=k + 1, batch=256, block_bytes=victim_block_bytes)
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


# ---- part 3: daemon SIGKILL ------------------------------------------------------------------

class _Verifier:
    """The campaign's own engine in the writers' namespace: after each restart it looks up the
    keys the writers tried and loads every hit back to compare it with the key's pattern."""

    def __init__(self, socket: str, n: int) -> None:
        from bench.soak.client import Engine
        self.eng = Engine(socket, n, "soak verifier", timeout_ms=10_000)
        self.n = n

    def check(self, ids: list[int]) -> tuple[set[int], int]:
        """(ids that loaded back byte-exact, hits whose bytes were wrong)."""
        eng, exact, torn = self.eng, set(), 0
        for lo in range(0, len(ids), self.n):
            part = ids[lo:lo + self.n]
            keys = eng.keys(part)
            hit = eng.sched.lookup(eng.ns, [[k] for k in keys], pin=True)
            got = [(i, s[0]) for i, h, s in zip(part, hit.hits, hit.slots) if h]
            if got:
                dst = list(range(len(got)))
                eng.mem.blocks[dst] = 0xA5
                for _ in range(5):
                    done = eng.worker.wait([eng.worker.submit_load(
                        eng.reg, [s for _, s in got], dst)], 60)[0]
                    # The first job after a restart goes out on the connection the old daemon
                    # knew and is refused (HELLO_REQUIRED); the worker reconnects for the next.
                    if done.ok or done.code not in (ErrorCode.HELLO_REQUIRED, ErrorCode.ABORTED):
                        break
                if not done.ok:
                    raise AssertionError(f"verifier load failed: {done}")
                want = eng.mem.blocks[dst] == _pattern_of(eng, [i for i, _ in got])
                ok = want.all(axis=1)
                exact.update(i for (i, _), good in zip(got, ok) if good)
                torn += int((~ok).sum())
            eng.sched.release(hit.leases)
        return exact, torn

    def close(self) -> None:
        self.eng.close()


def _pattern_of(eng, ids):
    from bench.soak.common import pattern
    return pattern(eng.keys(ids), eng.block_bytes)


def _read_log(path: Path, pos: int) -> tuple[list[int], list[int], int]:
    """(attempted ids, acked ids, new position) from a writer's log past ``pos``."""
    if not path.exists():
        return [], [], pos
    with open(path) as f:
        f.seek(pos)
        text = f.read()
    end = text.rfind("\n") + 1         # a line being written is read next time
    tried, acked = [], []
    for line in text[:end].splitlines():
        kind, _, num = line.partition(" ")
        (tried if kind == "a" else acked).append(int(num))
    return tried, acked, pos + len(text[:end].encode())


def daemon_kills(workdir: Path, kills: int = 100, writers: int = 2, seed: int = 11,
                 pool_size: str = "512MiB", up_s: tuple[float, float] = (0.3, 1.0),
                 batch: int = 4, pace_s: float = 0.03, timeout_ms: int = 2000,
                 backoff_ms: int = 200) -> dict:
    """Every acked block is checked after the restart that follows it and again at the end,
    so the pool must hold all of them: nothing may be evicted (``pool_capacity_blocks``)."""
    from kvpool.daemon.pool import Geometry
    from kvpool.shared.config import parse_size
    geometry = Geometry.plan(parse_size(pool_size), 4 << 20)
    capacity = geometry.num_extents * geometry.records_per_extent
    rng = random.Random(seed)
    wd = workdir / "daemon-kills"
    d = Daemon(wd, pool_size=pool_size, extent_size="4MiB")
    ready = [d.start()]
    stop = wd / "stop"
    logs = [wd / f"writer{i}.keys" for i in range(writers)]
    procs = [spawn_client("writer", wd / f"writer{i}.log", socket=d.socket, seed=seed + i,
                          base=(i + 1) * 1_000_000_000, batch=batch, log=str(logs[i]),
                          stop=str(stop), pace_s=pace_s, timeout_ms=timeout_ms,
                          backoff_ms=backoff_ms)
             for i in range(writers)]
    for pr in procs:
        read_line(pr, 60)
    verifier = _Verifier(d.socket, 256)
    pos = [0] * writers
    acked_all: list[int] = []
    per_restart_acked = per_restart_back = torn = hits_tried = 0
    try:
        for k in range(kills):
            # Let the writers work, then kill the daemon under them.
            seen = sum(p.stat().st_size for p in logs if p.exists())
            time.sleep(rng.uniform(*up_s))
            wait_for(lambda: sum(p.stat().st_size for p in logs if p.exists()) > seen, 30,
                     "the writers to make progress before a kill")
            d.kill()
            ready.append(d.start())
            tried, acked = [], []
            for i, path in enumerate(logs):
                t, a, pos[i] = _read_log(path, pos[i])
                tried += t
                acked += a
            exact, bad = verifier.check(list(dict.fromkeys(tried + acked)))
            torn += bad
            hits_tried += len(exact) + bad
            per_restart_acked += len(acked)
            per_restart_back += sum(1 for i in acked if i in exact)
            acked_all += acked
            assert all(pr.poll() is None for pr in procs), "a writer died"
        stop.write_text("")
        results = [client_result(pr, 120) for pr in procs]
        for i, path in enumerate(logs):
            _, a, pos[i] = _read_log(path, pos[i])
            acked_all += a
        assert len(acked_all) < capacity, (
            f"{len(acked_all)} blocks acked, more than the pool's {capacity}: evictions would "
            f"count as losses; give daemon_kills a larger pool_size or a longer pace_s")
        final_exact, final_bad = verifier.check(acked_all)
        torn += final_bad
        probe = SchedulerClient(d.client_config(timeout_ms=5000), "soak-probe", heartbeat=False)
        info = probe.info()
        probe.close()
        verifier.close()
        assert d.alive, f"kvpoold died:\n{d.log_tail()}"
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
        d.stop()
        d.cleanup()
    final_back = sum(1 for i in acked_all if i in final_exact)
    lost = [i for i in acked_all if i not in final_exact][:20]
    ratio_restart = per_restart_back / max(1, per_restart_acked)
    ratio_final = final_back / max(1, len(acked_all))
    restarts = ready[1:]
    return {
        "daemon_kills": kills,
        "committed_back_ratio": round(min(ratio_restart, ratio_final), 6),
        "torn_blocks_visible": torn,
        "client_block_max_s": round(max(r["longest_call_s"] for r in results), 4),
        "ready_s": round(max(restarts), 3) if restarts else None,
        "daemon_kill_detail": {
            "acked_blocks": len(acked_all), "lost_examples": lost,
            "back_after_next_restart": per_restart_back,
            "back_after_every_kill": final_back, "ratio_after_next_restart": ratio_restart,
            "ratio_after_all_kills": ratio_final, "unacked_but_visible_checked": hits_tried,
            "ready_s_mean": round(sum(restarts) / len(restarts), 3) if restarts else None,
            "first_start_s": round(ready[0], 3),
            "client_longest_calls": [r["longest_call"] for r in results],
            "client_calls": sum(r["calls"] for r in results),
            "client_unavailable": sum(r["unavailable"] for r in results),
            "client_failed_jobs": sum(r["failed_jobs"] for r in results),
            "client_failure_codes": [r["codes"] for r in results],
            "client_loads_corrupted": sum(r["corrupted"] for r in results),
            "client_timeout_ms": timeout_ms, "pool_capacity_blocks": capacity,
            "pool_used_bytes": info.used_bytes,
            "pool_bytes": info.pool_bytes, "adopted_blocks_last_start": info.adopted_blocks},
    }


# ---- part 5: stalled engines -------------------------------------------------------------------

def _stall_once(workdir: Path, name: str, stop_s: float, peer_timeout_ms: int | None,
                blocks: int) -> dict:
    """One worker SIGSTOPped for ``stop_s`` with a load in flight and tickets reserved; while
    it is stopped, a bystander stores other blocks. Returns what the staller saw and whether
    anything was misapplied."""
    from bench.soak.client import Engine
    # Heartbeats at a tenth of a short peer timeout (the default interval, 1 s, would leave a
    # live client one late beat from being released: on a loaded host the staller was, before
    # its stall, mid-store).
    extra = (["--peer-timeout-ms", str(peer_timeout_ms),
              "--heartbeat-interval-ms", str(max(10, peer_timeout_ms // 10))]
             if peer_timeout_ms else [])
    d = Daemon(workdir / name, pool_size="32MiB", extent_size="4MiB", extra=extra)
    d.start()
    probe = SchedulerClient(d.client_config(timeout_ms=5000), "soak-probe", heartbeat=False)
    proc = spawn_client("staller", workdir / f"{name}-staller.log", socket=d.socket,
                        blocks=blocks, timeout_ms=2000)
    by = None
    try:
        line = read_line(proc, 60)
        stop_process(proc.pid)
        t_stop = time.monotonic()
        by = Engine(d.socket, blocks, "soak stall bystander")
        ids = list(range(9_000_000_000, 9_000_000_000 + blocks))
        kept = released_at = None
        stored = False
        while time.monotonic() - t_stop < stop_s:
            me = [c for c in probe.info().clients if c.pid == proc.pid]
            regs = sum(c.registrations for c in me)
            if kept is None:
                kept = regs >= 1
            if regs == 0 and released_at is None:
                released_at = time.monotonic() - t_stop
            if not stored and (released_at is not None or time.monotonic() - t_stop > stop_s / 2):
                # Store while the staller is stopped (released by then, past the timeout):
                # whatever its tickets from before the stall do later must not touch these.
                by.fill(list(range(blocks)), by.keys(ids))
                done = by.store(list(range(blocks)), by.keys(ids), 60)
                assert done.ok and by.written(done) == blocks, done
                stored = True
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        res = client_result(proc, 120)
        # The bystander's blocks hold the bystander's bytes, whatever the staller did.
        hit = by.sched.lookup(by.ns, [[k] for k in by.keys(ids)], pin=True)
        got = [(b, s[0]) for b, (h, s) in enumerate(zip(hit.hits, hit.slots)) if h]
        by.mem.blocks[:] = 0xA5
        ld = by.worker.wait([by.worker.submit_load(by.reg, [s for _, s in got],
                                                   [b for b, _ in got])], 60)[0]
        bad = by.mismatches([b for b, _ in got], by.keys([ids[b] for b, _ in got])) \
            if ld.ok else len(got)
        by.sched.release(hit.leases)
        # And what the staller stored late, if anything, holds its own keys' bytes.
        late = list(range(7_000_000_000 + blocks, 7_000_000_000 + 2 * blocks))
        hit = by.sched.lookup(by.ns, [[k] for k in by.keys(late)], pin=True)
        lgot = [(b, s[0]) for b, (h, s) in enumerate(zip(hit.hits, hit.slots)) if h]
        lbad = 0
        if lgot:
            ld = by.worker.wait([by.worker.submit_load(by.reg, [s for _, s in lgot],
                                                       [b for b, _ in lgot])], 60)[0]
            lbad = by.mismatches([b for b, _ in lgot], by.keys([late[b] for b, _ in lgot])) \
                if ld.ok else len(lgot)
        by.sched.release(hit.leases)
        assert d.alive, f"kvpoold died:\n{d.log_tail()}"
    finally:
        probe.close()
        if by is not None:
            by.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        d.stop()
        d.cleanup()
    misapplied = (bad + lbad + (res["load_mismatches"] or 0)
                  + (1 if res["load_ok"] and res["load_mismatches"] is None else 0))
    return {"registration_kept_during_stall": bool(kept) and released_at is None,
            "released_after_s": round(released_at, 3) if released_at is not None else None,
            "misapplied_blocks": misapplied, "bystander_blocks_checked": len(got),
            "late_store_blocks_visible": len(lgot), "staller": res,
            "stopped_with": line}


def stall(workdir: Path, stop_s: float = 5.0, blocks: int = 512,
          short_peer_timeout_ms: int = 1000) -> dict:
    """A stall shorter than the peer timeout (the default, 10 s) must leave the worker's
    registration and jobs alone; one longer than it (here 1 s) releases the worker, which must
    then see its jobs fail or finish correctly, never land anywhere else, and reconnect."""
    short = _stall_once(workdir, "stall-within", stop_s, None, blocks)
    long = _stall_once(workdir, "stall-past-timeout", stop_s, short_peer_timeout_ms, blocks)
    return {
        "stall_s": stop_s,
        "stall_registration_kept": int(short["registration_kept_during_stall"]
                                       and short["staller"]["owner_before"]
                                       == short["staller"]["owner_after"]),
        "stall_jobs_misapplied": short["misapplied_blocks"] + long["misapplied_blocks"],
        "stall_resumed_ok": int(short["staller"]["post_ok"] and short["staller"]["load_ok"]
                                and long["staller"]["post_ok"]),
        "stall_detail": {"within_peer_timeout": short,
                         f"past_peer_timeout_{short_peer_timeout_ms}ms": long},
    }
