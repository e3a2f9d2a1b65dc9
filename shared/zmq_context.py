"""ZeroMQ contexts whose I/O threads never preempt the threads that hand them messages.

libzmq moves every message through a background I/O thread, and a send wakes it. On a busy host
Linux's wake-up preemption then runs that thread at once on the sender's CPU, and the sender
waits for its CPU back: on a loaded 2-core host a non-blocking send of a lookup took 35-175 us
(p50) inside vLLM's scheduler step, against ~10 us with the I/O thread under ``SCHED_BATCH``,
which the kernel never prefers at wake-up. Such a thread still runs at once on an idle CPU, so
where cores are free nothing is delayed; where none is, it runs when the sender yields its CPU
(the step ends, or it waits for a reply) instead of in the middle of the step.

Used by the clients' transports and the daemon's server socket.
"""

from __future__ import annotations

import os
import threading

import zmq

_shared: tuple[int, zmq.Context] | None = None
# Contexts inherited through a fork: kept, never closed or collected (closing one in a child
# would act on the parent's threads' state).
_inherited: list[zmq.Context] = []
_lock = threading.Lock()
_batch_ok: bool | None = None


def shared_context() -> zmq.Context:
    """This process's context for kvpool's sockets (made again in a forked child: a context
    does not survive a fork). Separate from ``zmq.Context.instance()`` so the setting never
    reaches the sockets of the process hosting us (vLLM's own)."""
    global _shared
    with _lock:
        if _shared is None or _shared[0] != os.getpid():
            if _shared is not None:
                _inherited.append(_shared[1])
            _shared = (os.getpid(), new_context())
        return _shared[1]


def new_context() -> zmq.Context:
    """A context whose I/O thread runs under ``SCHED_BATCH`` where this host allows it."""
    ctx = zmq.Context()
    if batch_policy_allowed():
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        ctx.set(zmq.THREAD_PRIORITY, 0)     # the only priority SCHED_BATCH takes
    return ctx


def batch_policy_allowed() -> bool:
    """Whether a thread of this process may switch itself to ``SCHED_BATCH``. Asked once, on
    a thread of its own: libzmq aborts the process when its I/O thread cannot take the policy
    it was given (a seccomp profile that refuses ``sched_setscheduler``, another OS)."""
    global _batch_ok
    if _batch_ok is None:
        result = [False]

        def probe() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
                result[0] = True
            except (AttributeError, OSError):
                pass

        t = threading.Thread(target=probe, name="kvpool-sched-probe", daemon=True)
        t.start()
        t.join()
        _batch_ok = result[0] and hasattr(zmq, "THREAD_SCHED_POLICY")
    return _batch_ok
