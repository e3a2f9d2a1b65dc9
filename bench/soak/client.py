"""Campaign client processes: ``python -m bench.soak.client MODE '{json params}'``.

Each mode is one engine-like process (a worker and a scheduler client, a KV region in real shm)
that drives a real kvpoold and prints JSON lines on stdout; the last line is its result.

- ``integrity``: random concurrent store / load / abort / release / lease expiry; every load is
  compared with the key's pattern.

Every store goes the one way the daemon has (protocol 2): tickets reserved by the scheduler
client, bound to their keys by the worker's store (``Engine.submit_keyed``). A key that is
held or being written already, or that finds no room, is not written, and the job still
succeeds: ``JobDone.nbytes`` counts what was.
- ``victim``: keeps store and load jobs in flight until it is SIGKILLed or SIGSTOPped.
- ``writer``: stores fresh keys through daemon kills, logging what it tried and what was acked.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import deque
from pathlib import Path

from bench.soak.common import BLOCK_BYTES, ShmBlocks, key, layout, namespace, pattern
from kvpool.client.scheduler import SchedulerClient
from kvpool.client.worker import WorkerClient
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import DaemonUnavailable, ErrorCode, KvpoolError
from kvpool.shared.protocol import JobDone

POISON = 0xA5


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Engine:
    """One worker registration and one scheduler client over ``n`` blocks of shm."""

    def __init__(self, socket: str, n: int, name: str, model: str = "soak-model",
                 block_bytes: int = BLOCK_BYTES, timeout_ms: int = 5000,
                 backoff_ms: int = 50) -> None:
        cfg = ClientConfig(socket=socket, timeout_ms=timeout_ms, reconnect_backoff_ms=backoff_ms,
                           reconnect_backoff_max_ms=max(backoff_ms, 500))
        self.mem = ShmBlocks(n, block_bytes)
        self.block_bytes = block_bytes
        self.ns = namespace(model, block_bytes)
        self.layout_ = layout(block_bytes)
        self.worker = WorkerClient(cfg, name)
        self.sched = SchedulerClient(cfg, name)
        self.reg = self.worker.register(self.ns, self.layout_, 0, n, [self.mem.region()],
                                        self.mem.placement())

    def submit_keyed(self, blocks: list[int], keys: list[bytes]) -> tuple[int, list[int]]:
        """Submit a store of ``blocks`` under ``keys`` into tickets reserved now; returns (job
        id, tickets). Where the daemon grants fewer tickets than keys, only that many of the
        first blocks are stored (the job names them all the same)."""
        grant = self.sched.reserve(self.ns, len(keys))
        n = len(grant.slots)
        return self.worker.submit_store(self.reg, blocks[:n], grant.slots, keys=keys[:n],
                                        grant=grant.daemon_id), grant.slots

    def store(self, blocks: list[int], keys: list[bytes], timeout_s: float = 30) -> JobDone:
        """``submit_keyed`` and wait for its answer."""
        return self.worker.wait([self.submit_keyed(blocks, keys)[0]], timeout_s)[0]

    def written(self, done: JobDone) -> int:
        """How many blocks a finished store wrote (duplicates and blocks with no room are not)."""
        return done.nbytes // self.block_bytes

    def held(self, ids: list[int]) -> list[int]:
        """Which of ``ids`` the pool holds now (an unpinned lookup per key)."""
        hit = self.sched.lookup(self.ns, [[k] for k in self.keys(ids)])
        return [i for i, h in zip(ids, hit.hits) if h]

    def keys(self, ids) -> list[bytes]:
        return [key(self.ns, int(i)) for i in ids]

    def fill(self, blocks: list[int], keys: list[bytes]) -> None:
        self.mem.blocks[blocks] = pattern(keys, self.block_bytes)

    def mismatches(self, blocks: list[int], keys: list[bytes]) -> int:
        got = self.mem.blocks[blocks]
        return int((got != pattern(keys, self.block_bytes)).any(axis=1).sum())

    def split_failed(self, dst: list[int], ids: list[int],
                     failed: tuple[int, ...]) -> tuple[tuple[list[int], list[bytes]], list[int]]:
        """A load's blocks as ((copied blocks, their keys), blocks the daemon reported failed:
        evicted since the lookup and held nowhere else)."""
        bad = set(failed)
        keep = [j for j in range(len(dst)) if j not in bad]
        return ([dst[j] for j in keep], self.keys([ids[j] for j in keep])), \
            [dst[j] for j in sorted(bad)]

    def overwritten(self, blocks: list[int]) -> int:
        """Blocks of a load reported failed that hold anything but the poison written before
        it: a failed block is never written, least of all from a reused slot."""
        return int((self.mem.blocks[blocks] != POISON).any(axis=1).sum()) if blocks else 0

    def close(self) -> None:
        self.worker.close()
        self.sched.close()
        self.mem.close()


# ---- integrity -----------------------------------------------------------------------------

def integrity(p: dict) -> None:
    rng = random.Random(p["seed"])
    eng = Engine(p["socket"], 2 * p["max_batch"] + 8, f"soak integrity {p['seed']}")
    stats = dict(transfers=0, stored=0, loaded=0, corrupted=0, store_jobs=0, load_jobs=0,
                 failed_loads=0, failed_stores=0, aborted_before=0, aborted_during=0,
                 not_written=0, short_grants=0, expired_loads=0, expired_ok=0, double_releases=0, unpinned=0,
                 lookups=0, hits=0, unavailable=0, stale_blocks=0, keyed_loads=0, codes={})
    universe, ttl = p["keys"], p["lease_ttl_s"]
    half = p["max_batch"]
    recent: deque[int] = deque(maxlen=4 * half)
    held: list[tuple[float, list[int], list[int], int]] = []   # (when, ids, slot refs, lease)
    deadline = time.monotonic() + p["seconds"]
    stop = Path(p["stop"]) if p.get("stop") else None

    def code(c: int) -> None:
        name = ErrorCode(c).name if c in ErrorCode._value2member_map_ else str(c)
        stats["codes"][name] = stats["codes"].get(name, 0) + 1

    def load(ids: list[int], refs: list[int]) -> bool:
        dst = list(range(half, half + len(ids)))
        eng.mem.blocks[dst] = POISON
        # Half the loads name their keys (the connector's way: a block evicted since the
        # lookup is found again by key), half only the refs (a stale ref must fail alone).
        keyed = rng.random() < 0.5
        stats["keyed_loads"] += keyed
        job = eng.worker.submit_load(eng.reg, refs, dst, keys=eng.keys(ids) if keyed else ())
        done = eng.worker.wait([job], 30)[0]
        stats["load_jobs"] += 1
        if not done.ok:
            stats["failed_loads"] += 1
            code(done.code)
            return False
        loaded, stale = eng.split_failed(dst, ids, done.failed)
        stats["stale_blocks"] += len(stale)
        stats["corrupted"] += eng.mismatches(*loaded) + eng.overwritten(stale)
        stats["loaded"] += len(loaded[0])
        stats["transfers"] += len(loaded[0])
        return True

    while stats["transfers"] < p["transfers"] and time.monotonic() < deadline:
        if stop is not None and stop.exists():
            break
        try:
            op = rng.random()
            n = rng.randint(1, half)
            if op < 0.45:                                          # store
                ids = rng.sample(range(universe), n)
                keys = eng.keys(ids)
                grant = eng.sched.reserve(eng.ns, n)
                tickets = grant.slots
                if len(tickets) < n:
                    stats["short_grants"] += 1
                    ids, keys = ids[:len(tickets)], keys[:len(tickets)]
                if not tickets:
                    continue
                if rng.random() < 0.08:
                    eng.sched.abort_store(tickets)
                    stats["aborted_before"] += 1
                    continue
                blocks = list(range(len(tickets)))
                eng.fill(blocks, keys)
                job = eng.worker.submit_store(eng.reg, blocks, tickets, keys=keys,
                                              grant=grant.daemon_id)
                if rng.random() < 0.07:                            # abort while it copies
                    eng.sched.abort_store(tickets)
                    stats["aborted_during"] += 1
                done = eng.worker.wait([job], 30)[0]
                stats["store_jobs"] += 1
                if done.ok:
                    # Keys held already (another client's, or ours still in the pool) and
                    # keys that found no room are not written: nbytes counts the rest.
                    written = eng.written(done)
                    stats["stored"] += written
                    stats["not_written"] += len(tickets) - written
                    stats["transfers"] += written
                    recent.extend(ids)
                else:
                    stats["failed_stores"] += 1
                    code(done.code)
            elif op < 0.92:                                        # lookup + load
                pool = list(recent)
                ids = [rng.choice(pool) if pool and rng.random() < 0.8
                       else rng.randrange(universe) for _ in range(n)]
                ids = list(dict.fromkeys(ids))
                pin = rng.random() < 0.85
                hit = eng.sched.lookup(eng.ns, [[k] for k in eng.keys(ids)], pin=pin)
                stats["lookups"] += 1
                got = [(i, s[0]) for i, h, s in zip(ids, hit.hits, hit.slots) if h]
                leases = [x for x in hit.leases if x]
                stats["hits"] += len(got)
                if not pin:
                    stats["unpinned"] += 1
                if got:
                    load([i for i, _ in got], [s for _, s in got])
                r = rng.random()
                if pin and r < 0.05 and got:                       # let the leases expire
                    held.append((time.monotonic(), [i for i, _ in got], [s for _, s in got],
                                 len(leases)))
                elif leases:
                    eng.sched.release(leases)
                    if r < 0.10:
                        eng.sched.release(leases)                  # twice: harmless
                        stats["double_releases"] += 1
            else:                                                  # loads after lease expiry
                now = time.monotonic()
                due = [h for h in held if now - h[0] > ttl + 0.3]
                held = [h for h in held if now - h[0] <= ttl + 0.3]
                for _, ids, refs, _ in due:
                    stats["expired_loads"] += 1
                    if load(ids, refs):
                        stats["expired_ok"] += 1
        except DaemonUnavailable:
            stats["unavailable"] += 1
        except KvpoolError as e:
            code(int(e.code))
    stale_probe(eng, p["seed"], stats)
    if p.get("abandon"):
        # Exit holding leases, unused tickets and a store in flight, without closing: the
        # daemon must see the process go and release everything it held.
        eng.sched.lookup(eng.ns, [[k] for k in eng.keys(list(recent)[:half])], pin=True)
        try:
            eng.sched.reserve(eng.ns, half)
            ids = rng.sample(range(universe), half)
            eng.fill(list(range(half)), eng.keys(ids))
            eng.submit_keyed(list(range(half)), eng.keys(ids))
        except KvpoolError:
            pass
        eng.mem.close()
        emit(**stats)
        os._exit(0)
    eng.close()
    emit(**stats)


def stale_probe(eng: Engine, seed: int, stats: dict) -> None:
    """Loads by ref alone whose blocks were evicted since their (unpinned) lookup, made sure of
    once per client: the random mix only makes them when another client's stores land between
    a lookup and its load, which a fast host may never do in a CI-sized run (20,000 transfers
    in 1.1 s on an AMD EPYC VM). This client stores a batch of keys no one else stores, looks
    them up, turns the pool over itself (twice its slots of more such keys), then loads the
    refs: every block found evicted must fail alone, its poison kept."""
    batch = len(eng.mem.blocks) // 2
    fresh = iter(range(seed * 10_000_000, (seed + 1) * 10_000_000))

    def store_fresh() -> list[int]:
        ids = [next(fresh) for _ in range(batch)]
        eng.fill(list(range(batch)), eng.keys(ids))
        eng.store(list(range(batch)), eng.keys(ids))
        return ids

    ids = store_fresh()
    hit = eng.sched.lookup(eng.ns, [[k] for k in eng.keys(ids)])
    got = [(i, s[0]) for i, h, s in zip(ids, hit.hits, hit.slots) if h]
    for _ in range(0, 2 * eng.sched.info().pool_bytes // eng.block_bytes, batch):
        store_fresh()
    if not got:
        return
    dst = list(range(batch, batch + len(got)))
    eng.mem.blocks[dst] = POISON
    done = eng.worker.wait([eng.worker.submit_load(eng.reg, [r for _, r in got], dst)], 30)[0]
    if not done.ok:
        stats["failed_loads"] += 1
        return
    loaded, stale = eng.split_failed(dst, [i for i, _ in got], done.failed)
    stats["stale_blocks"] += len(stale)
    stats["corrupted"] += eng.mismatches(*loaded) + eng.overwritten(stale)


# ---- victim (worker SIGKILL / SIGSTOP) ---------------------------------------------------------

def victim(p: dict) -> None:
    """Keep stores and loads in flight until killed. Prints ``{"ready": ...}`` once jobs run."""
    rng = random.Random(p["seed"])
    n = p["batch"]
    eng = Engine(p["socket"], 2 * n, f"soak victim {p['seed']}", block_bytes=p["block_bytes"])
    base = p["seed"] * 1_000_000
    ids = list(range(base, base + n))
    eng.fill(list(range(n)), eng.keys(ids))
    deadline = time.monotonic() + 30
    while True:
        # A new block size gets room once an extent of the bystander's size has drained: the
        # first stores may find none (nothing written, JobDone still ok), as an engine's would.
        done = eng.store(list(range(n)), eng.keys(ids))
        assert done.ok, done
        if eng.written(done):
            break
        if time.monotonic() > deadline:
            raise AssertionError("no store of the victim's block size found room in 30 s")
        time.sleep(0.01)
    emit(ready=True, shm=eng.mem.name, pid=os.getpid())
    k = 0
    while True:
        k += 1
        fresh = list(range(base + k * n, base + (k + 1) * n))
        eng.fill(list(range(n)), eng.keys(fresh))
        jobs = []
        try:
            jobs.append(eng.submit_keyed(list(range(n)), eng.keys(fresh))[0])
            hit = eng.sched.lookup(eng.ns, [eng.keys(ids)], pin=True)
            if hit.hits[0]:
                jobs.append(eng.worker.submit_load(eng.reg, hit.slots[0],
                                                   list(range(n, n + hit.hits[0]))))
            eng.worker.wait(jobs, 30)
            if rng.random() < 0.5:
                eng.sched.release(hit.leases)
        except KvpoolError:
            time.sleep(0.01)


# ---- writer (daemon SIGKILL) -------------------------------------------------------------------

def writer(p: dict) -> None:
    """Store fresh keys ``[base, ...)`` while the daemon is killed and restarted under us.

    Appends ``a <id>`` to the log before each key's tickets are reserved and ``k <id>`` once its
    store was acknowledged as written (a store that finds no room for a key succeeds without
    writing it: that key is not acked), so the campaign can check every acked key after each
    restart. Also loads earlier keys, so loads are in flight when the daemon dies. Every client
    call is timed.
    """
    rng = random.Random(p["seed"])
    n = p["batch"]
    eng = Engine(p["socket"], 2 * n, f"soak writer {p['seed']}", timeout_ms=p["timeout_ms"],
                 backoff_ms=p["backoff_ms"])
    log = open(p["log"], "a", buffering=1)
    stop = Path(p["stop"])
    next_id = p["base"]
    acked: list[int] = []
    longest = 0.0
    calls = unavailable = failed_jobs = 0
    corrupted = loaded = 0
    codes: dict[str, int] = {}

    longest_what = ""

    def timed(fn, *args, **kw):
        nonlocal longest, calls, longest_what
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        except Exception as e:
            outcome[0] = type(e).__name__
            raise
        finally:
            calls += 1
            took = time.monotonic() - t0
            if took > longest:
                longest, longest_what = took, f"{fn.__name__}: {outcome[0]}"
            if took > 0.5:
                print(f"slow call {fn.__name__} {outcome[0]} {took:.3f} s, started at "
                      f"{time.time() - took:.3f}", file=sys.stderr, flush=True)
            outcome[0] = "ok"
    outcome = ["ok"]

    emit(ready=True)
    while not stop.exists():
        try:
            ids = list(range(next_id, next_id + n))
            next_id += n
            log.write("".join(f"a {i}\n" for i in ids))
            keys = eng.keys(ids)
            grant = timed(eng.sched.reserve, eng.ns, n)
            mine = ids[:len(grant.slots)]
            jobs = []
            if mine:
                blocks = list(range(len(mine)))
                eng.fill(blocks, eng.keys(mine))
                jobs.append(timed(eng.worker.submit_store, eng.reg, blocks, grant.slots,
                                  keys=keys[:len(mine)], grant=grant.daemon_id))
            old = rng.sample(acked, min(len(acked), n)) if acked else []
            hit = timed(eng.sched.lookup, eng.ns, [[k] for k in eng.keys(old)], True)
            got = [(i, s[0]) for i, h, s in zip(old, hit.hits, hit.slots) if h]
            dst = list(range(n, n + len(got)))
            if got:
                eng.mem.blocks[dst] = POISON
                jobs.append(timed(eng.worker.submit_load, eng.reg, [s for _, s in got], dst))
            done = eng.worker.wait(jobs, 30)
            for c in done:
                if not c.ok:
                    failed_jobs += 1
                    name = ErrorCode(c.code).name if c.code in ErrorCode._value2member_map_ \
                        else str(c.code)
                    codes[name] = codes.get(name, 0) + 1
            if mine and done[0].ok:
                # Fresh keys: all written unless some found no room (then ask which were).
                if eng.written(done[0]) < len(mine):
                    mine = timed(eng.held, mine)
                acked.extend(mine)
                log.write("".join(f"k {i}\n" for i in mine))
            if got and done[-1].ok:
                fine, stale = eng.split_failed(dst, [i for i, _ in got], done[-1].failed)
                corrupted += eng.mismatches(*fine) + eng.overwritten(stale)
                loaded += len(fine[0])
            timed(eng.sched.release, hit.leases)
            if p["pace_s"]:
                time.sleep(p["pace_s"])
        except DaemonUnavailable:
            unavailable += 1
            time.sleep(0.005)
        except KvpoolError as e:
            codes[e.code.name] = codes.get(e.code.name, 0) + 1
    eng.close()
    emit(calls=calls, longest_call_s=longest, longest_call=longest_what, unavailable=unavailable,
         failed_jobs=failed_jobs,
         acked=len(acked), loaded=loaded, corrupted=corrupted, codes=codes)


# ---- staller (SIGSTOP / SIGCONT) ---------------------------------------------------------------

def staller(p: dict) -> None:
    """Store ``n`` blocks, then with a load of them in flight and tickets reserved for ``n``
    more, print ``{"phase": "stop me"}`` and carry on; the campaign SIGSTOPs us there. Once
    resumed: finish the load and check it, store into the tickets reserved before the stall,
    then prove the registration still works (reconnecting if the daemon let us go)."""
    n = p["blocks"]
    eng = Engine(p["socket"], 3 * n, "soak staller", timeout_ms=p["timeout_ms"])
    base = 7_000_000_000
    first, later = list(range(base, base + n)), list(range(base + n, base + 2 * n))
    eng.fill(list(range(n)), eng.keys(first))
    done = eng.store(list(range(n)), eng.keys(first), 60)
    assert done.ok and eng.written(done) == n, done
    hit = eng.sched.lookup(eng.ns, [eng.keys(first)], pin=True)
    assert hit.hits[0] == n, hit.hits
    owner_before = eng.worker._t.owner_id
    dst = list(range(n, 2 * n))
    eng.mem.blocks[dst] = POISON
    load = eng.worker.submit_load(eng.reg, hit.slots[0], dst)
    late = eng.sched.reserve(eng.ns, n)
    assert len(late.slots) == n, late
    emit(phase="stop me", owner=owner_before)
    # ---- SIGSTOP lands about here; everything below runs after SIGCONT ----
    out: dict = {"owner_before": owner_before}
    done = eng.worker.wait([load], 60)[0]
    out["load_ok"] = done.ok
    out["load_code"] = done.code
    out["load_mismatches"] = eng.mismatches(dst, eng.keys(first)) if done.ok else None
    eng.fill(list(range(2 * n, 3 * n)), eng.keys(later))
    try:
        st = eng.worker.wait([eng.worker.submit_store(
            eng.reg, list(range(2 * n, 3 * n)), late.slots, keys=eng.keys(later),
            grant=late.daemon_id)], 60)[0]
        out["late_store_ok"], out["late_store_code"] = st.ok, st.code
        out["late_store_written"] = eng.written(st)
    except DaemonUnavailable as e:
        out["late_store_ok"], out["late_store_code"] = False, str(e)
    try:
        eng.sched.release(hit.leases)
    except KvpoolError:
        pass
    # The registration must still work: a store and a load of fresh keys, retried only for
    # the reconnect that a release during the stall makes necessary.
    fresh = list(range(base + 2 * n, base + 3 * n))
    out["post_attempts"] = 0
    out["post_ok"] = False
    for _ in range(5):
        out["post_attempts"] += 1
        try:
            eng.fill(list(range(n)), eng.keys(fresh))
            if not eng.store(list(range(n)), eng.keys(fresh), 60).ok:
                continue
            hit2 = eng.sched.lookup(eng.ns, [eng.keys(fresh)], pin=True)
            eng.mem.blocks[dst] = POISON
            ld = eng.worker.wait([eng.worker.submit_load(eng.reg, hit2.slots[0],
                                                         dst[:hit2.hits[0]])], 60)[0]
            eng.sched.release(hit2.leases)
            if ld.ok and hit2.hits[0] == n:
                out["post_ok"] = eng.mismatches(dst, eng.keys(fresh)) == 0
                break
        except DaemonUnavailable:
            time.sleep(0.05)
    out["owner_after"] = eng.worker._t.owner_id
    eng.close()
    emit(**out)


MODES = {"integrity": integrity, "victim": victim, "writer": writer, "staller": staller}

if __name__ == "__main__":
    MODES[sys.argv[1]](json.loads(sys.argv[2]))
