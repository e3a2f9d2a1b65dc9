"""Several users of one host, each running ``kvpoold`` with no flags and no settings at all:
each gets a daemon of its own (its socket, its pool), beside root's, or a one-line error that
names the fix; never a traceback. Runs as root: it makes two real users (``useradd``) and runs
them with ``setpriv``, in a private mount and network namespace (its own /dev/shm, /run and
loopback, so the host's daemons, sockets and ports are neither seen nor disturbed); removes the
users after."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from bench.soak.security import stage_for_other_uids, system_python

# The scenario, run as root inside the namespace; prints one JSON line of what it saw.
_SCENARIO = r"""
import json, os, signal, subprocess, sys, time
USERS = json.loads(sys.argv[1])            # [[name, uid, gid], ...]
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": sys.argv[2]}
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", "/dev/shm"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run"], check=True)
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
out, daemons = {}, []

def run_as(who, args, **kw):
    uid, gid = who
    return dict(user=uid, group=gid, extra_groups=[], env=ENV, cwd="/tmp", **kw)

def kvpoold(who, *flags):
    return subprocess.Popen([sys.executable, "-s", "-m", "kvpool.daemon", *flags],
                            stderr=subprocess.PIPE, text=True, **run_as(who, None))

def kvpool(who, *args):
    r = subprocess.run([sys.executable, "-s", "-c", "from kvpool.daemon.cli import "
                        "operator_main; operator_main()", *args], capture_output=True,
                       text=True, timeout=120, **run_as(who, None))
    return {"rc": r.returncode, "out": r.stdout.strip(), "err": r.stderr.strip()}

def failed_start(who, *flags):
    p = kvpoold(who, *flags)
    _, err = p.communicate(timeout=120)
    return {"rc": p.returncode, "err": err}

def stop(p):
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    return {"rc": p.returncode, "err": err[-3000:]}

root = (0, 0)
people = {name: (uid, gid) for name, uid, gid in USERS}
try:
    for who in [root, *people.values()]:
        daemons.append(kvpoold(who))
        out[f"ping {who[0]}"] = kvpool(who, "ping", "--wait", "90")
    out["ping root again"] = kvpool(root, "ping")
    first = next(iter(people.values()))
    out["same user twice"] = failed_start(first)
    out["root's pool name"] = failed_start(first, "--pool-name", "kvpool")
    out["shm while serving"] = sorted(os.listdir("/dev/shm"))
    out["stops"] = [stop(p) for p in daemons]
    daemons = []
    out["run dir left by root"] = os.path.isdir("/run/kvpool")
    last = list(people.values())[-1]
    out["ping with no daemon"] = kvpool(last, "ping")
    daemons.append(kvpoold(last))
    out["ping after a root run"] = kvpool(last, "ping", "--wait", "90")
    out["stops"] += [stop(p) for p in daemons]
    daemons = []
    out["shm after"] = sorted(os.listdir("/dev/shm"))
finally:
    for p in daemons:
        p.kill()
print(json.dumps(out))
"""


@pytest.fixture
def two_users():
    if os.geteuid() != 0:
        pytest.skip("needs root: makes users (useradd) and runs them (setpriv)")
    for tool in ("useradd", "userdel", "unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    names = [f"kvpt{os.getpid() % 100000}{c}" for c in "ab"]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", "--user-group", name], check=True,
                           capture_output=True)
            made.append(name)
        import pwd
        yield [[n, pwd.getpwnam(n).pw_uid, pwd.getpwnam(n).pw_gid] for n in names]
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)


def _one_error_line(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if " ERROR " in line or line.startswith("kvpoold:")]


@pytest.fixture
def staged():
    """kvpool and what kvpoold imports, where any user can read them (pytest's own temporary
    folders are private to root)."""
    stage = Path(tempfile.mkdtemp(prefix="kvpool-users-"))
    try:
        yield stage_for_other_uids(stage, daemon=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def test_two_users_and_root_each_start_kvpoold_with_no_flags(two_users, staged):
    py = system_python()
    if py is None:
        pytest.skip("no system Python of this version for the other users")
    r = subprocess.run(["unshare", "-m", "-n", "--propagation", "private", py, "-s", "-c",
                        textwrap.dedent(_SCENARIO), json.dumps(two_users), str(staged)],
                       capture_output=True, text=True, timeout=400)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and lines, f"scenario failed ({r.returncode}):\n{r.stderr[-4000:]}"
    seen = json.loads(lines[-1])
    (a, uid_a, _), (b, uid_b, _) = two_users
    pongs = {who: seen[f"ping {who}"] for who in (0, uid_a, uid_b)}
    for who, pong in pongs.items():
        assert pong["rc"] == 0 and pong["out"].startswith("pong from kvpoold"), (who, pong)
    ids = {pong["out"].split()[3] for pong in pongs.values()}
    assert len(ids) == 3, f"the three users share a daemon: {pongs}"
    assert seen["ping root again"]["out"].split()[3] == pongs[0]["out"].split()[3]
    assert {"kvpool", f"kvpool-{uid_a}", f"kvpool-{uid_b}"} <= set(seen["shm while serving"])

    twice = seen["same user twice"]
    assert twice["rc"] == 3, twice
    assert any("owned by another running kvpoold" in x and "pool_name" in x
               for x in _one_error_line(twice["err"])), twice["err"]
    taken = seen["root's pool name"]
    assert taken["rc"] == 3, taken
    assert any("belongs to another user (root, uid 0): choose another pool_name" in x
               for x in _one_error_line(taken["err"])), taken["err"]

    # (the one traceback allowed: torch, not staged, so these daemons serve no copies)
    assert all(s["rc"] == 0 and s["err"].count("Traceback") == s["err"].count(
        "cannot import torch") for s in seen["stops"]), seen["stops"]
    # root's run left /run/kvpool; a user is not sent there, to a socket it cannot use
    assert seen["run dir left by root"]
    alone = seen["ping with no daemon"]
    assert alone["rc"] == 1 and f"/tmp/kvpool-{uid_b}/kvpoold.sock" in alone["err"] and \
        "nothing listens" in alone["err"], alone
    after = seen["ping after a root run"]
    assert after["rc"] == 0 and after["out"].startswith("pong from kvpoold"), after
    assert not [n for n in seen["shm after"] if n.startswith("kvpool")], seen["shm after"]
