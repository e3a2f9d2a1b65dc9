"""daemon/top.py: screens from successive PoolInfo snapshots."""

from __future__ import annotations

import io

from kvpool.daemon.top import render, run_top
from kvpool.shared.errors import DaemonUnavailable
from kvpool.shared.protocol import ClientInfo, PoolInfo, Role


def snap(daemon_id="d1", uptime_s=10.0, used=1 << 30, hits=0, misses=0, stored=0, loaded=0,
         evictions=0) -> PoolInfo:
    clients = [ClientInfo(1, Role.SCHEDULER, "sched", 100, "engA", 0, 0, 0),
               ClientInfo(2, Role.WORKER, "tp0", 101, "engA", 1, 0, 2)]
    return PoolInfo(daemon_id, uptime_s, 4 << 30, used, (4 << 30) - used, 3, 500, 1, hits, misses,
                    evictions, 2, 0, 0, stored, loaded, 0, clients, slots_pinned=7)


def test_rates_hit_rate_and_occupancy():
    a = snap(hits=100, misses=100, stored=0, loaded=0)
    b = snap(uptime_s=12.0, hits=190, misses=110, stored=20 * 10**9, loaded=50 * 10**9,
             evictions=40)
    screen = render(b, a)
    assert "25.0%" in screen                      # 1 GiB of 4 GiB
    assert "90.0%" in screen                      # 90 hits, 10 misses in this interval
    assert "63.3%" in screen                      # 190 / 300 since start
    assert "10.00 GB/s" in screen and "25.00 GB/s" in screen   # over the daemon's 2 s
    assert "20/s" in screen                       # evictions
    assert "pinned 7" in screen and "engines 1" in screen and "workers 1" in screen


def test_restart_resets_the_baseline():
    screen = render(snap(daemon_id="d2", uptime_s=1.0), snap(uptime_s=100.0, stored=10**12))
    assert "rates from the next refresh" in screen and "GB/s" not in screen


def test_run_top_survives_an_unreachable_daemon():
    answers = iter([snap(), DaemonUnavailable("no daemon at /x.sock"),
                    snap(uptime_s=11.0, stored=10**9)])

    def get_info():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    out = io.StringIO()
    sleeps = []
    assert run_top(get_info, 1.0, out, iterations=3, sleep=sleeps.append) == 0
    text = out.getvalue()
    assert "unreachable: no daemon at /x.sock" in text
    assert sleeps == [1.0, 1.0]
    assert "\x1b[2J" not in text                  # not a terminal: frames, no screen clearing
    assert text.count("kvpoold d1") == 2


def test_tier_occupancy_and_rates_each_way():
    from kvpool.shared.protocol import TierInfo

    def tier(demoted, promoted, enabled=True):
        return TierInfo("disk", enabled, "/nvme/kv", 100 << 30, 25 << 30, 1000, 10, 5,
                        demoted, 7, promoted, 2, 0, 3, 4, 0, "ok" if enabled else "off: full")
    a, b = snap(), snap(uptime_s=12.0)
    a.tiers, b.tiers = [tier(0, 0)], [tier(8 * 10**9, 4 * 10**9)]
    screen = render(b, a)
    assert "disk" in screen and "25.0%" in screen and "1,000 blocks" in screen
    assert "down (demote)   4.00 GB/s" in screen and "up (promote)   2.00 GB/s" in screen
    assert "verify failures 2" in screen and "missed 4" in screen
    b.tiers = [tier(0, 0, enabled=False)]
    assert "OFF: off: full" in render(b, None)
