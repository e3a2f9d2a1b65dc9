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
- A big job runs as chunks of at most ``chunk_blocks`` items (``DaemonConfig.chunk_blocks``), so the first chunk's copy starts
  after a small launch. A store's ``progress(n)``, when given, is called from the engine's thread
  each time the first ``n`` items (in the order given) have landed, before the future resolves;
  never for the last chunk (the future says that) and never for items that did not land. The
  server commits those slots while the rest is still copying, so that after the last copy only
  the last chunk's bookkeeping stands between the copy and the reply.
- A store or a load may come with ``late`` (``LateOffsets``): only its first ``late.head``
  offsets are written when it is submitted (``store_head``/``load_head`` say how many the engine
  wants), and the caller writes the rest into that array (``late.offsets``, the one submitted),
  then calls ``late.ready()`` (or ``late.fail``). The engine copies those items only after
  ``late.wait()``, never on the caller's thread: a big job's first bytes move while the event
  loop finds room for a store's rest, or the slots of a load's.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvpool.shared.protocol import RegisterRequest

if TYPE_CHECKING:
    from kvpool.daemon.peer import Peer



# A CUDA store that reports its chunks ends with one of at most this many items: what is left
# after its last copy is that chunk's commit, not a whole chunk's (~75 -> ~30 us on a 2-core host,
# bench/investigations/big_job_path.py; on an H200 host, cold after the copy, a 32-item tail's
# commit still took 0.14-0.16 ms), while its copy (32 MiB of 2 MiB blocks: ~0.6 ms on PCIe 5)
# still hides the commit of the chunk before it, and the extra chunk's launch runs on the lane's
# thread under earlier chunks' copies. Not for the host engine, which pays each chunk's fixed
# cost in line with its copy (1024 4 KiB blocks: +0.3-0.7 ms of copy for -60 us after it), nor
# for loads, which commit nothing at their end.
TAIL_BLOCKS = 16

# A big CUDA job's first chunk has at most this many items: it is launched on the event loop's
# thread (``cuda_lane``), so its table and driver call are what a job waits for before its
# first byte moves (a 128-block chunk: ~0.46 ms on an H100 host, the job's whole launch cost
# before the copy); 32 blocks of 2 MiB (~1.2 ms of PCIe 5) still cover the lane thread's
# wake-up and its build of the next full chunk.
HEAD_BLOCKS = 32

# Told how many leading items of a job have landed (see the module docstring).
Progress = Callable[[int], None]


def chunk_bounds(n: int, chunk: int, tail: int = 0, head: int = 0) -> list[int]:
    """Item bounds [0, ..., n] of a job of ``n`` items cut into near-equal chunks of at most
    ``chunk`` (one chunk when ``chunk`` <= 0 or the job is no bigger); with ``tail``, the last
    chunk has at most ``tail`` items (``TAIL_BLOCKS``: stores); with ``head``, the first has at
    most ``head`` (``HEAD_BLOCKS``: CUDA jobs)."""
    if chunk <= 0 or n <= chunk:
        return [0, n]
    if 0 < head < chunk:
        return [0] + [head + b for b in chunk_bounds(n - head, chunk, tail)]
    if 0 < tail < chunk:
        return chunk_bounds(n - tail, chunk) + [n]
    k = -(-n // chunk)
    return [n * i // k for i in range(k + 1)]


class LateOffsets:
    """A job's ``offsets`` (the array it is submitted with), of which those past the first
    ``head`` are written by the caller after it submitted the job (see the module docstring).
    Waited on by engine threads alone."""

    __slots__ = ("offsets", "head", "step", "on_advance", "_written", "_error")

    def __init__(self, offsets: np.ndarray, head: int) -> None:
        self.offsets = offsets
        self.head = head
        # Set by the engine as it takes the job: how many leading offsets, once written and
        # ``advance``d to, let it copy more on the caller's thread before ``ready`` (0: none).
        self.step = 0
        self.on_advance: Callable[[int], None] | None = None    # the engine's, for ``advance``
        self._written = threading.Event()
        self._error: BaseException | None = None

    def advance(self, upto: int) -> None:
        """Offsets [0, ``upto``) are written: the engine may launch what they cover now, on
        the caller's thread (the event loop's, which holds the GIL through the rest's room
        and claims: an engine thread could not run meanwhile)."""
        if self.on_advance is not None:
            self.on_advance(upto)

    def ready(self) -> None:
        """Every offset is written."""
        self._written.set()

    def fail(self, error: BaseException) -> None:
        """The rest will not be written: the job ends with ``error`` after its head."""
        self._error = error
        self._written.set()

    def settle(self) -> None:
        """Block until ``ready`` or ``fail``, without raising (``wait`` says which)."""
        self._written.wait()

    def wait(self) -> None:
        """Block until ``ready`` (then every offset may be read) or ``fail`` (raises its error).
        The caller sets one or the other in the same event-loop dispatch that submitted the job,
        so this waits for that dispatch at most."""
        self._written.wait()
        if self._error is not None:
            raise self._error


@dataclass(frozen=True)
class JobResult:
    nbytes: int
    failed: tuple[int, ...] = ()    # a load's blocks not loaded (positions in the job)


class Mapped(abc.ABC):
    """A registration's memory as one engine mapped it."""

    registration: RegisterRequest

    @property
    def tp_rank(self) -> int:
        return self.registration.tp_rank


class CopyEngine(abc.ABC):
    """Moves one registration's blocks to and from this rank's part of pool slots.

    ``shard_offsets[i]`` is the pool byte offset of the i-th slot (the slot's start: the rank's
    part inside it is ``segment_address_table``'s business); block ``block_ids[i]`` pairs with
    it. Both are int64 arrays of equal length, already validated.
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
                     wait_event: bytes = b"", progress: Progress | None = None,
                     late: LateOffsets | None = None) -> Future[JobResult]: ...

    def store_head(self, n: int) -> int:
        """How many leading offsets of an ``n``-item store this engine needs when it is
        submitted, the rest coming ``late`` (0: all of them, no late offsets)."""
        return 0

    @abc.abstractmethod
    def submit_load(self, mapped: Mapped, shard_offsets: np.ndarray, block_ids: np.ndarray,
                    late: LateOffsets | None = None) -> Future[JobResult]: ...

    def load_head(self, n: int) -> int:
        """``store_head`` for an ``n``-item load."""
        return 0

    def start(self) -> None:
        """Called once on the event loop as the daemon starts serving: warm-up that must stay
        off the start path (a heavy import) begins here, on a thread of the engine's own. Jobs
        submitted before it is done wait for it, so it is never required."""

    def close(self) -> None:
        """Stop accepting jobs and finish or abort the ones in flight."""


def segment_address_table(mapped_registration: RegisterRequest) -> tuple[np.ndarray, ...]:
    """Where this rank's part of a block is, as int64 arrays over its *pieces*: (region, offset,
    block stride, nbytes, offset inside the slot). A piece is contiguous on both sides: in the
    worker's memory at ``region``'s base + offset + block * stride, in the pool at the slot's
    offset + the last column. Every engine vectorises its address computation over these.

    A rank-sharded layout's pieces are its segments, at ``tp_rank * shard_stride_bytes`` plus
    their offset in the shard. A head-split layout's are its segments cut at row boundaries,
    each row ``local_heads * head_bytes`` at its head range inside the slot's row (see
    ``kvpool.shared.layout``); a rank holding every head keeps its segments whole (the slot is
    then its shard, byte for byte).
    """
    reg = mapped_registration
    lay = reg.layout
    nbytes = np.asarray(lay.segment_bytes, dtype=np.int64)
    prefix = np.zeros_like(nbytes)
    np.cumsum(nbytes[:-1], out=prefix[1:])
    region = np.asarray([p.region for p in reg.placement], dtype=np.int64)
    offset = np.asarray([p.offset_bytes for p in reg.placement], dtype=np.int64)
    stride = np.asarray([p.block_stride_bytes for p in reg.placement], dtype=np.int64)
    if not lay.kv_heads:
        return region, offset, stride, nbytes, prefix + reg.tp_rank * lay.shard_stride_bytes
    if lay.local_heads == lay.kv_heads:
        return region, offset, stride, nbytes, prefix
    row = lay.local_heads * lay.head_bytes
    pitch = lay.kv_heads * lay.head_bytes
    h0, _ = lay.head_range(reg.tp_rank)
    shard = int(nbytes.sum())
    # Cut the shard (segments back to back) at every segment and every row boundary.
    cuts = np.union1d(prefix, np.arange(0, shard, row, dtype=np.int64))
    size = np.diff(np.append(cuts, shard))
    seg = np.searchsorted(prefix, cuts, side="right") - 1
    slot = (cuts // row) * pitch + h0 * lay.head_bytes + cuts % row
    return region[seg], offset[seg] + cuts - prefix[seg], stride[seg], size, slot


def part_span(table: tuple[np.ndarray, ...]) -> tuple[int, int]:
    """[first, last) byte of a slot that a rank's pieces (``segment_address_table``) touch."""
    _, _, _, nbytes, slot = table
    return int(slot.min()), int((slot + nbytes).max())
