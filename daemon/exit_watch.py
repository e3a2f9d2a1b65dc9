"""Clients released the moment their process exits, however it exits.

A pidfd turns readable when its process exits, so an engine killed with SIGKILL gives back its
leases, slots and registrations at once rather than after ``peer_timeout_ms`` of silence. The
pid comes from the kernel (SO_PEERCRED); a peer in a PID namespace we cannot see has none, and
only the heartbeat timeout covers it. Several clients of one process share its pidfd.
"""

from __future__ import annotations

import asyncio
import os
import select
from typing import Callable

from kvpool.daemon.registry import Owner


class ExitWatch:
    def __init__(self, exited: Callable[[list[int], int], None]) -> None:
        # Called on the loop with the owner ids of a process that exited, and its pid.
        self.exited = exited
        # pid -> its pidfd and the ids of the owners connected from it
        self._watches: dict[int, tuple[int, set[int]]] = {}

    def watch(self, owner: Owner) -> None:
        pid = owner.peer.pid if owner.peer is not None else 0
        if pid <= 0 or not hasattr(os, "pidfd_open"):
            return
        watch = self._watches.get(pid)
        if watch is not None and _readable(watch[0]):
            self._process_exited(pid)      # that process is gone; this pid is a new one
            watch = None
        if watch is None:
            try:
                fd = os.pidfd_open(pid)
            except OSError:                # exited already, or not ours to see
                return
            watch = self._watches[pid] = (fd, set())
            asyncio.get_running_loop().add_reader(fd, self._process_exited, pid)
        watch[1].add(owner.id)

    def unwatch(self, owner: Owner) -> None:
        pid = owner.peer.pid if owner.peer is not None else 0
        watch = self._watches.get(pid)
        if watch is not None:
            watch[1].discard(owner.id)
            if not watch[1]:
                self._close(pid)

    def close(self) -> None:
        """Closes every pidfd (the loop may be gone: no reader to remove)."""
        for fd, _ in self._watches.values():
            os.close(fd)
        self._watches.clear()

    def _close(self, pid: int) -> None:
        fd, _ = self._watches.pop(pid)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _process_exited(self, pid: int) -> None:
        watch = self._watches.get(pid)
        if watch is None:
            return
        self._close(pid)
        self.exited(sorted(watch[1]), pid)


def _readable(fd: int) -> bool:
    """Whether ``fd`` is readable now (poll, not select: daemon fds pass 1024 with many
    clients)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
