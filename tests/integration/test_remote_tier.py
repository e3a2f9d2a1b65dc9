"""The remote tier over real processes: one ``mooncake_master`` on loopback and two kvpoold
"hosts" with their own pools and sockets. Blocks stored through one load byte-exact through the
other; the tiers are asked in order (pool, disk, remote); a master killed, stopped (slow) or
absent at start leaves each daemon serving alone, without waiting, until it answers again;
a bad URL stops the start with a clear message; a corrupted value is a miss; SIGTERM stops a
daemon within 2 s whatever the master's state."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from kvpool.daemon.mooncake_store import remote_key
from kvpool.shared.errors import ErrorCode
from tests.conftest import stop_process, wait_for
from bench.kvtest import PoolEngine
from bench.mooncake import MooncakeMaster, corrupt_value, require_mooncake

# 128 KiB blocks: an 8 MiB pool holds about 48 of them.
KV = dict(layers=4, blocks=64, heads=8, head_dim=64)


def host(daemon_factory, master: MooncakeMaster, pool: str = "16MiB",
         extra: list[str] | None = None):
    """One kvpoold "host" of the fleet (its own pool, socket and Mooncake segment)."""
    return daemon_factory(pool_size=pool, extra=[
        "--remote-store", master.url, "--remote-segment-size", "32MiB", *(extra or [])])


def engine(d, stored=None) -> PoolEngine:
    e = PoolEngine(d, stored, **KV)
    wait_for(lambda: e.tier("remote").is_enabled, 60,
             f"the remote tier to connect:\n{d.log()[-3000:]}")
    return e


def two_hosts(daemon_factory, master: MooncakeMaster):
    """Two hosts and an engine on each, sharing what was stored (to check loads against)."""
    a, b = host(daemon_factory, master), host(daemon_factory, master)
    ea = engine(a)
    return a, b, ea, engine(b, ea.stored)


def wait_published(e: PoolEngine, n: int) -> None:
    wait_for(lambda: e.tier("remote").demoted_blocks >= n, 30,
             f"{n} blocks published (tier: {e.tier('remote')})")


def wait_unpinned(e: PoolEngine) -> None:
    wait_for(lambda: e.sched.info().slots_pinned == 0, 30,
             lambda: f"no pool block pinned (tiers: {e.sched.info().tiers})")


def test_blocks_stored_on_one_host_load_byte_exact_on_another(daemon_factory, mooncake_master):
    a, b = host(daemon_factory, mooncake_master), host(daemon_factory, mooncake_master)
    ea, eb = engine(a), None
    try:
        prompt = ea.store(0, 40, seed=1)
        wait_published(ea, 40)
        eb = engine(b, ea.stored)
        assert eb.sched.info().slots_committed == 0           # nothing of it on host b
        assert eb.load_and_check(prompt) == 40                # fetched, verified, loaded
        t = eb.tier("remote")
        assert t.hit_blocks == 40 and t.promoted_blocks == 40 and t.verify_failures == 0
        assert t.promoted_bytes == 40 * 128 * 1024 and t.lost_blocks == 0
        # Now in b's pool: a second load is a pool hit, nothing more comes over the network.
        assert eb.load_and_check(prompt) == 40 and eb.tier("remote").promoted_blocks == 40
        # A prompt nobody stored misses everywhere, and its lookup still answers.
        assert eb.sched.lookup(eb.kv.namespace, [eb.kv.keys(list(range(9000, 9320)))]
                               ).hits == [0]
    finally:
        ea.close()
        if eb is not None:
            eb.close()


def test_pool_then_disk_then_remote(daemon_factory, mooncake_master, tmp_path):
    """A block the pool dropped comes from the local disk, not the store; one this host never
    had comes from the store (and then goes down to the disk too)."""
    a = host(daemon_factory, mooncake_master)
    b = host(daemon_factory, mooncake_master, pool="8MiB",
             extra=["--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB"])
    ea = engine(a)
    eb = engine(b, ea.stored)
    try:
        theirs = ea.store(0, 16, seed=1)
        mine = []
        for i in range(2):                          # 10 MiB through an 8 MiB pool
            mine.append(eb.store(100_000 * (i + 1), 40, seed=2 + i))
            wait_for(lambda: eb.tier("disk").blocks >= 40 * (i + 1), 60,
                     f"b's blocks on its disk ({eb.tier('disk')})")
        wait_published(ea, 16)
        assert eb.sched.info().evictions > 0
        for keys in mine:
            # b publishes to the store too, and a block being published is pinned: with most
            # of an 8 MiB pool held that way, a 40-block load finds no room for its last
            # blocks (its run stops there, as it should). Let that finish first.
            wait_unpinned(eb)
            assert eb.load_and_check(keys) == 40
        assert eb.tier("disk").hit_blocks > 0 and eb.tier("remote").hit_blocks == 0
        wait_unpinned(eb)
        assert eb.load_and_check(theirs) == 16
        assert eb.tier("remote").promoted_blocks == 16
        wait_for(lambda: eb.tier("disk").blocks >= 96, 30, "the fetched blocks on b's disk")
    finally:
        ea.close()
        eb.close()


def test_master_killed_then_restarted_mid_run(daemon_factory, mooncake_master):
    m = mooncake_master
    a, b, ea, eb = two_hosts(daemon_factory, m)
    try:
        before = ea.store(0, 8, seed=1)
        wait_published(ea, 8)
        m.kill()
        # Each host keeps serving its own pool, and no lookup waits on the dead master.
        wait_for(lambda: not ea.tier("remote").is_enabled and not eb.tier("remote").is_enabled,
                 30, "both daemons to notice the master is gone")
        assert ea.load_and_check(before) == 8
        during = ea.store(1000, 8, seed=2)
        t0 = time.monotonic()
        assert eb.sched.lookup(eb.kv.namespace, [during]).hits == [0]
        assert time.monotonic() - t0 < 1.0
        assert ea.tier("remote").demoted_blocks == 8          # nothing published meanwhile
        for d in (a, b):
            log = d.logged("REMOTE TIER OFF")
            assert log.count("REMOTE TIER OFF") == 1, log[-3000:]
        m.start()        # a new master: it lost every object, so the pool is published again
        wait_for(lambda: ea.tier("remote").is_enabled and eb.tier("remote").is_enabled, 60,
                 "both daemons to use the restarted master")
        after = ea.store(2000, 8, seed=3)
        wait_published(ea, 8 + 24)
        for prompt in (before, during, after):
            assert eb.load_and_check(prompt) == 8
        a.logged("REMOTE TIER BACK")
        b.logged("REMOTE TIER BACK")
        assert ea.tier("remote").io_errors >= 1
    finally:
        ea.close()
        eb.close()


def test_slow_master_turns_the_tier_off_without_holding_lookups(daemon_factory,
                                                                mooncake_master):
    """A master that stops answering (SIGSTOP: connections stay open, nothing comes back):
    the first lookup that asks it waits remote_timeout_ms at most, later ones not at all."""
    m = mooncake_master
    # A timeout long enough that "waited for it" and "did not" stay apart on a loaded machine.
    timeout_s = 2.0
    a = host(daemon_factory, m, extra=["--remote-timeout-ms", str(int(timeout_s * 1000))])
    ea = engine(a)
    try:
        stop_process(m.proc.pid)
        try:
            t0 = time.monotonic()
            hits = ea.sched.lookup(ea.kv.namespace, [ea.kv.keys(list(range(320)))]).hits
            first = time.monotonic() - t0
            assert hits == [0] and first < timeout_s + 3, first
            wait_for(lambda: not ea.tier("remote").is_enabled, 30,
                     lambda: f"the tier to turn off ({ea.tier('remote')}):\n{a.log()[-3000:]}")
            t0 = time.monotonic()
            ea.sched.lookup(ea.kv.namespace, [ea.kv.keys(list(range(1000, 1320)))])
            later = time.monotonic() - t0
            assert later < timeout_s / 2, f"a lookup with the tier off took {later:.3f} s"
            a.logged("REMOTE TIER OFF")
            prompt = ea.store(0, 8, seed=1)                  # the pool serves as ever
            assert ea.load_and_check(prompt) == 8
        finally:
            m.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: ea.tier("remote").is_enabled, 60, "the tier back after SIGCONT")
        wait_published(ea, 8)
    finally:
        ea.close()


def test_master_down_at_start_is_an_outage_not_a_failed_start(daemon_factory, tmp_path):
    m = MooncakeMaster(tmp_path)            # not started yet
    try:
        a = host(daemon_factory, m)
        ea = PoolEngine(a, **KV)
        try:
            prompt = ea.store(0, 8, seed=1)
            assert ea.load_and_check(prompt) == 8
            wait_for(lambda: "REMOTE TIER OFF" in a.log(), 60, "the outage logged")
            assert not ea.tier("remote").is_enabled
            m.start()
            wait_for(lambda: ea.tier("remote").is_enabled, 60, "the tier to connect")
            wait_published(ea, 8)           # what the pool held meanwhile goes out
        finally:
            ea.close()
    finally:
        m.cleanup()


@pytest.mark.parametrize("url, says", [
    ("redis://127.0.0.1:50051", "the scheme must be mooncake://"),
    ("mooncake://127.0.0.1", "no master RPC port"),
    ("mooncake://127.0.0.1:50051?protocol=udp", "protocol must be one of tcp, rdma"),
    ("mooncake://127.0.0.1:50051?device=mlx5_0", "needs protocol=rdma"),
    ("mooncake://127.0.0.1:50051?metadata=ftp://x/y", "metadata must be an http:// URL"),
    ("mooncake://127.0.0.1:50051?master=1", "unknown query key(s) ['master']"),
])
def test_bad_url_is_a_clear_startup_error(tmp_path, url, says):
    r = subprocess.run([sys.executable, "-m", "kvpool.daemon", "--socket",
                        str(tmp_path / "s.sock"), "--pool-size", "8MiB", "--extent-size", "1MiB",
                        "--remote-store", url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "remote_store" in r.stderr, r.stderr


def test_unresolvable_master_is_a_clear_startup_error(daemon_factory):
    require_mooncake()
    d = daemon_factory(extra=["--remote-store", "mooncake://no-such-master.invalid:50051"],
                       start=False)
    r = subprocess.run(d.args(), capture_output=True, text=True, timeout=60)
    # A setting checked before anything is taken (startup.check_config): exit 2, one line.
    assert r.returncode == 2 and "does not resolve" in r.stderr, r.stderr[-2000:]


def test_corrupted_value_is_a_miss_never_loaded(daemon_factory, mooncake_master):
    a, b, ea, eb = two_hosts(daemon_factory, mooncake_master)
    try:
        prompt = ea.store(0, 8, seed=1)
        wait_published(ea, 8)
        corrupt_value(mooncake_master, remote_key(ea.kv.namespace + prompt[5]))
        hits, failed = eb.load(prompt)
        # Counted as a hit, then caught on arrival: that block fails alone, its engine
        # recomputes it.
        assert hits == 8 and failed is not None
        assert failed.ok and failed.failed == (5,), failed
        t = eb.tier("remote")
        assert t.verify_failures == 1 and t.promoted_blocks == 7, t
        b.logged("failed verification")
        # Removed from the store: the next lookup on any host stops before it.
        assert eb.sched.lookup(eb.kv.namespace, [prompt]).hits == [5]
        assert eb.load_and_check(prompt[:5]) == 5
    finally:
        ea.close()
        eb.close()


@pytest.mark.parametrize("noticed", [False, True], ids=["tier-still-up", "tier-off"])
def test_sigterm_stops_the_daemon_within_2s_after_the_master_died(daemon_factory,
                                                                   mooncake_master, noticed):
    """Whatever the tier's state when the master died (its calls hanging in Mooncake's
    retries, or the outage already seen), a stop must not wait on the master."""
    a = host(daemon_factory, mooncake_master)
    ea = engine(a)
    try:
        ea.store(0, 8, seed=1)
        wait_published(ea, 8)
        mooncake_master.kill()
        if noticed:
            wait_for(lambda: not ea.tier("remote").is_enabled, 30, "the tier to turn off")
    finally:
        ea.close()
    t0 = time.monotonic()
    code = a.stop(timeout_s=30)
    took = time.monotonic() - t0
    assert code == 0, a.log()[-3000:]
    assert took < 2.0, f"SIGTERM took {took:.1f} s:\n{a.log()[-3000:]}"
