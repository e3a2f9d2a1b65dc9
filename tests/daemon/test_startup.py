"""The daemon's start path stays light: what a restart pays before it answers."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest


def test_the_start_path_imports_no_torch():
    """torch is 0.8-1.3 s of a ~1.5 s start on a 2-core host; the host copy engine imports
    it on a thread once the daemon serves (``HostCopyEngine.start``)."""
    code = ("import sys\n"
            "from kvpool.daemon import cli, startup, server, disk_tier, tiering\n"
            "heavy = sorted(m for m in ('torch', 'triton', 'mooncake') if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"imported on the daemon's start path: {r.stdout.strip()}"


def test_cuda_auto_on_a_host_without_cuda_imports_no_torch(pool_config):
    """``cuda = "auto"`` (the default) asks the driver before torch: a CPU host starts light."""
    from kvpool.daemon import cuda
    if cuda.is_available():
        pytest.skip("this host has CUDA: torch is imported for the CUDA copy engines")
    code = ("import sys, msgspec\n"
            "from kvpool.daemon.pool import Pool\n"
            "from kvpool.daemon.startup import build_engines\n"
            "from kvpool.shared.config import DaemonConfig\n"
            "cfg = msgspec.json.decode(sys.argv[1], type=DaemonConfig)\n"
            "pool = Pool.open(cfg)\n"
            "engines = build_engines(cfg, pool)\n"
            "print(len(engines), 'torch' in sys.modules)\n"
            "pool.close(unlink=True)\n")
    cfg = msgspec.structs.replace(pool_config, cuda="auto")
    r = subprocess.run([sys.executable, "-c", code, msgspec.json.encode(cfg).decode()],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "False"], r.stdout


def test_a_stop_signal_raised_inside_a_log_write_is_not_swallowed():
    """A stop signal raises where the main thread is: inside a log handler's write (the start
    logs its NUMA placement while it reserves the pool), logging's ``except Exception`` took
    it and the start served on, deaf to it (seen in test_cli's stop-during-the-start test)."""
    import io
    import logging
    import signal

    from kvpool.daemon.startup import _stop_requested, _StopRequested

    class SignalledStream(io.StringIO):
        def write(self, text: str) -> int:
            _stop_requested(signal.SIGTERM, None)
            return 0

    log = logging.getLogger("kvpool-test-stop-in-log")
    log.propagate = False
    handler = logging.StreamHandler(SignalledStream())
    log.addHandler(handler)
    try:
        with pytest.raises(_StopRequested, match="SIGTERM"):
            log.warning("numa placement: ...")
    finally:
        log.removeHandler(handler)
