"""Part 6, security and exhaustion.

Who may do what:
- another uid can neither connect to a default daemon (socket 0600) nor map its pool;
- with ``allow_uid``/``allow_gid`` (checked against the kernel's peer credentials), a listed user
  or group member is served and anyone else is refused with PERMISSION, even through a socket
  whose mode lets everybody open it; a served user still cannot make the daemon map a segment
  it could not open itself, nor reset another user's namespace;
- crafted shm names make the daemon open or unlink nothing but its pool and engine segments;
- one tenant's salted keys never reach another's blocks.

The part also runs the exhaustion scenarios (``bench/soak/exhaustion.py``).

Parts that need root (other uids) report ``None`` where they cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import msgspec

from bench.soak.common import ROOT, Daemon, ShmBlocks, key
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared import protocol as p

NOBODY = 65534          # exists everywhere (nobody:nogroup)
STRANGER = 65533        # a uid and gid with no account at all
# What code run as another uid imports: kvpool's client side and its two dependencies. The
# checkout and its venv may sit under a directory only root can enter (root's home, a
# ``mktemp -d``), so they are copied to a world-readable place, never read where they are.
_OTHER_UID_PACKAGES = {"kvpool": "kvpool", "kvpool/shared": "shared", "kvpool/client": "client"}
# numpy and posix_ipc: the scheduler client maps and reads the shared-memory index with them
# (client/index_reader.py).
_OTHER_UID_DEPENDENCIES = ("msgspec", "zmq", "numpy", "posix_ipc")
# What kvpoold itself imports besides (torch only on a thread once it serves, for host copies:
# left out, so a daemon run this way answers pings, lookups and info but copies nothing).
_DAEMON_PACKAGES = {"kvpool/daemon": "daemon"}
_DAEMON_DEPENDENCIES = ("click", "prometheus_client", "uvloop", "xxhash")


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
        assert eng.written(eng.store(ids, eng.keys(ids))) == 8
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
        assert a.written(a.store(ids, ka)) == 16
        cross = b.sched.lookup(b.ns, [kb]).hits[0]              # b's keys: none of a's blocks
        b.fill(ids, kb)
        assert b.written(b.store(ids, kb)) == 16
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


def run(workdir: Path, clients: int = 1000) -> dict:
    from bench.soak import exhaustion
    out: dict = {}
    for part in (access, crafted_names, tenants):
        out.update(part(workdir))
    out.update(exhaustion.run(workdir, clients))
    return out
