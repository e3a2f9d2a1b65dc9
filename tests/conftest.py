"""Fixtures shared by every test: a real kvpoold process on a temporary socket and pool."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from bench.soak.common import stop_process, wait_for  # noqa: F401  (tests import them from here)
from kvpool.shared.config import ClientConfig

STARTUP_TIMEOUT_S = 30.0


def unless_unavailable(fn: Callable[[], object]):
    """``fn()``, or None when the daemon is unavailable (for ``wait_for`` across restarts)."""
    from kvpool.shared.errors import DaemonUnavailable

    try:
        return fn()
    except DaemonUnavailable:
        return None


class DaemonProcess:
    """A kvpoold subprocess. ``start``/``stop``/``kill``/``restart`` keep socket and pool name."""

    def __init__(self, tmp: Path, pool_size: str = "64MiB", extra: list[str] | None = None) -> None:
        self.socket = str(tmp / "kvpoold.sock")
        self.pool_name = f"kvpool-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.pool_size = pool_size
        self.extra = list(extra or [])
        self.log_path = tmp / "kvpoold.log"
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        return [sys.executable, "-m", "kvpool.daemon", "--socket", self.socket,
                "--pool-name", self.pool_name, "--pool-size", self.pool_size,
                # 2 s: a client process busy on a loaded 2-core machine (building an engine,
                # importing torch) can miss heartbeats for over 500 ms; tests of the release
                # rule itself ask for a short timeout.
                "--extent-size", "1MiB", "--cuda", "off", "--peer-timeout-ms", "2000",
                "--log-level", "debug", "--metrics-port", "0", *self.extra]

    def start(self, extra: list[str] | None = None) -> "DaemonProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args() + list(extra or []), stdout=log, stderr=log)
        log.close()
        wait_for(lambda: self._answers() or self.proc.poll() is not None,
                 STARTUP_TIMEOUT_S, "kvpoold to answer a ping")
        if self.proc.poll() is not None:
            raise AssertionError(f"kvpoold exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def _answers(self) -> bool:
        """Whether the daemon serves yet. (Its socket file appears a moment before it listens,
        and clients fail fast on a socket nobody listens on.)"""
        from kvpool.client.scheduler import SchedulerClient
        from kvpool.shared.errors import DaemonUnavailable
        if not os.path.exists(self.socket):
            return False
        probe = SchedulerClient(self.client_config(timeout_ms=2000, reconnect_backoff_ms=0),
                                "test-probe", heartbeat=False)
        try:
            probe.ping()
            return True
        except DaemonUnavailable:
            return False
        finally:
            probe.close()

    def client_config(self, **kw) -> ClientConfig:
        kw.setdefault("timeout_ms", 3000)
        kw.setdefault("reconnect_backoff_ms", 50)
        return ClientConfig(socket=self.socket, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"kvpoold ignored signal {sig} for {timeout_s} s:\n{self.log()}")

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
        # A killed daemon leaves its socket file; a restarted one replaces it.

    def restart(self, extra: list[str] | None = None) -> "DaemonProcess":
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        return self.start(extra)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        import posix_ipc
        try:
            posix_ipc.unlink_shared_memory("/" + self.pool_name)
        except posix_ipc.ExistentialError:
            pass


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
