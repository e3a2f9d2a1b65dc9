"""Engine KV memory in /dev/shm: reserved up front, locked while alive, gone after the process."""

import os
import signal
import subprocess
import sys

import pytest

from kvpool.client.host_memory import SharedHostMemory, ShmSpaceError, shm_free_bytes
from kvpool.client.vllm.alloc import ShmKvAllocation
from kvpool.client.vllm.memory import host_regions
from kvpool.daemon.shm_reaper import reap_engine_segments
from kvpool.shared.protocol import ENGINE_SHM_PREFIX
from tests.conftest import wait_for

import torch

HOLDER = """
import sys, time
from kvpool.client.host_memory import SharedHostMemory
m = SharedHostMemory(1 << 20)
m.tensor[:4] = 7
print(m.name, flush=True)
time.sleep(600)
"""


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_memory_is_named_locked_and_unlinked_on_close():
    m = SharedHostMemory(1 << 20)
    assert m.name.startswith(ENGINE_SHM_PREFIX) and _exists(m.name)
    assert os.stat(f"/dev/shm/{m.name}").st_mode & 0o777 == 0o600
    assert m.name not in reap_engine_segments(), "a live process's segment was reaped"
    assert _exists(m.name)
    m.close()
    assert not _exists(m.name)


def test_too_big_for_dev_shm_says_how_big_it_must_be():
    before = {n for n in os.listdir("/dev/shm") if n.startswith(ENGINE_SHM_PREFIX)}
    want = shm_free_bytes() + (8 << 30)
    with pytest.raises(ShmSpaceError) as e:
        SharedHostMemory(want)
    msg = str(e.value)
    assert "/dev/shm" in msg and "GiB" in msg and "--shm-size" in msg
    left = {n for n in os.listdir("/dev/shm") if n.startswith(f"{ENGINE_SHM_PREFIX}{os.getpid()}-")}
    assert not left - before, "a refused allocation left its segment behind"


def test_killed_process_segment_is_reaped_and_live_ones_are_not():
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        names = [p.stdout.readline().strip() for p in procs]
        assert all(_exists(n) for n in names), names
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        assert _exists(names[0]), "a SIGKILLed process cannot unlink its segment itself"
        reaped = reap_engine_segments()
        assert names[0] in reaped and not _exists(names[0])
        assert names[1] not in reaped and _exists(names[1]), "the live holder lost its segment"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            p.stdout.close()
    reap_engine_segments()
    assert not any(_exists(n) for n in names)


def test_reaper_leaves_other_names_links_and_fresh_empty_segments(tmp_path):
    other = "kvpool-test-not-an-engine-segment"
    empty = f"{ENGINE_SHM_PREFIX}test-empty-{os.getpid()}"
    link = f"{ENGINE_SHM_PREFIX}test-link-{os.getpid()}"
    target = tmp_path / "victim"
    target.write_text("keep me")
    try:
        open(f"/dev/shm/{other}", "w").close()
        open(f"/dev/shm/{empty}", "w").close()
        os.symlink(target, f"/dev/shm/{link}")
        reaped = reap_engine_segments()
        assert other not in reaped and _exists(other)
        assert empty not in reaped and _exists(empty), "a segment being created was reaped"
        assert link not in reaped and os.path.islink(f"/dev/shm/{link}")
        assert target.read_text() == "keep me"
        # An old unsized one is an abandoned creation.
        assert empty in reap_engine_segments(now=os.stat(f"/dev/shm/{empty}").st_mtime + 3600)
    finally:
        for n in (other, empty, link):
            if os.path.lexists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_allocation_context_places_kv_sized_cpu_tensors_in_shm():
    alloc = ShmKvAllocation([3 << 20])
    with alloc:
        kv = torch.zeros(3 << 20, dtype=torch.int8, device="cpu")
        other = torch.zeros(3 << 20, dtype=torch.int8)   # the size was taken once already
        small = torch.empty(16)
    assert len(alloc.memories) == 1 and alloc.failure is None
    assert kv.shape == (3 << 20,) and kv.dtype == torch.int8 and not kv.any()
    regions, _ = host_regions([kv])
    assert regions[0].shm_name == alloc.memories[0].name
    with pytest.raises(ValueError, match="not in POSIX shared memory"):
        host_regions([other])
    with pytest.raises(ValueError):
        host_regions([small])
    kv[5] = 9                      # the engine writes its KV straight into the segment
    assert alloc.memories[0].tensor[5] == 9
    alloc.memories[0].close()


FALLBACK = """
import torch
from kvpool.client.vllm.alloc import ShmKvAllocation
alloc = ShmKvAllocation([96 << 20])
with alloc:
    kv = torch.zeros(96 << 20, dtype=torch.int8)
kv[-1] = 1                               # the engine's (private) memory is there and usable
assert alloc.memories == [], alloc.memories
print(alloc.failure)
"""


def small_shm_command(size: str, argv: list[str]) -> list[str]:
    """``argv`` in a private mount namespace whose /dev/shm is a ``size`` tmpfs (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("a small /dev/shm needs a private mount namespace: run as root")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()}")
    quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)
    return ["unshare", "-m", "sh", "-c",
            f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {quoted}"]


def test_allocation_context_falls_back_to_private_memory_with_one_reason():
    out = subprocess.run(small_shm_command("64m", [sys.executable, "-c", FALLBACK]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason = out.stdout.strip()
    assert "needs 0.09 GiB of /dev/shm but only 0.06 GiB is free" in reason, reason
    assert "--shm-size" in reason
