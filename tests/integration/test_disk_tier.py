"""The disk tier over a real kvpoold: blocks the pool drops come back byte-exact from disk,
survive SIGTERM, SIGKILL and a lost pool (a reboot), are never served torn or corrupt, respect
--disk-size, and a full disk or another I/O error turns the tier off while the pool keeps
serving."""

from __future__ import annotations

import os
import random
import resource
import signal
import stat
import subprocess
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
import torch

from kvpool.daemon.disk_store import RECORD_DTYPE
from kvpool.shared.errors import ErrorCode
from tests.conftest import wait_for
from tests.daemon.httptest import fetch, free_port
from bench.kvtest import HostKv, PoolEngine

# 128 KiB blocks: an 8 MiB pool holds about 48 of them, so a few hundred blocks are mostly on disk.
KV = dict(layers=4, blocks=64, heads=8, head_dim=64)
SLOT = 4 * 2 * 16 * 8 * 64 * 2


class Engine(PoolEngine):
    """A ``PoolEngine`` with this file's block size; ``tier()`` is the disk tier."""

    def __init__(self, daemon, stored: dict[bytes, torch.Tensor] | None = None) -> None:
        super().__init__(daemon, stored, **KV)

    def wait_demoted(self, n: int) -> None:
        wait_for(lambda: self.tier().blocks >= n, 60,
                 f"{n} blocks on disk (tier: {self.tier()})")


def disk_daemon(daemon_factory, disk: Path, size: str = "64MiB", pool: str = "8MiB",
                extra: list[str] | None = None):
    return daemon_factory(pool_size=pool, extra=["--disk-path", str(disk), "--disk-size", size,
                                                 *(extra or [])])


def stored_then_rebooted(d, blocks: int, seed: int, while_down=None
                         ) -> tuple[Engine, list[bytes]]:
    """A prompt of ``blocks`` stored and written down, then kill -9 and a lost pool (and
    ``while_down(engine, keys)``, if given, before the restart): the (closed) engine that
    stored it, and its keys; the daemon is running again."""
    e = Engine(d)
    keys = e.store(0, blocks, seed=seed)
    e.wait_demoted(blocks)
    e.close()
    d.kill()
    drop_pool(d)
    if while_down is not None:
        while_down(e, keys)
    d.restart()
    return e, keys


def drop_pool(d) -> None:
    """What a reboot does to the pool: it is gone (the disk stays)."""
    try:
        posix_ipc.unlink_shared_memory("/" + d.pool_name)
    except posix_ipc.ExistentialError:
        pass


def test_blocks_the_pool_drops_come_back_from_disk_byte_exact(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = disk_daemon(daemon_factory, disk)
    e = Engine(d)
    try:
        prompts = []
        for i in range(4):                      # 4 x 40 blocks of 128 KiB: 20 MiB > 8 MiB pool
            prompts.append(e.store(10_000 * i, 40, seed=i))
            e.wait_demoted(40 * (i + 1))
        info = e.sched.info()
        assert info.evictions > 0 and info.tiers[0].missed_blocks == 0
        for keys in prompts:
            assert e.load_and_check(keys) == 40
        t = e.tier()
        assert t.promoted_blocks >= 100 and t.verify_failures == 0 and t.is_enabled
        assert t.promoted_bytes == t.promoted_blocks * SLOT
        assert t.used_bytes == 160 * SLOT and t.capacity_bytes == 64 << 20
        assert stat.S_IMODE(disk.stat().st_mode) == 0o700
        files = [p for p in disk.iterdir()]
        assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
            [(p.name, oct(p.stat().st_mode)) for p in files]
    finally:
        e.close()


def test_a_big_load_whose_head_is_in_the_pool_brings_its_rest_up_from_disk(daemon_factory,
                                                                          tmp_path):
    """A load bigger than a chunk starts copying its head before it finds the rest (the late
    load); where the rest is on disk, it comes up as a load of its own once the head landed:
    every block byte-exact, none failed."""
    d = disk_daemon(daemon_factory, tmp_path / "disk", extra=["--chunk-blocks", "8"])
    e = Engine(d)
    try:
        old = e.store(0, 40, seed=1)
        new = e.store(10_000, 40, seed=2)       # 80 blocks through ~48 slots
        e.wait_demoted(80)
        hit = e.sched.lookup(e.kv.namespace, [new[:8], old[:24]], pin=True)
        assert hit.hits == [8, 24]
        head, rest = list(hit.slots[0]), list(hit.slots[1])
        assert all(head), "the head should be in the pool"
        assert not all(rest), "some of the rest should be on disk only"
        ids, keys = list(range(32, 64)), new[:8] + old[:24]
        e.kv.poison(ids)
        done = e.worker.wait([e.worker.submit_load(e.reg, head + rest, ids, keys)], 30)[0]
        assert done.ok and not done.failed, done
        for b, k in zip(ids, keys):
            assert torch.equal(e.kv.blocks_of([b]), e.stored[k]), f"block {b} differs"
        e.sched.release(hit.leases)
    finally:
        e.close()


def test_sigterm_writes_down_the_pool_and_a_reboot_keeps_the_disk(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = disk_daemon(daemon_factory, disk, pool="16MiB")
    e = Engine(d)
    keys = e.store(0, 40, seed=7)                # no wait: SIGTERM must write them down
    assert d.stop(signal.SIGTERM) == 0
    drop_pool(d)                                 # (the pool is unlinked anyway without keep-pool)
    d.restart()
    e.close()
    e2 = Engine(d, e.stored)
    try:
        assert e2.tier().adopted_blocks == 40
        assert e2.load_and_check(keys) == 40
    finally:
        e2.close()


def test_a_round_trip_lookup_larger_than_the_pool_is_counted_and_loaded_whole(daemon_factory,
                                                                              tmp_path):
    """The round trip (a scheduler that cannot map the index) counts what the disk holds past
    the pool without bringing it up, and the loads' staging windows bring it up in order: a
    prompt of 2.5x the pool comes back whole (it used to be cut where the pool ran out of
    room at lookup time, issue 37)."""
    disk = tmp_path / "disk"
    d = disk_daemon(daemon_factory, disk)           # 8 MiB: about 48 blocks of 128 KiB
    e, keys = stored_then_rebooted(d, 120, seed=5)
    e2 = Engine(d, e.stored)
    try:
        capacity = e2.sched.info().pool_bytes // SLOT
        assert capacity < 60, f"the pool holds {capacity} blocks: not smaller than the prompt"
        hit = e2.sched.lookup(e2.kv.namespace, [keys])
        assert hit.hits == [120] and e2.tier().promoted_blocks == 0, "brought up at lookup"
        assert e2.load_and_check(keys) == 120
        assert e2.tier().promoted_blocks == 120 and e2.tier().verify_failures == 0
    finally:
        e2.close()


def test_kill9_during_demotion_never_serves_a_torn_block(daemon_factory, tmp_path):
    """SIGKILL while blocks are being written, again and again, with the pool dropped each
    time: whatever the next daemon serves is exactly what was stored."""
    disk = tmp_path / "disk"
    d = disk_daemon(daemon_factory, disk, pool="16MiB")
    stored: dict[bytes, torch.Tensor] = {}
    prompts: list[list[bytes]] = []
    rng = random.Random(12)
    served = 0
    for round_ in range(5):
        e = Engine(d, stored)
        try:
            for keys in prompts:                 # everything served so far is exact
                served += e.load_and_check(keys)
            prompts.append(e.store(100_000 * (round_ + 1), 48, seed=round_))
            # Demotion starts as the stores commit; kill somewhere inside it.
            wait_for(lambda: e.tier().demoted_blocks + rng.random() * 8 >= 8, 20,
                     "demotion to start")
        finally:
            e.close()
        d.kill()
        drop_pool(d)
        d.restart()
    e = Engine(d, stored)
    try:
        for keys in prompts:
            served += e.load_and_check(keys)
        assert e.tier().verify_failures == 0
    finally:
        e.close()
    assert served > 0, "no block survived any kill: the test proved nothing"


def _record_of(disk: Path, key: bytes) -> int:
    rec = np.fromfile(disk / f"blocks-{SLOT}.idx", RECORD_DTYPE)
    idx = [i for i, r in enumerate(rec) if bytes(r["key"]) == key and r["magic"]]
    assert len(idx) == 1, f"key found {len(idx)} times in the records"
    return idx[0]


def test_a_corrupted_block_is_a_counted_miss_never_loaded(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = disk_daemon(daemon_factory, disk)

    def corrupt_block_3(e, keys):
        bad = _record_of(disk, e.kv.namespace + keys[3])
        with open(disk / f"blocks-{SLOT}.dat", "r+b") as f:     # one flipped byte mid-block
            f.seek(bad * SLOT + SLOT // 2)
            byte = f.read(1)
            f.seek(bad * SLOT + SLOT // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    e, keys = stored_then_rebooted(d, 8, seed=3, while_down=corrupt_block_3)
    e2 = Engine(d, e.stored)
    try:
        hit = e2.sched.lookup(e2.kv.namespace, [keys], pin=True)
        assert hit.hits == [8]                  # the tier's index still lists it
        e2.kv.poison(list(range(40, 48)))
        done = e2.worker.wait([e2.worker.submit_load(e2.reg, hit.slots[0], list(range(40, 48)),
                                                     keys)], 30)[0]
        # The load is done but for that block, which it names (its engine recomputes it);
        # whether the fill failed before the load came or while it waited.
        assert done.ok and done.failed == (3,), done
        assert torch.isnan(e2.kv.blocks_of([43]).float()).all(), "a corrupt block was loaded"
        for b, k in zip(range(40, 48), keys):
            if b != 43:
                assert torch.equal(e2.kv.blocks_of([b]), e2.stored[k]), "a good block was lost"
        e2.sched.release(hit.leases)
        assert e2.tier().verify_failures == 1
        assert e2.sched.lookup(e2.kv.namespace, [keys]).hits == [3], "the bad block still hits"
        d.logged("failed checksum verification")
    finally:
        e2.close()
    # Its record was zeroed, not just dropped from memory: the next daemon does not adopt it.
    assert d.stop() == 0
    drop_pool(d)
    d.restart()
    e3 = Engine(d, e.stored)
    try:
        assert e3.tier().adopted_blocks == 7 and e3.tier().verify_failures == 0
        assert e3.load_and_check(keys) == 3
    finally:
        e3.close()


def test_disk_size_is_respected_with_its_own_lru(daemon_factory, tmp_path):
    disk = tmp_path / "disk"
    d = disk_daemon(daemon_factory, disk, size="2MiB")       # 16 blocks
    e = Engine(d)
    try:
        old = e.store(0, 24, seed=1)
        wait_for(lambda: e.tier().demoted_blocks >= 24, 30, "24 demotions")
        new = e.store(50_000, 16, seed=2)
        wait_for(lambda: e.tier().demoted_blocks >= 40, 30, "40 demotions")
        t = e.tier()
        assert t.used_bytes <= 2 << 20 and t.blocks == 16 and t.evicted_blocks == 24
        used = sum(p.stat().st_blocks * 512 for p in disk.glob("blocks-*.dat"))
        assert used <= (2 << 20) + SLOT, f"{used} bytes on disk for a 2 MiB tier"
    finally:
        e.close()
    d.kill()                                     # the pool still holds all 40: drop it
    drop_pool(d)
    d.restart()
    e2 = Engine(d, e.stored)
    try:
        assert e2.tier().adopted_blocks == 16
        assert e2.sched.lookup(e2.kv.namespace, [old]).hits == [0]
        assert e2.load_and_check(new) == 16
    finally:
        e2.close()


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs: a disk that fills up. Needs mount(2) (root or CAP_SYS_ADMIN)."""
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root or CAP_SYS_ADMIN): "
                    f"{r.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_turns_the_tier_off_and_the_pool_keeps_serving(daemon_factory, small_fs):
    d = disk_daemon(daemon_factory, small_fs / "kv", size="64MiB", pool="16MiB")
    e = Engine(d)
    try:
        keys = e.store(0, 16, seed=5)             # 2 MiB of blocks for 1 MiB of disk
        wait_for(lambda: not e.tier().is_enabled, 30, "the tier to turn itself off")
        t = e.tier()
        assert t.io_errors >= 1 and "No space left" in t.status, t
        assert d.logged("DISK TIER OFF").count("DISK TIER OFF") == 1
        # The pool still serves: what it holds loads, new stores land.
        assert e.load_and_check(keys) == 16
        more = e.store(30_000, 8, seed=6)
        assert e.load_and_check(more) == 8
        assert e.tier().promoted_blocks == 0      # nothing came from the dead tier
    finally:
        e.close()


def _metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[1])
    return None


def test_an_io_error_turns_the_tier_off_loudly_and_the_pool_keeps_serving(daemon_factory,
                                                                         tmp_path):
    """Not a full disk: EFBIG, from a file-size limit put on the running daemon (prlimit needs
    no privilege on one's own child, and binds root too), so the fault hits mid-stream, after
    blocks landed. The blocks written before it come back after a restart."""
    disk = tmp_path / "disk"
    port = free_port()
    d = disk_daemon(daemon_factory, disk, pool="16MiB",
                    extra=["--log-level", "info", "--metrics-port", str(port)])
    e = Engine(d)
    try:
        before = e.store(0, 16, seed=5)
        e.wait_demoted(16)
        limit = (disk / f"blocks-{SLOT}.dat").stat().st_size      # the next block is past it
        assert d.log_path.stat().st_size < limit // 2, "the limit would also cut the log"
        _, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
        after = e.store(20_000, 8, seed=6)
        wait_for(lambda: not e.tier().is_enabled, 30, f"the tier to turn off:\n{d.log()}")
        t = e.tier()
        assert t.io_errors >= 1 and "File too large" in t.status, t
        log = d.logged("DISK TIER OFF")
        assert log.count("DISK TIER OFF") == 1, log
        assert "File too large" in log.split("DISK TIER OFF", 1)[1].splitlines()[0]

        def scraped():
            text = fetch(f"http://127.0.0.1:{port}/metrics")[1]
            return (_metric(text, 'kvpool_tier_enabled{tier="disk"}') == 0
                    and (_metric(text, 'kvpool_tier_io_errors_total{tier="disk"}') or 0) >= 1)
        wait_for(scraped, 30, "/metrics to show the disk tier off with its I/O error")
        # The pool still serves: what it holds loads, new stores land, nothing comes from disk.
        assert e.load_and_check(before) == 16 and e.load_and_check(after) == 8
        more = e.store(40_000, 8, seed=7)
        assert e.load_and_check(more) == 8
        assert e.tier().promoted_blocks == 0 and e.tier().blocks == 16
    finally:
        e.close()
    assert d.stop() == 0
    drop_pool(d)
    d.restart()                                  # a new process: no file-size limit
    e2 = Engine(d, e.stored)
    try:
        assert e2.tier().is_enabled and e2.tier().adopted_blocks == 16
        assert e2.load_and_check(before) == 16
        assert e2.sched.lookup(e2.kv.namespace, [after]).hits == [0]
    finally:
        e2.close()


def test_disk_settings_are_checked_and_one_daemon_owns_a_directory(daemon_factory, tmp_path):
    from tests.integration.test_cli import kvpool, kvpoold, shm_exists
    r = kvpoold("--disk-size", "lots", "--check-config")
    assert r.returncode == 2 and "disk_size" in r.stderr
    r = kvpoold("--check-config", env={"KVPOOL_DISK_PATH": "/x", "KVPOOL_DISK_SIZE": "1TiB"})
    assert r.returncode == 0 and '"disk_path": "/x"' in r.stdout and '"1TiB"' in r.stdout

    base = ["--pool-size", "16MiB", "--extent-size", "1MiB", "--cuda", "off", "--metrics-port",
            "0", "--socket", str(tmp_path / "x.sock"), "--pool-name", f"kvpool-t-{os.getpid()}"]
    other = tmp_path / "not-ours"
    other.mkdir()
    os.chown(other, 12345, 12345)
    r = kvpoold(*base, "--disk-path", str(other))
    assert r.returncode == 3 and "belongs to uid 12345" in r.stderr, r.stderr
    assert not shm_exists(f"kvpool-t-{os.getpid()}")

    d = disk_daemon(daemon_factory, tmp_path / "disk")
    r = kvpoold(*base, "--disk-path", str(tmp_path / "disk"))
    assert r.returncode == 3 and "used by another running kvpoold" in r.stderr, r.stderr
    out = kvpool("info", "--socket", d.socket)
    assert out.returncode == 0 and f"disk tier  {tmp_path / 'disk'}   on" in out.stdout, out.stdout
    import json
    tiers = json.loads(kvpool("info", "--socket", d.socket, "--json").stdout)["tiers"]
    assert tiers[0]["name"] == "disk" and tiers[0]["capacity_bytes"] == 64 << 20


def test_a_reset_forgets_the_namespace_on_disk_too_across_a_restart(daemon_factory, tmp_path):
    d = disk_daemon(daemon_factory, tmp_path / "disk")
    e = Engine(d)
    try:
        keys = e.store(0, 8, seed=9)
        e.wait_demoted(8)
        assert e.sched.reset(e.kv.namespace) >= 8
        assert e.sched.lookup(e.kv.namespace, [keys]).hits == [0]
        wait_for(lambda: e.tier().used_bytes == 0, 10, "the tier to free the blocks")
    finally:
        e.close()
    assert d.stop() == 0                     # records zeroed before the files close
    d.restart()
    e = Engine(d)
    try:
        assert e.tier().adopted_blocks == 0
        assert e.sched.lookup(e.kv.namespace, [keys]).hits == [0]
    finally:
        e.close()
