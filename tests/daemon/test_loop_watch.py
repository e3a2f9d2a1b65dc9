"""The event loop's gap watch: gaps measured between ticks, run-queue waits taken out, a long
gap logged once per period, and ticks that keep coming on a real loop."""

import asyncio
import logging
import time

from kvpool.daemon.loop_watch import LoopWatch, ThreadTimes, thread_times_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.delay = 0.0

    def __call__(self) -> float:
        return self.now


def test_gaps_are_the_time_between_ticks_less_the_wait_for_a_cpu(caplog):
    c = Clock()
    w = LoopWatch(tick_s=0.01, warn_s=0.1, warn_every_s=10, clock=c,
                  thread_times=lambda: (0.0, c.delay))
    w._last, w._last_times = c.now, (0.0, c.delay)   # what start() records
    c.now += 0.011
    w.tick()
    assert abs(w.max_gap_s - 0.011) < 1e-9
    # 300 ms of wall time of which 250 ms waiting for a CPU: 50 ms were the daemon's
    c.now += 0.3
    c.delay += 0.25
    w.tick()
    assert abs(w.max_gap_s - 0.05) < 1e-9 and abs(w.max_wall_gap_s - 0.3) < 1e-9
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # 400 ms held (a GIL holder, a long callback): the longest gap, and said once
    with caplog.at_level(logging.WARNING, logger="kvpoold"):
        c.now += 0.4
        w.tick()
        c.now += 0.2
        w.tick()                                       # inside warn_every_s: not said again
    assert abs(w.max_gap_s - 0.4) < 1e-9
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "did not run for 400 ms" in warned[0], warned
    assert "400.0 ms" in w.summary() and "4 ticks" in w.summary()


def test_the_summary_now_counts_the_gap_still_open():
    """A caller that held the loop since the last tick (a registration's attach once did)
    sees its own hold in the summary it writes."""
    c = Clock()
    w = LoopWatch(tick_s=0.01, clock=c, thread_times=lambda: (0.0, 0.0))
    assert "gap since start 0.0 ms" in w.summary_now(), "not started: no gap yet"
    w._started, w._last, w._last_times = True, c.now, (0.0, 0.0)   # what start() records
    c.now += 0.25
    assert "longest event-loop gap since start 250.0 ms" in w.summary_now()


def test_a_real_loop_ticks_and_sees_a_blocking_callback():
    async def main() -> LoopWatch:
        w = LoopWatch(tick_s=0.005, thread_times=lambda: (0.0, 0.0))
        w.start()
        await asyncio.sleep(0.05)
        time.sleep(0.12)                               # the loop held for 120 ms
        await asyncio.sleep(0.03)
        w.stop()
        return w
    w = asyncio.run(main())
    assert w.ticks >= 5
    assert 0.12 <= w.max_gap_s < 0.5, w.summary()


def test_the_threads_times_are_read_where_the_kernel_keeps_them():
    ran, waited = thread_times_s()
    assert ran >= 0.0 and waited >= 0.0


def test_the_kept_file_reads_what_a_fresh_open_reads_and_closes():
    """``ThreadTimes`` (the loop's schedstat kept open, read with pread) moves as the
    per-call open does, on the thread that made it."""
    times = ThreadTimes()
    ran0, _ = times()
    fresh0, _ = thread_times_s()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.05:     # spin on this thread: its run time grows
        pass
    ran1, _ = times()
    fresh1, _ = thread_times_s()
    assert ran1 - ran0 >= 0.04 and fresh1 - fresh0 >= 0.04, (ran0, ran1, fresh0, fresh1)
    assert abs(ran1 - fresh1) < 0.02
    times.close()
    assert times() == (0.0, 0.0)
