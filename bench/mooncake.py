"""Shared by tests and benchmarks: a real ``mooncake_master`` process on loopback (the one the kvpool[mooncake]
extra installs), on free ports, that tests can kill and restart on the same ports."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak.common import LoggedProcess, wait_for


def master_binary() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    return path if path.exists() else None


def require_mooncake() -> Path:
    path = master_binary()
    if path is None:
        pytest.skip("Mooncake Store is not installed (pip install 'kvpool[mooncake]')")
    return path


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports. They are held together while chosen: one at a time,
    the kernel may hand out a port just released again, and a master given the same port
    twice exits after its first listener answered (its RPC port taken by its own metrics
    server: a test then saw "connection refused" for 60 s)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` listens on (Linux /proc): a port that answers may be someone
    else's."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:                     # closed while listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:          # state LISTEN, owned by pid
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


class MooncakeMaster(LoggedProcess):
    """``mooncake_master`` with its HTTP metadata server; ``url`` is kvpoold's --remote-store."""

    def __init__(self, tmp: Path) -> None:
        self.binary = require_mooncake()
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.log_path = tmp / "mooncake_master.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}"
                f"?metadata=http://127.0.0.1:{self.http_port}/metadata")

    def start(self) -> "MooncakeMaster":
        ports = {self.rpc_port, self.http_port, self.metrics_port}
        if len(ports) != 3:
            raise ValueError(f"the master's RPC, HTTP and metrics ports must be distinct: "
                             f"{self.rpc_port}, {self.http_port}, {self.metrics_port}")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "--enable_http_metadata_server=true",
             f"--http_metadata_server_port={self.http_port}",
             "--http_metadata_server_host=127.0.0.1", f"--rpc_port={self.rpc_port}",
             "--rpc_address=127.0.0.1", f"--metrics_port={self.metrics_port}",
             "--metrics_host=127.0.0.1"], stdout=log, stderr=log)
        log.close()
        wait_for(lambda: self.proc.poll() is not None or ports <= self._listening(), 30,
                 lambda: f"mooncake_master to listen on {sorted(ports)}:\n{self.log()[-3000:]}")
        if self.proc.poll() is not None:
            raise AssertionError(f"mooncake_master exited with {self.proc.returncode}:\n"
                                 f"{self.log()[-3000:]}")
        return self

    def _listening(self) -> set[int]:
        try:
            return listening_ports(self.proc.pid)
        except OSError:                     # exited while read: the caller's poll says so
            return set()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        wait_for(lambda: not _accepts(self.rpc_port), 10, "the master's port to close")

    def cleanup(self) -> None:
        self.kill_if_running()


_CORRUPT = r"""
import sys
from mooncake.store import MooncakeDistributedStore
master, metadata, key = sys.argv[1:4]
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", master) == 0, "setup"
value = bytearray(s.get(key))
assert value, f"{key} is not in the store"
value[len(value) // 3] ^= 0xFF                     # one flipped byte inside the block
assert s.remove(key, True) == 0, "remove"
assert s.put(key, bytes(value)) == 0, "put"
s.close()
print("corrupted", len(value))
"""


def corrupt_value(master: MooncakeMaster, key: str) -> None:
    """Flip one byte of the block inside the stored value ``key`` (its trailer untouched),
    from a separate Mooncake client process."""
    r = subprocess.run([sys.executable, "-c", _CORRUPT, f"127.0.0.1:{master.rpc_port}",
                        f"http://127.0.0.1:{master.http_port}/metadata", key],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GLOG_minloglevel": "2"})
    assert r.returncode == 0 and "corrupted" in r.stdout, r.stdout + r.stderr[-2000:]
