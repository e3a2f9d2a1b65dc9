"""The daemon's log records leave the event loop through a queue: a thread writes them.

A write to stderr can block: a pipe that journald or a container runtime drains late, a file
under writeback throttling on a busy host. On the event loop's thread such a write stalls every
client (a 2-core host under load: 100 ms gaps right after a registration's log line, issue 36).
``QueueHandler`` formats each record where it is made (cheap, no I/O) and queues it; one
listener thread writes them in order. ``stop`` drains the queue: it runs at interpreter exit,
and before any ``os._exit``.

Must never: drop a record, or reorder records.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue

_listener: logging.handlers.QueueListener | None = None


def queued(handler: logging.Handler) -> logging.Handler:
    """A handler for the root logger that hands records to ``handler`` on a thread of its own
    (started here; one per process: a second call replaces the first, after draining it)."""
    global _listener
    stop()
    q: queue.SimpleQueue = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(q, handler, respect_handler_level=True)
    _listener.start()
    return logging.handlers.QueueHandler(q)


def stop() -> None:
    """Write every queued record and stop the listener (idempotent)."""
    global _listener
    if _listener is not None:
        listener, _listener = _listener, None
        listener.stop()


atexit.register(stop)
