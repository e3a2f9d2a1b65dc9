"""The event loop alone on one CPU (daemon/loop_cpu.py): the pinned thread on it, every other
thread of the process moved off it, at the start, as they are made, and after placing
themselves."""

from __future__ import annotations

import os
import threading

import pytest

from kvpool.daemon.loop_cpu import LoopCpu, check_loop_cpu
from kvpool.shared.errors import ConfigError
from tests.conftest import wait_for

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to keep one apart")


def _tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


@pytest.fixture
def restore_affinity():
    """Every thread of this process back on the CPUs it had (a sweep moves pytest's too)."""
    before = {tid: os.sched_getaffinity(tid) for tid in _tids()}
    yield
    for tid, cpus in before.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass                        # ended meanwhile


class _LoopThread:
    """A thread standing in for the event loop's: starts ``LoopCpu`` on itself, then makes a
    thread (which inherits its CPU) and holds both until ``release``."""

    def __init__(self, cpu: int) -> None:
        self.loop_cpu = LoopCpu(cpu, sweep_s=0.01)
        self.started = threading.Event()
        self.release = threading.Event()
        self.tid = self.child_tid = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        self.loop_cpu.start()
        child_up = threading.Event()

        def child() -> None:
            self.child_tid = threading.get_native_id()
            child_up.set()
            self.release.wait(30)
        threading.Thread(target=child, daemon=True).start()
        child_up.wait(30)
        self.started.set()
        self.release.wait(30)
        self.loop_cpu.stop()


@needs_two
def test_the_loop_runs_alone_on_its_cpu_and_threads_it_makes_are_moved_off(restore_affinity):
    cpu = ALLOWED[-1]
    before = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
    before.start()
    loop = _LoopThread(cpu)
    loop.thread.start()
    try:
        assert loop.started.wait(30), "the loop's stand-in did not start"
        assert os.sched_getaffinity(loop.tid) == {cpu}
        # the child inherited {cpu} from the loop: the sweeper moves it, as it does every other
        wait_for(lambda: all(cpu not in os.sched_getaffinity(t) for t in _tids()
                             if t != loop.tid), 10,
                 lambda: str({t: sorted(os.sched_getaffinity(t)) for t in _tids()}))
        assert os.sched_getaffinity(loop.child_tid) == set(ALLOWED) - {cpu}
        assert os.sched_getaffinity(before.native_id) == set(ALLOWED) - {cpu}
        assert os.sched_getaffinity(loop.tid) == {cpu}, "the loop itself was moved"
        assert loop.loop_cpu.moved >= 3     # pytest's thread, ``before``, the child (and more)
    finally:
        loop.release.set()
        loop.thread.join(30)
    assert not loop.loop_cpu._sweeper.is_alive(), "stop left the sweeper running"


@needs_two
def test_a_thread_that_places_itself_on_the_loop_cpu_after_a_sweep_is_moved_again(
        restore_affinity):
    """As a lane does on its GPU's node: the next sweep takes the loop's CPU out of its set
    and leaves it the rest of its own CPUs."""
    cpu = ALLOWED[-1]
    loop_cpu = LoopCpu(cpu)
    loop_cpu.loop_tid = -1              # no loop thread in this test: sweeps only
    placed = {ALLOWED[0], cpu}
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def lane() -> None:
        tid.append(threading.get_native_id())
        ready.wait(30)
        os.sched_setaffinity(0, placed)
        done.set()
        threading.Event().wait(5)
    t = threading.Thread(target=lane, daemon=True)
    t.start()
    wait_for(lambda: tid, 10, "the lane's thread did not start")
    loop_cpu.sweep()
    assert cpu not in os.sched_getaffinity(tid[0])
    ready.set()
    assert done.wait(30)
    assert os.sched_getaffinity(tid[0]) == placed
    assert loop_cpu.sweep() >= 1
    assert os.sched_getaffinity(tid[0]) == placed - {cpu}


def test_a_cpu_the_daemon_may_not_run_on_is_refused_by_name():
    outside = max(ALLOWED) + 1
    with pytest.raises(ConfigError, match=f"loop_cpu={outside} is not a CPU kvpoold may run on"):
        check_loop_cpu(outside)
    with pytest.raises(ConfigError, match="loop_cpu"):
        LoopCpu(outside)


def test_the_only_cpu_is_refused_it_would_leave_the_other_threads_none():
    """Checked on a thread that may run on one CPU only (the check reads the calling
    thread's CPUs, as the daemon's start does on its main thread)."""
    cpu = ALLOWED[0]
    errors: list[BaseException] = []

    def one_cpu() -> None:
        os.sched_setaffinity(0, {cpu})
        try:
            check_loop_cpu(cpu)
        except ConfigError as e:
            errors.append(e)
    t = threading.Thread(target=one_cpu)
    t.start()
    t.join(30)
    assert errors and "would leave kvpoold's other threads no CPU" in str(errors[0])


@needs_two
def test_threads_that_cannot_be_listed_are_warned_of_once(monkeypatch, caplog):
    """Without /proc (some sandboxes) the loop stays pinned but nothing keeps the other
    threads off its CPU: the log says so once, not every sweep."""
    import kvpool.daemon.loop_cpu as loop_cpu
    monkeypatch.setattr(loop_cpu, "_TASKS", "/nonexistent/task")
    lc = LoopCpu(ALLOWED[-1])
    with caplog.at_level("WARNING", logger="kvpoold"):
        assert lc.sweep() == 0 and lc.sweep() == 0
    warned = [r for r in caplog.records if "cannot list the daemon's threads" in r.message]
    assert len(warned) == 1, caplog.text
