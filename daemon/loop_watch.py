"""The event loop's longest gap: how long the daemon went without running its loop.

A tick is scheduled every ``tick_s`` on the loop; the gap between two ticks is at least
``tick_s`` and, when something held the loop (a long callback, or a thread of ours holding the
GIL), the hold plus at most one tick. Time the main thread spent runnable but waiting for a CPU
(``/proc/thread-self/schedstat``'s run-queue delay) is taken out: on a host whose cores are
busy the kernel's scheduler, not the daemon, made that wait, and a daemon cannot answer for it.
What is left is time the loop was ours and did not run: the daemon's own doing.

Clients time out after 2 s by default, and a restarted daemon stalled 2-3.4 s while torch's
import held the GIL (issue 36): the longest gap since start is logged at the first
registration, and any gap over ``warn_s`` is logged when it ends (at most every
``warn_every_s``), so a stall names itself in the log.

Costs one timer callback and one small ``/proc`` read per tick: a ``pread`` of the loop thread's
``schedstat``, kept open (~3 us every 10 ms; opening it each tick cost ~25 us, and showed as 2%
of the busy daemon's main-thread samples on a 64-core host). Must never block: it only reads
the clock and that one file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("kvpoold")

TICK_S = 0.010
WARN_S = 0.1
WARN_EVERY_S = 10.0


def thread_times_s() -> tuple[float, float]:
    """(seconds this thread has run on a CPU, seconds it has spent runnable waiting for one);
    zeros where the kernel keeps no scheduler statistics."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


class ThreadTimes:
    """``thread_times_s`` of the thread that made it, read from its ``schedstat`` kept open."""

    def __init__(self) -> None:
        try:
            self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat",
                               os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def __call__(self) -> tuple[float, float]:
        if self._fd < 0:
            return 0.0, 0.0
        try:
            ran, waited = os.pread(self._fd, 128, 0).split()[:2]
            return int(ran) / 1e9, int(waited) / 1e9
        except (OSError, ValueError):
            return 0.0, 0.0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LoopWatch:
    """The event loop's gaps; ``start`` it on the loop (from a coroutine or callback there)."""

    def __init__(self, tick_s: float = TICK_S, warn_s: float = WARN_S,
                 warn_every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 thread_times: Callable[[], tuple[float, float]] = thread_times_s) -> None:
        self.tick_s = tick_s
        self.warn_s = warn_s
        self.warn_every_s = warn_every_s
        self._clock = clock
        self._thread_times = thread_times
        self.max_gap_s = 0.0         # longest gap since start, run-queue waits taken out
        self.max_wall_gap_s = 0.0    # the same, wall clock only
        self.ticks = 0
        self._last = 0.0
        self._last_times = (0.0, 0.0)
        self._warned = float("-inf")
        self._handle: asyncio.TimerHandle | None = None
        self._started = False
        self._own_times: ThreadTimes | None = None

    def start(self) -> None:
        if self._thread_times is thread_times_s:
            self._thread_times = self._own_times = ThreadTimes()     # this thread's: the loop's
        self._started = True
        self._last = self._clock()
        self._last_times = self._thread_times()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._own_times is not None:
            self._own_times.close()

    def _schedule(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self.tick_s, self._on_tick)

    def _on_tick(self) -> None:
        self.tick()
        self._schedule()

    def tick(self) -> None:
        """Record the gap since the last tick (tests drive it with their own clock)."""
        now, times = self._clock(), self._thread_times()
        wall = now - self._last
        ran, waited = (max(0.0, b - a) for a, b in zip(self._last_times, times))
        gap = max(0.0, wall - waited)
        self._last, self._last_times = now, times
        self.ticks += 1
        self.max_wall_gap_s = max(self.max_wall_gap_s, wall)
        if gap > self.max_gap_s:
            self.max_gap_s = gap
        if gap > self.warn_s and now >= self._warned + self.warn_every_s:
            self._warned = now
            # ran: busy on the loop's own thread; the rest it slept (the GIL, a blocking call)
            log.warning("kvpoold's event loop did not run for %.0f ms (wall %.0f ms: %.0f ms "
                        "waiting for a CPU, %.0f ms running on it)", gap * 1e3, wall * 1e3,
                        waited * 1e3, ran * 1e3)

    def summary_now(self) -> str:
        """``summary`` with the gap still open counted: the caller, on the loop, may be what
        holds it (the first registration's line is written at its end, and an attach on the
        loop went unseen in it until the next tick). A watch never started has nothing open."""
        if self._started:
            self.tick()
        return self.summary()

    def summary(self) -> str:
        return (f"longest event-loop gap since start {self.max_gap_s * 1e3:.1f} ms (wall "
                f"{self.max_wall_gap_s * 1e3:.1f} ms, {self.ticks} ticks of "
                f"{self.tick_s * 1e3:.0f} ms)")
