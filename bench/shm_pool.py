"""A Pool-like buffer in host shared memory, for driving a copy engine without the daemon."""

from __future__ import annotations

import os


class ShmPool:
    """A Pool-like buffer for driving the engine without the daemon: a POSIX shm file,
    mapped, with ``base_address`` and ``nbytes`` (what ``CudaCopyEngine`` reads)."""

    def __init__(self, nbytes: int, name: str = "") -> None:
        import ctypes
        import mmap
        self.path = f"/dev/shm/{name or f'kvpool-gputest-{os.getpid()}'}"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.buffer = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self._anchor = ctypes.c_char.from_buffer(self.buffer)
        self.base_address = ctypes.addressof(self._anchor)

    def array(self):
        import numpy as np
        return np.frombuffer(self.buffer, dtype=np.uint8)

    def close(self) -> None:
        del self._anchor
        self.buffer.close()
        os.unlink(self.path)
