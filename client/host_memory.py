"""KV memory in host POSIX shared memory, which kvpoold maps to copy blocks in and out.

For CPU engines and the tests: allocate the KV cache here (``SharedHostMemory``) and register
``.region``. The object is created 0600 by this process's user, so only that user (the daemon
runs as it, or as root) can map it; it is unlinked on ``close`` or when this process exits.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref

import posix_ipc
import torch

from kvpool.shared.protocol import HostRegion


class SharedHostMemory:
    def __init__(self, nbytes: int, name: str | None = None) -> None:
        self.name = name or f"kvpool-kv-{os.getpid()}-{secrets.token_hex(4)}"
        self.nbytes = nbytes
        shm = posix_ipc.SharedMemory("/" + self.name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
        try:
            self._map = mmap.mmap(shm.fd, nbytes)
        finally:
            shm.close_fd()
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.region = HostRegion(self.name, nbytes)
        self._finalizer = weakref.finalize(self, _unlink, self.name)

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        """Unlink the shm object; the memory goes when the last mapping (ours, kvpoold's) does."""
        self._finalizer()


def _unlink(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass
