"""KV memory in host POSIX shared memory, which kvpoold maps to copy blocks in and out.

For CPU engines (the connector allocates vLLM's KV cache here, see ``client/vllm/alloc.py``) and the tests:
allocate the KV cache with ``SharedHostMemory`` and register ``.region``.

Three promises, each because an engine must never pay for kvpool with its life:
- The pages are reserved when the object is made (``posix_fallocate``), so a /dev/shm that is too
  small fails here with ``ShmSpaceError`` naming the size it needs, never later as a SIGBUS in
  the middle of a forward pass.
- The object is created 0600 by this process's user, so only that user (kvpoold runs as it, or as
  root) can map it.
- The name never outlives the process for long: it is unlinked on ``close`` or at a normal exit,
  and the process holds a shared ``flock`` on it for its whole life, so a reaper (kvpoold at start,
  when a client goes, and periodically: ``kvpool.daemon.shm_reaper``) that can take the lock
  exclusively knows nobody uses the name any more, also after a SIGKILL.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import weakref

import posix_ipc
import torch

from kvpool.shared.protocol import ENGINE_SHM_PREFIX, HostRegion

SHM_DIR = "/dev/shm"


class ShmSpaceError(OSError):
    """/dev/shm cannot hold the requested bytes; the message says how big it must be."""


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def space_error(nbytes: int, free: int) -> ShmSpaceError:
    return ShmSpaceError(
        errno.ENOSPC,
        f"the KV cache needs {_gib(nbytes)} of {SHM_DIR} but only {_gib(free)} is free: make "
        f"{SHM_DIR} larger by at least {_gib(nbytes - free)} (docker/podman --shm-size, "
        f"Kubernetes: an emptyDir with medium Memory mounted at {SHM_DIR}, or `mount -o "
        f"remount,size=<size> {SHM_DIR}`), or make the KV cache smaller "
        f"(VLLM_CPU_KVCACHE_SPACE)")


class SharedHostMemory:
    def __init__(self, nbytes: int, name: str | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"shared host memory needs a positive size, got {nbytes}")
        free = shm_free_bytes()
        if nbytes > free:
            raise space_error(nbytes, free)
        self.name = name or f"{ENGINE_SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.nbytes = nbytes
        # Size 0 first, the lock, then the size: a reaper only removes a segment it can lock
        # that has a size (or is old), so it never takes one being created.
        shm = posix_ipc.SharedMemory("/" + self.name, posix_ipc.O_CREX, mode=0o600, size=0)
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_SH)
            try:
                os.posix_fallocate(shm.fd, 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise space_error(nbytes, shm_free_bytes()) from None
                raise
            self._map = mmap.mmap(shm.fd, nbytes)
        except BaseException:
            _release(self.name, shm.fd)
            raise
        # The descriptor stays open as long as the memory is in use: it carries the lock.
        self._finalizer = weakref.finalize(self, _release, self.name, shm.fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.region = HostRegion(self.name, nbytes)

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        """Unlink the shm object; the memory goes when the last mapping (ours, kvpoold's) does."""
        self._finalizer()


def _release(name: str, lock_fd: int) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass
    os.close(lock_fd)
