"""Fixtures shared by every test: a real kvpoold process on a temporary socket and pool."""

from __future__ import annotations

import pytest

from bench.kvtest import DaemonProcess, unless_unavailable  # noqa: F401  (tests import them from here)
from bench.mooncake import MooncakeMaster
from bench.soak.common import stop_process, wait_for  # noqa: F401  (tests import them from here)


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
