import os

import pytest
import zmq

from kvpool.shared import zmq_context
from tests.conftest import wait_for


def _context_threads(prefix: int) -> dict[str, int]:
    """Scheduling policy of each thread the context tagged with ``prefix`` started."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith(f"{prefix}/"):
                out[name] = os.sched_getscheduler(int(tid))
        except OSError:
            pass        # a thread that ended meanwhile
    return out


def test_io_threads_of_a_new_context_never_preempt_at_wake_up():
    mine = os.sched_getscheduler(0)
    ctx = zmq_context.new_context()
    ctx.set(zmq.THREAD_NAME_PREFIX, 731)
    sock = ctx.socket(zmq.DEALER)          # the first socket starts the context's threads
    try:
        sock.connect("ipc:///nonexistent/kvpool-test.sock")
        new = wait_for(lambda: _context_threads(731), 5, "the context's I/O threads to start")
        assert set(new.values()) == {os.SCHED_BATCH}, new
        # The caller's own thread keeps its policy: only a throwaway probe thread tried it.
        assert os.sched_getscheduler(0) == mine
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_host_that_refuses_the_policy_gets_a_plain_context(monkeypatch):
    # libzmq would abort the process if its thread could not take the policy: never ask then.
    def refuse(*_args):
        raise PermissionError("sched_setscheduler refused by the seccomp profile")
    monkeypatch.setattr(zmq_context, "_batch_ok", None)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert zmq_context.batch_policy_allowed() is False
    ctx = zmq_context.new_context()
    ctx.set(zmq.THREAD_NAME_PREFIX, 732)
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect("ipc:///nonexistent/kvpool-test.sock")
        new = wait_for(lambda: _context_threads(732), 5, "the context's I/O threads to start")
        assert set(new.values()) == {os.SCHED_OTHER}, new
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_shared_context_is_made_again_after_a_fork(monkeypatch):
    ctx = zmq_context.shared_context()
    assert zmq_context.shared_context() is ctx
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)     # as in a forked child
    child = zmq_context.shared_context()
    assert child is not ctx and zmq_context.shared_context() is child
    assert ctx in zmq_context._inherited                     # never closed by the child
    monkeypatch.undo()
    zmq_context._inherited.remove(ctx)
    zmq_context._shared = (pid, ctx)
    child.term()
