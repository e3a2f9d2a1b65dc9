"""Part 6 (with ``security``), exhaustion: a pool where every slot is pinned, a /dev/shm with no
room left (a private tmpfs in a mount namespace of its own), a thousand clients at once with the
daemon's soft file limit at 1024, and requests of the maximum frame size and count. Each gets a
clear answer (a count, an error) and loses nothing.

Scenarios that need root (mount namespaces) report ``None`` where they cannot run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.soak.common import ROOT, Daemon, ShmBlocks, wait_for
from kvpool.shared import protocol as p
from kvpool.shared.errors import ErrorCode


def pool_full(workdir: Path) -> dict:
    """Pin every slot: a store then writes nothing, evicts nothing and still succeeds, and the
    daemon counts its blocks as ``no_room_blocks``; no committed block is lost; once the leases
    go, stores are written again."""
    from bench.soak.client import Engine
    d = Daemon(workdir / "pool-full", pool_size="8MiB")
    d.start()
    eng = Engine(d.socket, 64, "soak pool full")
    leases: list[int] = []
    stored: list[int] = []
    tried = 0
    try:
        i = 0
        while True:
            ids = list(range(i, i + 8))
            i += 8
            eng.fill(list(range(8)), eng.keys(ids))
            done = eng.store(list(range(8)), eng.keys(ids))
            assert done.ok, f"a store into a full pool must succeed, writing nothing: {done}"
            tried += 8
            if not eng.written(done):
                break                     # every slot is pinned: no room for any of them
            mine = eng.held(ids)
            assert len(mine) == eng.written(done), (mine, done)
            stored += mine
            hit = eng.sched.lookup(eng.ns, [eng.keys(mine)], pin=True)
            assert hit.hits == [len(mine)], hit.hits
            leases += hit.leases
            assert i < 100_000, "the pool never filled"
        full = eng.sched.info()
        hit = eng.sched.lookup(eng.ns, [[k] for k in eng.keys(stored)], pin=True)
        kept = sum(hit.hits)
        eng.sched.release(hit.leases)
        eng.sched.release(leases)
        fresh = list(range(10**6, 10**6 + 8))
        eng.fill(list(range(8)), eng.keys(fresh))
        after = eng.written(eng.store(list(range(8)), eng.keys(fresh)))
    finally:
        eng.close()
        d.stop()
        d.cleanup()
    return {"exhaustion_pool_full_lost": len(stored) - kept,
            "exhaustion_pool_full_evicted": full.evictions,
            "exhaustion_pool_full_counted": int(full.no_room_blocks == tried - len(stored)),
            "exhaustion_pool_full_recovers": int(after == 8),
            "exhaustion_pool_full_detail": {
                "stored_blocks": len(stored), "tried_blocks": tried,
                "no_room_blocks": full.no_room_blocks, "evictions": full.evictions,
                "slots_committed": full.slots_committed, "slots_pinned": full.slots_pinned,
                "written_after_release": after}}


_SHM_FULL = r"""
import json, os, subprocess, sys, time
from pathlib import Path
from bench.soak.common import Daemon, ShmBlocks
from bench.soak.client import Engine
from kvpool.shared import protocol as p
out = {}
work = Path(WORK)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", "/dev/shm"], check=True)
big = Daemon(work / "big", pool_size="64MiB")
try:
    big.start()
    out["too_big_pool"] = "started"
except AssertionError as e:
    out["too_big_pool"] = [l for l in str(e).splitlines() if "cannot reserve" in l][:1]
out["too_big_pool_left_segment"] = os.path.exists("/dev/shm/" + big.pool_name)
d = Daemon(work / "ok", pool_size="16MiB")
d.start()
eng = Engine(d.socket, 64, "shm full")
ids = list(range(32))
eng.fill(ids, eng.keys(ids))
assert eng.written(eng.store(ids, eng.keys(ids))) == 32
sparse = "kvpool-engine-sparse-%d" % os.getpid()
fd = os.open("/dev/shm/" + sparse, os.O_CREAT | os.O_RDWR, 0o600)
import fcntl
fcntl.flock(fd, fcntl.LOCK_SH)                  # a live engine's segment: not to be reaped
os.ftruncate(fd, 8 << 20)                       # sparse: no pages yet
hog = open("/dev/shm/hog", "wb")
try:
    while True:
        hog.write(b"\0" * (1 << 20)); hog.flush()
except OSError as e:
    out["filled"] = e.strerror
hog.close()
try:
    ShmBlocks(64)
    out["new_segment"] = "created"
except OSError as e:
    out["new_segment"] = e.strerror
try:
    eng.worker.register(eng.ns, eng.layout_, 0, 64, [p.HostRegion(sparse, 8 << 20)],
                        eng.mem.placement())
    out["sparse_region"] = "registered"
except Exception as e:
    out["sparse_region"] = type(e).__name__ + ": " + getattr(e, "message", str(e))
more = list(range(100, 132))
eng.fill(list(range(32)), eng.keys(more))
st = eng.store(list(range(32)), eng.keys(more))
out["store_when_full"] = st.ok and eng.written(st) == 32
bad = 0
for group in (ids, more):
    hit = eng.sched.lookup(eng.ns, [eng.keys(group)], pin=True)
    dst = list(range(32, 64))
    eng.mem.blocks[dst] = 0xA5
    ok = eng.worker.wait([eng.worker.submit_load(eng.reg, hit.slots[0], dst[:hit.hits[0]])], 30)[0].ok
    bad += (32 - hit.hits[0]) + (eng.mismatches(dst, eng.keys(group)) if ok else 32)
    eng.sched.release(hit.leases)
out["lost_or_wrong"] = bad
out["daemon_alive"] = d.alive
eng.close()
os.unlink("/dev/shm/hog")
d.stop(); d.cleanup()
print(json.dumps(out))
"""


def shm_full(workdir: Path) -> dict:
    """In a mount namespace of its own, /dev/shm is a 40 MiB tmpfs that gets filled up."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return {"exhaustion_shm_full_ok": None, "exhaustion_shm_skipped": "needs root"}
    work = workdir / "shm-full"
    work.mkdir(parents=True, exist_ok=True)
    code = _SHM_FULL.replace("ROOT", repr(str(ROOT))).replace("WORK", repr(str(work)))
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        if "unshare failed" in r.stderr or "Operation not permitted" in r.stderr:
            return {"exhaustion_shm_full_ok": None, "exhaustion_shm_skipped": r.stderr[-200:]}
        raise AssertionError(f"/dev/shm-full scenario failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out = json.loads(lines[-1])
    ok = (out["too_big_pool"] != "started" and not out["too_big_pool_left_segment"]
          and out["new_segment"] != "created" and out["sparse_region"].startswith("TooLarge")
          and out["store_when_full"] and out["lost_or_wrong"] == 0 and out["daemon_alive"])
    return {"exhaustion_shm_full_ok": int(ok), "exhaustion_shm_full_detail": out}


_MANY = r"""
import json, sys, time
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.config import ClientConfig
cfg = ClientConfig(socket=SOCK, timeout_ms=30000)
clients, answered, worst = [], 0, 0.0
for i in range(N):
    c = SchedulerClient(cfg, "many-%d" % i)
    t = time.monotonic()
    c.ping()
    worst = max(worst, time.monotonic() - t)
    answered += 1
    clients.append(c)
print(json.dumps({"answered": answered, "worst_s": worst}), flush=True)
sys.stdin.readline()                         # hold every connection until told to go
"""


def many_clients(workdir: Path, clients: int = 1000, procs: int = 4) -> dict:
    """``clients`` connections (each with its heartbeat) from ``procs`` processes, against a
    daemon started with a soft open-file limit of 1024; a normal client keeps being served."""
    d = Daemon(workdir / "many", pool_size="16MiB")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        d.start()                    # inherits the low soft limit, as from a login shell
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    from bench.soak.client import Engine
    eng = Engine(d.socket, 16, "soak many bystander")
    ps = []
    try:
        code = _MANY.replace("ROOT", repr(str(ROOT))).replace("SOCK", repr(d.socket))
        t0 = time.monotonic()
        for k in range(procs):
            n = clients // procs + (1 if k < clients % procs else 0)
            ps.append(subprocess.Popen([sys.executable, "-c", code.replace("N", str(n))],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, cwd=ROOT))
        res = []
        for pr in ps:
            line = pr.stdout.readline()
            assert line, f"a client process failed:\n{pr.stderr.read()[-2000:]}"
            res.append(json.loads(line))
        connected_s = time.monotonic() - t0
        info = eng.sched.info()
        # The bystander's round trips while every connection is up and heartbeating.
        lat = []
        for _ in range(50):
            t = time.monotonic()
            eng.sched.lookup(eng.ns, [eng.keys(range(4))])
            lat.append(time.monotonic() - t)
        ids = list(range(8))
        eng.fill(ids, eng.keys(ids))
        st = eng.store(ids, eng.keys(ids), 60)
        ok = st.ok and eng.written(st) == 8
        for pr in ps:
            pr.stdin.close()
            pr.wait(60)
        t1 = time.monotonic()
        wait_for(lambda: len(eng.sched.info().clients) <= 2, 60, "the many clients to be released")
        released_s = time.monotonic() - t1
        nofile = Path(f"/proc/{d.proc.pid}/limits").read_text()
        soft_now = [line.split()[3] for line in nofile.splitlines()
                    if line.startswith("Max open files")][0]
        alive = d.alive
    finally:
        for pr in ps:
            if pr.poll() is None:
                pr.kill()
                pr.wait(30)
            for f in (pr.stdin, pr.stdout, pr.stderr):
                if f is not None and not f.closed:
                    f.close()
        eng.close()
        d.stop()
        d.cleanup()
    lat.sort()
    return {"exhaustion_clients": sum(r["answered"] for r in res),
            "exhaustion_clients_detail": {
                "listed_by_daemon": len(info.clients), "connect_all_s": round(connected_s, 2),
                "worst_first_ping_s": round(max(r["worst_s"] for r in res), 3),
                "bystander_lookup_p50_ms": round(lat[len(lat) // 2] * 1000, 2),
                "bystander_lookup_max_ms": round(lat[-1] * 1000, 2),
                "bystander_store_ok": ok, "released_all_s": round(released_s, 2),
                "daemon_soft_nofile_started_with": 1024, "daemon_soft_nofile_now": soft_now,
                "daemon_alive": alive}}


def max_requests(workdir: Path) -> dict:
    """The largest requests a client can send, from a raw connection of a registered worker:
    a lookup filling the maximum frame, a store filling it (more entries than one request may
    name), a reservation of the most tickets one request may ask for and one more, a store
    naming every ticket the daemon grants one client (a slot for each: it evicts the pool), a
    store of the most entries and one more, a retired tag-7 frame (protocol 1's
    ``PrepareStoreRequest``) of the most keys, and a frame one byte over the limit. Each is
    answered (``TOO_LARGE``, ``PROTOCOL`` or done), the connection keeps serving, a bystander's
    pinned blocks survive whatever eviction the big store causes, and the bystander's pings
    show how long the daemon is busy with each."""
    from bench.soak.client import Engine
    from bench.soak.fuzz import retired_prepare_frame
    from kvpool.daemon.copy_jobs import MAX_BLOCKS_PER_REQUEST as most
    import zmq
    d = Daemon(workdir / "max-req", pool_size="16MiB")
    d.start()
    eng = Engine(d.socket, 16, "soak max bystander")
    mem = ShmBlocks(64)                  # the raw worker's KV: its stores name these blocks
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{d.socket}")
    req = iter(range(1, 1 << 40))
    try:
        ids = list(range(8))
        eng.fill(ids, eng.keys(ids))
        assert eng.written(eng.store(ids, eng.keys(ids))) == 8
        pinned = eng.sched.lookup(eng.ns, [eng.keys(ids)], pin=True)   # in use: must stay
        results: dict[str, dict] = {}

        def send(label: str, frame: bytes):
            """Send ``frame`` raw; ping as the bystander until its answer comes."""
            t = time.monotonic()
            raw.send(frame)
            lat = []
            while not raw.poll(0):
                t1 = time.monotonic()
                eng.sched.ping()
                lat.append(time.monotonic() - t1)
                if time.monotonic() - t > 120:
                    raise AssertionError(f"{label}: no answer in 120 s")
            reply = p.decode_reply(raw.recv())
            results[label] = {"bytes": len(frame), "answer_s": round(time.monotonic() - t, 3),
                              "reply": type(reply).__name__,
                              "code": ErrorCode(reply.code).name if getattr(reply, "code", 0)
                              else "", "bystander_ping_max_s": round(max(lat, default=0), 3)}
            return reply

        assert isinstance(send("hello", p.encode(p.Hello(
            next(req), p.PROTOCOL_VERSION, p.Role.WORKER, "max"))), p.HelloReply)
        reg = send("register", p.encode(p.RegisterRequest(
            next(req), eng.ns, eng.layout_, 0, mem.n, [mem.region()], mem.placement())))
        assert isinstance(reg, p.RegisterReply), reg
        limit = 16 << 20

        def fill_frame(make) -> bytes:
            """The frame ``make(n)`` with the most entries that fits the limit."""
            per = len(make(2)) - len(make(1))
            n = (limit - 64) // per
            while len(make(n)) > limit:
                n -= max(1, (len(make(n)) - limit) // per)
            return make(n)

        keys = [os.urandom(16) for _ in range(limit // 16)]
        # Refs the daemon never granted, distinct (a job naming one twice is refused at once),
        # each as long on the wire as a real ticket.
        unknown = [p.make_slot_ref(0x8000_0000 + i, 2**31 - 1) for i in range(limit // 16)]

        def store(tickets: list[int]) -> bytes:
            return p.encode(p.StoreRequest(next(req), reg.registration_id, next(req),
                                           [i % mem.n for i in range(len(tickets))], tickets,
                                           keys=keys[:len(tickets)]))
        send("max_lookup", fill_frame(lambda n: p.encode(p.LookupRequest(
            next(req), eng.ns, [keys[:n]]))))
        send("max_frame_store", fill_frame(lambda n: store(unknown[:n])))
        grant = send("max_reserve", p.encode(p.ReserveRequest(next(req), eng.ns, most)))
        send("max_reserve_plus_one", p.encode(p.ReserveRequest(next(req), eng.ns, most + 1)))
        granted = grant.slots if isinstance(grant, p.ReserveReply) else []
        results["max_reserve"]["granted"] = len(granted)
        done = send("max_tickets_store", store(granted))
        results["max_tickets_store"]["written_blocks"] = (getattr(done, "nbytes", 0)
                                                          // mem.block_bytes)
        send("max_keys_store", store(unknown[:most]))
        send("max_keys_plus_one_store", store(unknown[:most + 1]))
        send("retired_prepare", retired_prepare_frame(next(req), eng.ns, keys[:most]))
        ping = p.encode(p.Ping(next(req)))
        send("over_limit", ping + b"\0" * (limit + 1 - len(ping)))
        serving = isinstance(send("ping_after", p.encode(p.Ping(next(req)))), p.Pong)
        eng.sched.release(pinned.leases)
        hit = eng.sched.lookup(eng.ns, [eng.keys(ids)], pin=True)
        eng.mem.blocks[8:16] = 0xA5
        ok = eng.worker.wait([eng.worker.submit_load(eng.reg, hit.slots[0], list(range(8, 16)))],
                             30)[0].ok
        intact = int(serving and ok and hit.hits[0] == 8
                     and eng.mismatches(list(range(8, 16)), eng.keys(ids)) == 0)
        eng.sched.release(hit.leases)
    finally:
        raw.close(0)
        ctx.term()
        eng.close()
        mem.close()
        d.stop()
        d.cleanup()
    return {"exhaustion_max_request_s": max(r["answer_s"] for r in results.values()),
            "exhaustion_max_request_intact": intact,
            "exhaustion_max_request_detail": results}


def run(workdir: Path, clients: int = 1000) -> dict:
    out: dict = {}
    for part in (pool_full, shm_full, max_requests):
        out.update(part(workdir))
    out.update(many_clients(workdir, clients))
    return out
