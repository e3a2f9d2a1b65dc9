"""Clients released when their process exits: a real child process, its pidfd, the loop."""

import asyncio
import os
import subprocess
import sys

import pytest

from kvpool.daemon.exit_watch import ExitWatch
from kvpool.daemon.peer import Peer
from kvpool.daemon.registry import Owner
from kvpool.shared.protocol import Role

# Killed by the tests; the bound is for a test that fails before its kill.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")


def owner(oid: int, pid: int) -> Owner:
    return Owner(oid, b"id%d" % oid, Role.WORKER, "t", pid, "", 0.0,
                 peer=Peer(os.getuid(), os.getgid(), pid))


async def exits(seen: list, n: int = 1, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(seen) < n:
        assert asyncio.get_running_loop().time() < deadline, f"no exit seen in {timeout_s} s: {seen}"
        await asyncio.sleep(0.01)


def test_every_owner_of_a_process_is_released_once_when_it_exits():
    async def run():
        seen: list = []
        watch = ExitWatch(lambda ids, pid: seen.append((ids, pid)))
        child = subprocess.Popen(SLEEPER)
        try:
            watch.watch(owner(1, child.pid))
            watch.watch(owner(2, child.pid))
            child.kill()
            await exits(seen)
            assert seen == [([1, 2], child.pid)]
            await asyncio.sleep(0.05)
            assert len(seen) == 1, "reported twice"
        finally:
            child.kill()
            child.wait()
            watch.close()
    asyncio.run(run())


def test_an_owner_unwatched_before_its_exit_is_not_reported():
    async def run():
        seen: list = []
        watch = ExitWatch(lambda ids, pid: seen.append((ids, pid)))
        a = subprocess.Popen(SLEEPER)
        b = subprocess.Popen(SLEEPER)
        try:
            gone, kept = owner(1, a.pid), owner(2, b.pid)
            watch.watch(gone)
            watch.watch(kept)
            watch.unwatch(gone)             # said goodbye: released already
            a.kill()
            b.kill()
            await exits(seen)
            assert seen == [([2], b.pid)]
        finally:
            for c in (a, b):
                c.kill()
                c.wait()
            watch.close()
    asyncio.run(run())


def test_owners_without_a_visible_pid_or_of_a_gone_process_are_not_watched():
    async def run():
        seen: list = []
        watch = ExitWatch(lambda ids, pid: seen.append((ids, pid)))
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()                         # reaped: its pid is nobody's now
        watch.watch(owner(1, child.pid))
        watch.watch(Owner(2, b"x", Role.WORKER, "t", 0, "", 0.0, peer=Peer(0, 0, 0)))
        watch.watch(Owner(3, b"y", Role.WORKER, "t", 0, "", 0.0))
        await asyncio.sleep(0.05)
        assert seen == [] and watch._watches == {}
        watch.close()
    asyncio.run(run())
