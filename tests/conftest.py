"""Fixtures shared by every test: a real kvpoold process on a temporary socket and pool, a
Mooncake master, and a pool opened in the test's own process."""

from __future__ import annotations

import os
import secrets

import pytest

from bench.kvtest import DaemonProcess, unless_unavailable  # noqa: F401  (tests import them from here)
from bench.mooncake import MooncakeMaster
from bench.soak.common import stop_process, wait_for  # noqa: F401  (tests import them from here)
from kvpool.daemon.pool import Pool
from kvpool.shared.config import DaemonConfig


@pytest.fixture
def daemon_factory(tmp_path):
    made: list[DaemonProcess] = []

    def make(pool_size: str = "64MiB", extra: list[str] | None = None, start: bool = True,
             subdir: str | None = None) -> DaemonProcess:
        d = tmp_path / (subdir or f"d{len(made)}")
        d.mkdir(exist_ok=True)
        proc = DaemonProcess(d, pool_size, extra)
        made.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in made:
        proc.cleanup()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture
def mooncake_master(tmp_path):
    """A running ``mooncake_master`` on free loopback ports (skips where Mooncake is missing)."""
    m = MooncakeMaster(tmp_path).start()
    yield m
    m.cleanup()


@pytest.fixture
def pool_config():
    cfg = DaemonConfig(pool_name=f"kvpool-unit-{os.getpid()}-{secrets.token_hex(4)}",
                       pool_size="8MiB", extent_size="1MiB")
    yield cfg
    import posix_ipc
    try:
        posix_ipc.unlink_shared_memory("/" + cfg.pool_name)
    except posix_ipc.ExistentialError:
        pass


@pytest.fixture
def pool(pool_config):
    p = Pool.open(pool_config)
    yield p
    p.close(unlink=True)
