"""The daemon's start path stays light: what a restart pays before it answers."""

from __future__ import annotations

import subprocess
import sys


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
