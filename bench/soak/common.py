"""What every part of the soak campaign shares: a real kvpoold process, a KV region in real
POSIX shm (numpy only, so client processes start in a fraction of a second without torch), the
block content every key must have, and small process helpers.

Block content is a pure function of the block's key (``pattern``): whoever stores a key writes
the same bytes, and whoever loads it can check them without asking anyone. A load that returns
anything else for its key is a corrupted block.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import posix_ipc

from kvpool.shared.config import ClientConfig
from kvpool.shared.keys import make_namespace
from kvpool.shared.layout import Layout, SegmentPlacement
from kvpool.shared.protocol import ENGINE_SHM_PREFIX

ROOT = Path(__file__).resolve().parent.parent.parent
BLOCK_BYTES = 4096          # the smallest slot: a million transfers fit a 2-core machine
_MIX = np.arange(BLOCK_BYTES // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def wait_for(cond: Callable[[], object], timeout_s: float, what: str | Callable[[], str],
             every_s: float = 0.005):
    """Poll ``cond`` until truthy; raise with ``what`` after ``timeout_s`` (a callable ``what``
    is asked then, so the message can carry the state at the time of the failure)."""
    deadline = time.monotonic() + timeout_s
    while not (value := _polled(cond, deadline, timeout_s, what)):
        time.sleep(every_s)
    return value


async def wait_for_async(cond: Callable[[], object], timeout_s: float,
                         what: str | Callable[[], str], every_s: float = 0.005):
    """``wait_for`` on an event loop: polls ``cond`` between awaits, so the loop (an in-process
    daemon's) runs meanwhile."""
    import asyncio
    deadline = time.monotonic() + timeout_s
    while not (value := _polled(cond, deadline, timeout_s, what)):
        await asyncio.sleep(every_s)
    return value


def _polled(cond: Callable[[], object], deadline: float, timeout_s: float,
            what: str | Callable[[], str]):
    """One poll of ``cond``: its value, or an AssertionError naming ``what`` once past
    ``deadline``."""
    value = cond()
    if value or time.monotonic() <= deadline:
        return value
    raise AssertionError(f"timed out after {timeout_s} s waiting for "
                         f"{what() if callable(what) else what}")


class LoggedProcess:
    """A helper's subprocess (``proc``) writing to ``log_path``, for tests and benchmarks."""

    log_path: Path
    proc: subprocess.Popen | None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def logged(self, text: str, timeout_s: float = 30) -> str:
        """The log once it holds ``text``. kvpoold writes its lines from a thread of its own
        (``daemon/log_queue.py``), after what they report is visible to clients: a test that
        read the log at once missed a line on a loaded 2-core host."""
        def holding() -> str | None:
            log = self.log()
            return log if text in log else None
        return wait_for(holding, timeout_s,
                        lambda: f"{text!r} logged in {self.log_path}:\n{self.log()[-3000:]}")

    def kill_if_running(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def is_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (or gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once all its threads have stopped. ``kill`` returns before
    that: on a loaded machine a stopped mooncake_master answered a request 0.5-4 ms after the
    signal in 7 of 30 tries, so a test that went on at once saw a live peer."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: is_stopped(pid), timeout_s, f"process {pid} to stop after SIGSTOP",
             every_s=0.001)


def layout(block_bytes: int = BLOCK_BYTES, tag: str = "soak") -> Layout:
    return Layout(16, 1, "uint8", (block_bytes,), f"{tag} {block_bytes} B")


def namespace(model: str = "soak-model", block_bytes: int = BLOCK_BYTES) -> bytes:
    return make_namespace(model, layout(block_bytes).fingerprint())


def key(ns: bytes, i: int, salt: bytes = b"") -> bytes:
    """The block key of integer id ``i`` (a stand-in for a chained token hash)."""
    return hashlib.blake2b(ns + salt + i.to_bytes(8, "little"), digest_size=16).digest()


def pattern(keys: list[bytes], block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """[len(keys), block_bytes] uint8: the only bytes a block of each key may ever hold."""
    k = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)
    mix = _MIX if block_bytes == BLOCK_BYTES else (
        np.arange(block_bytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    out = (mix[None, :] + k[:, :1]) ^ k[:, 1:]
    out[:, 0], out[:, 1] = k[:, 0], k[:, 1]
    return out.view(np.uint8)


class ShmBlocks:
    """``n`` KV blocks of ``block_bytes`` in a fresh engine (``kvpool-engine-*``) shm object."""

    def __init__(self, n: int, block_bytes: int = BLOCK_BYTES, name: str | None = None) -> None:
        self.name = name or f"{ENGINE_SHM_PREFIX}soak-{os.getpid()}-{secrets.token_hex(4)}"
        self.n, self.block_bytes = n, block_bytes
        nbytes = n * block_bytes
        # As ``SharedHostMemory`` does, without torch: created empty, locked shared for this
        # process's life (kvpoold reaps it once the lock is gone), then reserved and mapped.
        shm = posix_ipc.SharedMemory("/" + self.name, posix_ipc.O_CREX, mode=0o600, size=0)
        self._fd = shm.fd
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        os.posix_fallocate(self._fd, 0, nbytes)
        self._map = mmap.mmap(self._fd, nbytes)
        self.blocks = np.frombuffer(self._map, np.uint8).reshape(n, block_bytes)

    def region(self):
        from kvpool.shared.protocol import HostRegion
        return HostRegion(self.name, self.n * self.block_bytes)

    def placement(self) -> list[SegmentPlacement]:
        return [SegmentPlacement(0, 0, self.block_bytes)]

    def close(self) -> None:
        unlink_shm(self.name)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def unlink_shm(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name.lstrip("/"))
    except posix_ipc.ExistentialError:
        pass


class Daemon:
    """A kvpoold subprocess on ``workdir``/kvpoold.sock; ``kill``/``restart`` keep the pool."""

    def __init__(self, workdir: Path, pool_size: str = "8MiB", extent_size: str = "1MiB",
                 extra: list[str] | None = None, env: dict | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.socket = str(workdir / "kvpoold.sock")
        self.pool_name = f"kvpool-soak-{os.getpid()}-{secrets.token_hex(4)}"
        self.pool_size, self.extent_size = pool_size, extent_size
        self.extra = list(extra or [])
        self.env = env
        self.log_path = workdir / "kvpoold.log"
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        return [sys.executable, "-m", "kvpool.daemon", "--socket", self.socket,
                "--pool-name", self.pool_name, "--pool-size", self.pool_size,
                "--extent-size", self.extent_size, "--cuda", "off", "--metrics-port", "0",
                *self.extra]

    def start(self, wait_ready: bool = True) -> float:
        """Start and wait until it answers a ping; returns the seconds that took."""
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=log, cwd=ROOT,
                                         env={**os.environ, **(self.env or {})})
        if wait_ready:
            self.wait_ready(60)
        return time.monotonic() - t0

    def wait_ready(self, timeout_s: float) -> None:
        from kvpool.client.scheduler import SchedulerClient
        from kvpool.shared.errors import DaemonUnavailable
        probe = SchedulerClient(self.client_config(timeout_ms=500, reconnect_backoff_ms=0),
                                "soak-probe", heartbeat=False)

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"kvpoold exited with {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
            try:
                probe.ping()
                return True
            except DaemonUnavailable:
                return False
        try:
            wait_for(answers, timeout_s, "kvpoold to answer a ping", every_s=0.002)
        finally:
            probe.close()

    def client_config(self, **kw) -> ClientConfig:
        return ClientConfig(socket=self.socket, **kw)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"kvpoold ignored SIGTERM for {timeout_s} s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def cleanup(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)
        unlink_shm(self.pool_name)


def spawn_client(mode: str, stderr_log: Path, **params) -> subprocess.Popen:
    """A campaign client process (``bench.soak.client``) printing JSON lines on stdout; its
    stderr goes to ``stderr_log`` (a pipe could fill up and stall a long-running client)."""
    with open(stderr_log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bench.soak.client", mode,
                                 json.dumps(params)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=err, bufsize=0)
    proc.log_path = stderr_log   # type: ignore[attr-defined]
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    path = getattr(proc, "log_path", None)
    return Path(path).read_text(errors="replace")[-3000:] if path else ""


def client_result(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The last JSON line of a finished client; raises with its stderr if it failed."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        raise AssertionError(f"soak client ran past {timeout_s} s:\n{_stderr(proc)}")
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"soak client failed ({proc.returncode}):\n{_stderr(proc)}")
    return json.loads(lines[-1])


def read_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The next JSON line a running client prints (``select`` bounded, never a bare wait).
    The pipe is unbuffered (``bufsize=0``), so nothing waits in a Python buffer unseen."""
    import select
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"soak client printed nothing for {timeout_s} s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            if not line:
                proc.wait(10)
                raise AssertionError(f"soak client exited ({proc.returncode}):\n{_stderr(proc)}")
            if line.startswith(b"{"):
                return json.loads(line)
