"""The event loop alone on one CPU (``loop_cpu``): the loop's thread runs there, every other
thread of the daemon elsewhere.

On a GPU host the loop meets each job with cold caches: its Python costs ~10 µs per stored
2 MiB block on an H200 host, several times what a warm run costs on a CPU. The daemon's other
threads (lanes, copy and disk threads, executors) and the engines share the host's cores with
it, and the kernel may wake the loop on any of them. On 2 × H200, with the loop on one CPU and the
lanes' threads on the others, its CPU per stored GB was 2-21% lower in two runs beside one
without; on 4 × H200 at 4 engines, three runs each way, the setting gained nothing: runs of
one setting spread wider than the two differed (bench/README.md, host_scale). So it is off by
default. An operator who pins it should keep the engines off that CPU too (their cgroup,
``taskset``).

A thread inherits its creator's CPUs, and the loop creates threads as it serves (a lane pair
at a GPU's first registration, executor workers on first use). So a sweeper thread moves every
thread but the loop's off its CPU: once at the start, then every ``SWEEP_S``. A new thread may
share the loop's CPU until the next sweep.
"""

from __future__ import annotations

import logging
import os
import threading

from kvpool.daemon.numa import format_cpulist
from kvpool.shared.errors import ConfigError

log = logging.getLogger("kvpoold")

SWEEP_S = 0.1
_TASKS = "/proc/self/task"


def check_loop_cpu(cpu: int) -> None:
    """``ConfigError`` unless ``cpu`` (>= 0) is one this process may run on and leaves it
    another for its other threads."""
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise ConfigError(f"loop_cpu={cpu} is not a CPU kvpoold may run on "
                          f"({format_cpulist(allowed)}): pick one of those, or -1")
    if len(allowed) < 2:
        raise ConfigError(f"loop_cpu={cpu} would leave kvpoold's other threads no CPU: it may "
                          f"run on {format_cpulist(allowed)} only; use -1")


class LoopCpu:
    """Keeps the calling thread (the event loop's) alone on ``cpu`` from ``start`` to
    ``stop``."""

    def __init__(self, cpu: int, sweep_s: float = SWEEP_S) -> None:
        check_loop_cpu(cpu)
        self.cpu = cpu
        self.sweep_s = sweep_s
        self.others = frozenset(os.sched_getaffinity(0) - {cpu})
        self.loop_tid = 0
        self.moved = 0                  # threads taken off the loop's CPU so far
        self._unlisted = False          # /proc/self/task could not be read (warned once)
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def start(self) -> None:
        """Pin the calling thread to ``cpu``, move the others off it, and keep them off."""
        self.loop_tid = threading.get_native_id()
        os.sched_setaffinity(0, {self.cpu})
        self._sweeper = threading.Thread(target=self._sweep_forever, name="kvpool-loop-cpu",
                                         daemon=True)
        self._sweeper.start()          # (it inherits the loop's CPU: its first sweep moves it)
        log.info("event loop on CPU %d; the daemon's other threads on %s", self.cpu,
                 format_cpulist(self.others))

    def stop(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)

    def sweep(self) -> int:
        """Move every thread but the loop's that may run on ``cpu`` off it (keeping the rest
        of its CPUs: a lane placed on its GPU's node stays there); returns how many moved."""
        # (every thread every time, not only new ones: a thread may place itself after a
        # sweep saw it, as a lane does on its GPU's node; ~1 us a thread)
        try:
            tids = [int(t) for t in os.listdir(_TASKS)]
        except OSError as e:
            if not self._unlisted:
                self._unlisted = True
                log.warning("kvpool: cannot list the daemon's threads (%s): they may share the "
                            "event loop's CPU %d", e, self.cpu)
            return 0
        moved = 0
        for tid in tids:
            if tid == self.loop_tid:
                continue
            try:
                cpus = os.sched_getaffinity(tid)
                if self.cpu in cpus:
                    os.sched_setaffinity(tid, (cpus - {self.cpu}) or self.others)
                    moved += 1
            except OSError:
                continue                # gone meanwhile
        self.moved += moved
        return moved

    def _sweep_forever(self) -> None:
        while True:
            self.sweep()
            if self._stop.wait(self.sweep_s):
                return
