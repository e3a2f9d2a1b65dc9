"""Part 6, security and exhaustion.

Who may do what:
- another uid can neither connect to a default daemon (socket 0600) nor map its pool;
- with ``allow_uid``/``allow_gid`` (checked against the kernel's peer credentials), a listed user
  or group member is served and anyone else is refused with PERMISSION, even through a socket
  whose mode lets everybody open it; a served user still cannot make the daemon map a segment
  it could not open itself, nor reset another user's namespace;
- crafted shm names make the daemon open or unlink nothing but its pool and engine segments;
- one tenant's salted keys never reach another's blocks.

Exhaustion: a pool where everything is pinned, a /dev/shm with no room left (a private tmpfs in
a mount namespace of its own), a thousand clients at once with the daemon's soft file limit at
1024, and requests of the maximum frame size: clear errors, and nothing lost.

Parts that need root (other uids, mount namespaces) report ``None`` where they cannot run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgspec

from bench.soak.common import ROOT, Daemon, ShmBlocks, key, unlink_shm, wait_for
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared import protocol as p
from kvpool.shared.errors import ErrorCode, PoolFull

NOBODY = 65534          # exists everywhere (nobody:nogroup)
STRANGER = 65533        # a uid and gid with no account at all
# What code run as another uid imports: kvpool's client side and its two dependencies. The
# checkout and its venv may sit under a directory only root can enter (root's home, a
# ``mktemp -d``), so they are copied to a world-readable place, never read where they are.
_OTHER_UID_PACKAGES = {"kvpool": "kvpool", "kvpool/shared": "shared", "kvpool/client": "client"}
_OTHER_UID_DEPENDENCIES = ("msgspec", "zmq")
# What kvpoold itself imports besides (torch only on a thread once it serves, for host copies:
# left out, so a daemon run this way answers pings, lookups and info but copies nothing).
_DAEMON_PACKAGES = {"kvpool/daemon": "daemon"}
_DAEMON_DEPENDENCIES = ("numpy", "click", "prometheus_client", "uvloop", "posix_ipc", "xxhash")


def system_python() -> str | None:
    """A Python another uid can run (the venv's interpreter may sit where it cannot reach)."""
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (f"/usr/bin/python{want}", "/usr/bin/python3"):
        if os.access(cand, os.X_OK):
            r = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
            if r.stdout.strip() == want:
                return cand
    return None


def stage_for_other_uids(dest: Path, daemon: bool = False) -> Path:
    """Copy what ``as_user`` code imports into ``dest`` (world-readable); returns the folder
    that code imports from (its ``PYTHONPATH``). ``daemon``: also what kvpoold needs to run."""
    import importlib.util
    site = dest / "site"
    packages = {**_OTHER_UID_PACKAGES, **(_DAEMON_PACKAGES if daemon else {})}
    for target, source in packages.items():
        shutil.copytree(ROOT / source, site / target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in _OTHER_UID_DEPENDENCIES + (_DAEMON_DEPENDENCIES if daemon else ()):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not installed"
        if not spec.submodule_search_locations:      # a module of one file (an extension)
            shutil.copy2(spec.origin, site / Path(spec.origin).name)
            continue
        pkg = Path(list(spec.submodule_search_locations)[0])
        # Wheels repaired by auditwheel keep their shared libraries beside the package.
        for part in (pkg, pkg.parent / f"{name}.libs", pkg.parent / f"py{name}.libs"):
            if part.is_dir():
                shutil.copytree(part, site / part.name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return site


def as_user(uid: int, gid: int, code: str, site: Path, timeout_s: float = 60) -> dict:
    """Run ``code`` as ``uid``:``gid`` (no supplementary groups) with ``site`` (from
    ``stage_for_other_uids``) as its only import path of ours; it prints one JSON line."""
    py = system_python()
    assert py, "no system Python of our version for another uid"
    prelude = "import sys, json, os\n"
    r = subprocess.run([py, "-s", "-c", prelude + textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout_s, user=uid, group=gid, extra_groups=[],
                       env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(site)},
                       cwd="/tmp")
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and lines, f"as uid {uid}: rc {r.returncode}\n{r.stderr[-2000:]}"
    return json.loads(lines[-1])


_TRY_CLIENT = """
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import KvpoolError
c = SchedulerClient(ClientConfig(socket={sock!r}, timeout_ms=3000), "stranger", heartbeat=False)
out = {{}}
try:
    c.ping(); out["ping"] = "ok"
except KvpoolError as e:
    out["ping"] = type(e).__name__ + ": " + e.message
try:
    c.info(); out["info"] = "ok"
except KvpoolError as e:
    out["info"] = type(e).__name__ + ": " + e.message
c.close()
print(json.dumps(out))
"""


def _public_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvpool-soak-sec-", dir="/tmp"))
    d.chmod(0o755)
    return d


# ---- who may connect ---------------------------------------------------------------------

def access(workdir: Path) -> dict:
    if os.geteuid() != 0 or system_python() is None:
        return {"security_other_uid_refused": None,
                "security_skipped": "needs root and a system Python of the same version"}
    pub = _public_dir()
    out: dict = {}
    try:
        site = stage_for_other_uids(pub / "py")
        # 1. Defaults: socket 0600, pool 0600.
        d = Daemon(pub / "default")
        d.workdir.chmod(0o755)
        d.start()
        try:
            seen = as_user(NOBODY, NOBODY, f"""
                import socket, errno
                out = {{}}
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect({d.socket!r}); out["connect"] = "connected"
                except OSError as e:
                    out["connect"] = errno.errorcode[e.errno]
                for flags in (os.O_RDONLY, os.O_RDWR):
                    try:
                        os.close(os.open("/dev/shm/{d.pool_name}", flags)); out["pool"] = "opened"
                    except OSError as e:
                        out.setdefault("pool", errno.errorcode[e.errno])
                print(json.dumps(out))""", site)
            client = as_user(NOBODY, NOBODY, _TRY_CLIENT.format(sock=d.socket), site)
        finally:
            d.stop()
            d.cleanup()
        out["default_socket_other_uid"] = seen["connect"]
        out["default_pool_other_uid"] = seen["pool"]
        out["default_client_other_uid"] = client["ping"]
        # 2. A socket anyone may open, an allow list that admits STRANGER only.
        d = Daemon(pub / "allow", extra=["--socket-mode", "0666", "--allow-uid", str(STRANGER)])
        d.workdir.chmod(0o755)
        d.start()
        try:
            refused = as_user(NOBODY, NOBODY, _TRY_CLIENT.format(sock=d.socket), site)
            admitted = as_user(STRANGER, STRANGER, _TRY_CLIENT.format(sock=d.socket), site)
            own = SchedulerClient(d.client_config(timeout_ms=3000), "owner", heartbeat=False)
            own.ping()
            own.close()
            out["allow_uid_refuses_other"] = refused["ping"]
            out["allow_uid_admits_listed"] = admitted["ping"] + "/" + admitted["info"]
            out.update(_confused_deputy(d, site))
        finally:
            d.stop()
            d.cleanup()
        # 3. Group membership: nogroup's members only.
        d = Daemon(pub / "allow-gid", extra=["--socket-mode", "0666", "--allow-gid",
                                             str(NOBODY)])
        d.workdir.chmod(0o755)
        d.start()
        try:
            out["allow_gid_admits_member"] = as_user(
                NOBODY, NOBODY, _TRY_CLIENT.format(sock=d.socket), site)["ping"]
            out["allow_gid_refuses_other"] = as_user(
                STRANGER, STRANGER, _TRY_CLIENT.format(sock=d.socket), site)["ping"]
        finally:
            d.stop()
            d.cleanup()
    finally:
        shutil.rmtree(pub, ignore_errors=True)
    refused_all = (out["default_socket_other_uid"] == "EACCES"
                   and out["default_pool_other_uid"] == "EACCES"
                   and "permission denied" in out["default_client_other_uid"]
                   and out["allow_uid_refuses_other"].startswith("PermissionDenied")
                   and out["allow_uid_admits_listed"] == "ok/ok"
                   and out["allow_gid_admits_member"] == "ok"
                   and out["allow_gid_refuses_other"].startswith("PermissionDenied")
                   and out["foreign_segment_register"].startswith("PermissionDenied")
                   and out["foreign_namespace_reset"].startswith("PermissionDenied"))
    return {"security_other_uid_refused": int(refused_all), "security_access_detail": out}


def _confused_deputy(d: Daemon, site: Path) -> dict:
    """An admitted uid (STRANGER) names root's engine segment, and resets root's namespace."""
    from bench.soak.client import Engine
    eng = Engine(d.socket, 8, "root engine", model="soak-root-model")
    try:
        ids = list(range(8))
        eng.fill(ids, eng.keys(ids))
        refs = eng.sched.prepare_store(eng.ns, eng.keys(ids))
        assert eng.worker.wait([eng.worker.submit_store(eng.reg, ids, refs)], 30)[0].ok
        layout_json = msgspec.json.encode(eng.layout_)
        res = as_user(STRANGER, STRANGER, f"""
            import msgspec
            from kvpool.client.scheduler import SchedulerClient
            from kvpool.client.worker import WorkerClient
            from kvpool.shared.config import ClientConfig
            from kvpool.shared.errors import KvpoolError
            from kvpool.shared.protocol import HostRegion
            from kvpool.shared.layout import Layout, SegmentPlacement
            cfg = ClientConfig(socket={d.socket!r}, timeout_ms=3000)
            w = WorkerClient(cfg, "stranger", heartbeat=False)
            s = SchedulerClient(cfg, "stranger", heartbeat=False)
            out = {{}}
            try:
                w.register({eng.ns!r}, msgspec.json.decode({layout_json!r}, type=Layout), 0, 8,
                           [HostRegion({eng.mem.name!r}, 8 * 4096)], [SegmentPlacement(0, 0, 4096)])
                out["register"] = "registered"
            except KvpoolError as e:
                out["register"] = type(e).__name__ + ": " + e.message
            try:
                s.reset({eng.ns!r}); out["reset"] = "reset"
            except KvpoolError as e:
                out["reset"] = type(e).__name__ + ": " + e.message
            w.close(); s.close()
            print(json.dumps(out))""", site)
        hits = eng.sched.lookup(eng.ns, [eng.keys(ids)]).hits[0]
    finally:
        eng.close()
    return {"foreign_segment_register": res["register"], "foreign_namespace_reset": res["reset"],
            "blocks_left_after_foreign_reset": hits}


# ---- crafted names ---------------------------------------------------------------------------

CRAFTED = ["../../../../etc/passwd", "..", ".", "", "/", "x\0y", "kvpool-kv-\0", "a/b",
           "kvpool-kv-../../tmp/x", "kvpool-kv-" + "a" * 300, "/dev/shm/{decoy}", "{decoy}",
           "../{decoy}", "{pool}", "/{pool}", "kvpool-engine-{missing}", "kvpool-engine-\n",
           "{file}", "../../..{file}", "kvpool-kv-{missing}/../{decoy}"]


def _open_files(pid: int) -> list[str]:
    """What ``pid``'s open descriptors point at; one closed between the listing and its
    readlink (the daemon opens and closes pidfds and sockets as clients come and go) is
    skipped."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return out


def crafted_names(workdir: Path) -> dict:
    """Register each crafted name as a host region: every one is refused with a clear error, the
    daemon maps and unlinks nothing of the decoys, and serves on."""
    pub = _public_dir()
    d = Daemon(pub / "names")
    d.start()
    decoy = ShmBlocks(2, 4096, name=f"kvpool-decoy-{os.getpid()}")
    decoy.blocks[:] = 3
    decoy_file = pub / "decoy-file"
    decoy_file.write_bytes(b"x" * 4096)
    from bench.soak.client import Engine
    eng = Engine(d.socket, 4, "soak names")
    answers: dict[str, str] = {}
    try:
        for tmpl in CRAFTED:
            name = tmpl.format(decoy=decoy.name, pool=d.pool_name, missing="no-such-x",
                               file=str(decoy_file))
            try:
                eng.worker.register(eng.ns, eng.layout_, 0, 2, [p.HostRegion(name, 8192)],
                                    [eng.mem.placement()[0]])
                answers[repr(name)[:60]] = "REGISTERED"
            except Exception as e:           # noqa: BLE001 - every answer is recorded
                answers[repr(name)[:60]] = f"{type(e).__name__}: {getattr(e, 'message', e)}"[:90]
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
        fds = _open_files(d.proc.pid)
        alive = d.alive
        eng.sched.ping()
    finally:
        eng.close()
        d.stop()
        d.cleanup()
    intact = (decoy_file.read_bytes() == b"x" * 4096 and (decoy.blocks == 3).all()
              and Path("/dev/shm/" + decoy.name).exists())
    touched = [x for x in maps.splitlines() + fds if "decoy" in x or "passwd" in x]
    decoy.close()
    shutil.rmtree(pub, ignore_errors=True)
    refused = sum(1 for v in answers.values() if v != "REGISTERED")
    return {"security_crafted_names_refused": refused, "security_crafted_names": len(CRAFTED),
            "security_foreign_objects_touched": len(touched) + (0 if intact else 1),
            "security_names_detail": {"answers": answers, "daemon_alive_after": alive,
                                      "touched": touched}}


# ---- tenants -----------------------------------------------------------------------------------

def tenants(workdir: Path) -> dict:
    """Two tenants of one model store the same token ids under different salts."""
    from bench.soak.client import Engine
    d = Daemon(workdir / "tenants")
    d.start()
    a = Engine(d.socket, 32, "tenant a")
    b = Engine(d.socket, 32, "tenant b")
    try:
        ids = list(range(16))
        ka = [key(a.ns, i, b"salt-a") for i in ids]
        kb = [key(b.ns, i, b"salt-b") for i in ids]
        a.fill(ids, ka)
        assert a.worker.wait([a.worker.submit_store(a.reg, ids, a.sched.prepare_store(
            a.ns, ka))], 30)[0].ok
        cross = b.sched.lookup(b.ns, [kb]).hits[0]              # b's keys: none of a's blocks
        b.fill(ids, kb)
        assert b.worker.wait([b.worker.submit_store(b.reg, ids, b.sched.prepare_store(
            b.ns, kb))], 30)[0].ok
        wrong = 0
        for eng, keys in ((a, ka), (b, kb)):
            hit = eng.sched.lookup(eng.ns, [keys], pin=True)
            dst = list(range(16, 32))
            eng.mem.blocks[dst] = 0xA5
            assert eng.worker.wait([eng.worker.submit_load(eng.reg, hit.slots[0], dst)],
                                   30)[0].ok
            wrong += eng.mismatches(dst, keys)
            eng.sched.release(hit.leases)
    finally:
        a.close()
        b.close()
        d.stop()
        d.cleanup()
    return {"security_tenant_cross_hits": cross, "security_tenant_wrong_blocks": wrong}


# ---- exhaustion ------------------------------------------------------------------------------

def pool_full(workdir: Path) -> dict:
    """Pin everything: stores get POOL_FULL; release: they work again; nothing committed lost."""
    from bench.soak.client import Engine
    d = Daemon(workdir / "pool-full", pool_size="8MiB")
    d.start()
    eng = Engine(d.socket, 64, "soak pool full")
    leases, stored, message = [], [], ""
    try:
        i = 0
        while True:
            ids = list(range(i, i + 8))
            i += 8
            try:
                refs = eng.sched.prepare_store(eng.ns, eng.keys(ids))
            except PoolFull as e:
                message = e.message
                break
            mine = [(b, n, r) for b, (n, r) in enumerate(zip(ids, refs)) if r >= 0]
            eng.fill([b for b, _, _ in mine], eng.keys([n for _, n, _ in mine]))
            assert eng.worker.wait([eng.worker.submit_store(
                eng.reg, [b for b, _, _ in mine], [r for _, _, r in mine])], 30)[0].ok
            stored += [n for _, n, _ in mine]
            leases += eng.sched.lookup(eng.ns, [eng.keys(stored[-len(mine):])], pin=True).leases
            assert i < 100_000, "the pool never filled"
        hit = eng.sched.lookup(eng.ns, [[k] for k in eng.keys(stored)], pin=True)
        kept = sum(hit.hits)
        eng.sched.release(hit.leases)
        eng.sched.release(leases)
        refs = eng.sched.prepare_store(eng.ns, eng.keys(range(10**6, 10**6 + 8)))
        after = sum(1 for r in refs if r >= 0)
        eng.sched.abort_store([r for r in refs if r >= 0])
    finally:
        eng.close()
        d.stop()
        d.cleanup()
    return {"exhaustion_pool_full_error": message[:120],
            "exhaustion_pool_full_lost": len(stored) - kept,
            "exhaustion_pool_full_recovers": int(after == 8)}


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
assert eng.worker.wait([eng.worker.submit_store(eng.reg, ids, eng.sched.prepare_store(
    eng.ns, eng.keys(ids)))], 30)[0].ok
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
st = eng.worker.wait([eng.worker.submit_store(eng.reg, list(range(32)), eng.sched.prepare_store(
    eng.ns, eng.keys(more)))], 30)[0]
out["store_when_full"] = st.ok
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
        ok = eng.worker.wait([eng.worker.submit_store(eng.reg, ids, eng.sched.prepare_store(
            eng.ns, eng.keys(ids)))], 60)[0].ok
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
    """Frames of the maximum size, one byte over, a prepare of the most keys one request may
    name and one more: answered (or TOO_LARGE), a bystander's pinned blocks survive whatever
    eviction the big requests cause, and how long the daemon is busy with each."""
    from bench.soak.client import Engine
    import zmq
    d = Daemon(workdir / "max-req", pool_size="16MiB")
    d.start()
    eng = Engine(d.socket, 16, "soak max bystander")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{d.socket}")
    try:
        ids = list(range(8))
        eng.fill(ids, eng.keys(ids))
        assert eng.worker.wait([eng.worker.submit_store(eng.reg, ids, eng.sched.prepare_store(
            eng.ns, eng.keys(ids)))], 30)[0].ok
        pinned = eng.sched.lookup(eng.ns, [eng.keys(ids)], pin=True)   # in use: must stay
        raw.send(p.encode(p.Hello(1, p.PROTOCOL_VERSION, p.Role.SCHEDULER, "max")))
        assert raw.poll(10_000)
        raw.recv()
        limit = 16 << 20
        per_key = len(p.encode(p.LookupRequest(2, eng.ns, [[b"k" * 16] * 2]))) - \
            len(p.encode(p.LookupRequest(2, eng.ns, [[b"k" * 16]])))
        n = (limit - 64) // per_key
        keys = [os.urandom(16) for _ in range(n)]
        frame = p.encode(p.LookupRequest(2, eng.ns, [keys]))
        while len(frame) > limit:
            keys.pop()
            frame = p.encode(p.LookupRequest(2, eng.ns, [keys]))
        from kvpool.daemon.copy_jobs import MAX_BLOCKS_PER_REQUEST as most
        results = {}
        for label, msg in (("max_lookup", frame),
                           ("max_frame_prepare", p.encode(p.PrepareStoreRequest(3, eng.ns, keys))),
                           ("max_keys_prepare", p.encode(p.PrepareStoreRequest(
                               3, eng.ns, keys[:most]))),
                           ("max_keys_plus_one_prepare", p.encode(p.PrepareStoreRequest(
                               3, eng.ns, keys[:most + 1]))),
                           ("over_limit", frame + b"\0" * (limit + 1 - len(frame)))):
            t = time.monotonic()
            raw.send(msg)
            lat = []
            while not raw.poll(0):
                t1 = time.monotonic()
                eng.sched.ping()
                lat.append(time.monotonic() - t1)
                if time.monotonic() - t > 120:
                    raise AssertionError(f"{label}: no answer in 120 s")
            reply = p.decode_reply(raw.recv())
            results[label] = {"bytes": len(msg), "answer_s": round(time.monotonic() - t, 3),
                              "reply": type(reply).__name__,
                              "code": ErrorCode(reply.code).name if getattr(reply, "code", 0)
                              else "", "bystander_ping_max_s": round(max(lat, default=0), 3)}
            if isinstance(reply, p.PrepareStoreReply):
                eng.sched.abort_store([r for r in reply.slots if r >= 0])
                raw.send(p.encode(p.AbortStoreRequest(4, [r for r in reply.slots if r >= 0])))
                assert raw.poll(30_000)
                raw.recv()
        eng.sched.release(pinned.leases)
        hit = eng.sched.lookup(eng.ns, [eng.keys(ids)], pin=True)
        eng.mem.blocks[8:16] = 0xA5
        ok = eng.worker.wait([eng.worker.submit_load(eng.reg, hit.slots[0], list(range(8, 16)))],
                             30)[0].ok
        intact = int(ok and hit.hits[0] == 8 and eng.mismatches(list(range(8, 16)),
                                                                 eng.keys(ids)) == 0)
        eng.sched.release(hit.leases)
    finally:
        raw.close(0)
        ctx.term()
        eng.close()
        d.stop()
        d.cleanup()
    return {"exhaustion_max_request_s": max(r["answer_s"] for r in results.values()),
            "exhaustion_max_request_intact": intact,
            "exhaustion_max_request_detail": results}


def run(workdir: Path, clients: int = 1000) -> dict:
    out: dict = {}
    for part in (access, crafted_names, tenants, pool_full, shm_full, max_requests):
        out.update(part(workdir))
    out.update(many_clients(workdir, clients))
    return out
