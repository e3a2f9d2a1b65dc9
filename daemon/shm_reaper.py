"""Removes the shared-memory KV segments of engines that are gone.

A CPU engine's KV cache lives in a POSIX shm object named ``ENGINE_SHM_PREFIX...`` that the
engine process created (``kvpool.client.host_memory``) and holds a shared ``flock`` on for its
whole life. An engine that exits normally unlinks it; one that is SIGKILLed cannot, and the
memory would stay allocated in /dev/shm until reboot. A name that nobody holds the lock on any
more belongs to no live process: this module unlinks those. Called at daemon start, after a
client is released, and periodically, from the event loop (a directory scan and one
non-blocking lock attempt per engine segment: microseconds).

It only ever touches regular files directly in /dev/shm whose names start with the prefix,
opened without following links; names of other users it cannot open are left alone. A segment
without a size may be one an engine is creating this instant (it locks before it sizes), so such
a segment is only removed once it is old.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time

from kvpool.shared.protocol import ENGINE_SHM_PREFIX

log = logging.getLogger("kvpoold")

SHM_DIR = "/dev/shm"
# An unsized, unlocked segment younger than this may be mid-creation.
EMPTY_GRACE_S = 60.0


def reap_engine_segments(shm_dir: str = SHM_DIR, now: float | None = None) -> list[str]:
    """Unlink every engine segment in ``shm_dir`` that no live process holds; returns their names."""
    now = time.time() if now is None else now
    reaped: list[str] = []
    try:
        entries = [e for e in os.scandir(shm_dir) if e.name.startswith(ENGINE_SHM_PREFIX)]
    except OSError as e:
        log.warning("cannot scan %s for abandoned engine KV segments: %s", shm_dir, e)
        return reaped
    for entry in entries:
        if not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP):
                log.warning("cannot open %s: %s", entry.path, e)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue   # its engine is alive
            st = os.fstat(fd)
            if st.st_size == 0 and now - st.st_mtime < EMPTY_GRACE_S:
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            reaped.append(entry.name)
            log.info("removed %s (%.1f MiB): the engine that allocated it is gone",
                     entry.path, st.st_size / (1 << 20))
        finally:
            os.close(fd)
    return reaped
