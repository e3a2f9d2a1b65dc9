"""The copy-engine interface: how the server moves bytes between workers' KV memory and the pool.

One engine per kind of memory: ``HostCopyEngine`` (``daemon/host_copy.py``) for KV tensors in
host shared memory (CI and CPU engines), a CUDA engine per GPU for tensors shared over CUDA IPC.
The server picks the engine by the registration's region type and never looks inside.

Contract for every engine:

- ``attach`` maps a registration's regions (opens shm objects or IPC handles) and checks them;
  it raises a ``KvpoolError`` (never anything else on bad input) and leaves nothing mapped then.
- ``submit_store``/``submit_load`` return at once with a ``concurrent.futures.Future``; the copy
  runs off the event loop. Jobs submitted for one ``Mapped`` run in submission order. The future
  resolves to a ``JobResult`` or raises a ``KvpoolError``.
- One batched operation per job (one kernel launch, one batched DMA call, or one vectorised host
  copy per run of equal-sized segments): never a Python call per block or per layer.
- ``detach`` waits for that registration's jobs, then releases its mappings (and GPU memory).
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.shared.protocol import RegisterRequest

if TYPE_CHECKING:
    from kvpool.daemon.peer import Peer


@dataclass(frozen=True)
class JobResult:
    nbytes: int
    done_event: bytes = b""   # CUDA IPC event handle the engine's stream can wait on


class Mapped(abc.ABC):
    """A registration's memory as one engine mapped it."""

    registration: RegisterRequest

    @property
    def tp_rank(self) -> int:
        return self.registration.tp_rank


class CopyEngine(abc.ABC):
    """Moves one registration's blocks to and from this rank's shard of pool slots.

    ``shard_offsets[i]`` is the pool byte offset of this rank's shard of the i-th slot; block
    ``block_ids[i]`` pairs with it. Both are int64 arrays of equal length, already validated.
    """

    name: str

    @abc.abstractmethod
    def attach(self, registration: RegisterRequest, peer: "Peer | None" = None) -> Mapped:
        """``peer``: the registering process's kernel credentials, for engines that open
        memory by name on its behalf (they must not open what it could not)."""

    @abc.abstractmethod
    def detach(self, mapped: Mapped) -> None: ...

    @abc.abstractmethod
    def submit_store(self, mapped: Mapped, block_ids: np.ndarray, shard_offsets: np.ndarray,
                     wait_event: bytes = b"") -> Future[JobResult]: ...

    @abc.abstractmethod
    def submit_load(self, mapped: Mapped, shard_offsets: np.ndarray,
                    block_ids: np.ndarray) -> Future[JobResult]: ...

    def close(self) -> None:
        """Stop accepting jobs and finish or abort the ones in flight."""


def segment_address_table(mapped_registration: RegisterRequest) -> tuple[np.ndarray, ...]:
    """Per-segment (region, offset, block stride, nbytes, offset inside the shard) as int64
    arrays: the inputs every engine vectorises its address computation over."""
    reg = mapped_registration
    nbytes = np.asarray(reg.layout.segment_bytes, dtype=np.int64)
    prefix = np.zeros_like(nbytes)
    np.cumsum(nbytes[:-1], out=prefix[1:])
    region = np.asarray([p.region for p in reg.placement], dtype=np.int64)
    offset = np.asarray([p.offset_bytes for p in reg.placement], dtype=np.int64)
    stride = np.asarray([p.block_stride_bytes for p in reg.placement], dtype=np.int64)
    return region, offset, stride, nbytes, prefix
