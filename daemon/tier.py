"""The interface of a tier under the pool: where blocks go when the pool lets them go.

The pool (``daemon/index.py``) is the top tier: engines only ever copy to and from it. A lower
tier keeps copies of pool blocks somewhere bigger or farther (``daemon/disk_tier.py``: files in
a directory; ``daemon/remote_tier.py``: a Mooncake Store shared by many hosts), and brings them
back into pool slots when a lookup asks for a key the pool no longer holds. Tiers are asked in
order (pool, disk, remote). ``daemon/tiering.py`` is the only caller: it decides which blocks go
down and when, pins the pool slots a tier reads or writes, and turns a lower-tier hit into a
pool slot the engine loads from.

Contract for every tier (all methods are called on the daemon's event loop and return at once;
the I/O runs on the tier's own threads):

- Blocks are named by their 32-byte pool key (namespace + block hash) and have a fixed size
  per namespace (the layout's ``slot_bytes``), passed with every call.
- ``leading`` and ``wants`` answer from memory: no I/O, never blocking. A tier whose index
  lives elsewhere (a store shared with other hosts) learns through ``probe``: the caller asks
  it about a lookup's keys first and answers the lookup once the returned future resolves; the
  tier resolves it by its own deadline, whatever the other side does.
- ``demote``/``promote`` take pool byte offsets. The caller keeps those pool bytes stable
  (pinned) until the returned future resolves. ``demote`` reads them; ``promote`` writes them
  and resolves to one bool per block: True only when the bytes in the pool are exactly those
  that were demoted (checksummed on the way down, verified on the way up). A block that fails
  is dropped by the tier and never reported loadable again.
- A fault the tier cannot serve through (disk full, I/O error, store unreachable) turns it
  off: ``is_enabled`` goes False, futures in flight resolve (failed blocks as False), and from
  then on ``leading`` answers 0 and ``wants`` False. The pool keeps serving. A tier that can
  recover by itself (the store answers again) turns back on and calls ``on_restored``: what it
  held may be gone, so the caller offers it the pool's blocks again.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Iterable

from kvpool.shared.protocol import TierInfo


class TierEvents:
    """What a tier tells its caller, on the event loop (``LowerTier.bind``; nothing by default):
    it serves again after a fault (``restored``: what it held may be gone, so the pool's blocks
    are offered again), ``can_demote`` turned True other than by a ``demote`` future resolving
    (``ready``: a tier that makes blocks durable after that), and which keys it can serve from
    now on (``held``) or no longer (``dropped``), for the shared-memory index. A tier whose
    index is not in memory (a store shared with other hosts) need not send the last two."""

    def restored(self) -> None:
        pass

    def ready(self) -> None:
        pass

    def held(self, keys: list[bytes]) -> None:
        pass

    def dropped(self, keys: list[bytes]) -> None:
        pass


class LowerTier(abc.ABC):
    name: str
    # What the tier tells its caller (``bind``): nobody listens until then.
    events: TierEvents = TierEvents()
    # Whether queued blocks are still written down when the daemon stops (the pool may be
    # unlinked next). The remote tier says no: a publish while stopping waits on the network.
    flushes_at_exit: bool = True
    # Set by ``close`` when calls it could not stop (or a client whose teardown would wait on
    # a remote peer) are left behind: the process must then end without joining its threads.
    has_lingering_work: bool = False

    def bind(self, events: TierEvents) -> None:
        """Tell ``events`` what happens from now on (the tiering's call, at its construction)."""
        self.events = events

    def held_keys(self) -> Iterable[bytes]:
        """The keys the tier can serve now, as far as it knows from memory (for the observer's
        first look; none by default)."""
        return ()

    def start(self) -> None:
        """Called once on the event loop before the daemon serves (background work starts)."""

    def probe(self, ns: bytes, tails: list[list[bytes]], slot_bytes: int
              ) -> asyncio.Future[None] | None:
        """Learn whether the tier holds the blocks ``tails`` name (block hashes of ``ns``,
        each list in prompt order), so that ``leading`` can answer for them. None when there is
        nothing to wait for (the default: the tier's index is in memory); else a future that
        resolves, never fails, within the tier's own deadline."""
        return None

    @property
    @abc.abstractmethod
    def is_enabled(self) -> bool: ...

    @abc.abstractmethod
    def leading(self, ns: bytes, hashes: list[bytes], slot_bytes: int) -> int:
        """How many of ``hashes`` (block hashes of namespace ``ns``), from the first on, this
        tier holds as blocks of ``slot_bytes`` bytes that it could promote now."""

    @abc.abstractmethod
    def wants(self, key: bytes, slot_bytes: int) -> bool:
        """Whether a pool block ``key`` should be demoted (the tier does not hold it yet)."""

    @abc.abstractmethod
    def can_demote(self) -> bool:
        """Whether ``demote`` may be called now (False while its batches are all in flight)."""

    @abc.abstractmethod
    def batch_blocks(self, slot_bytes: int) -> int:
        """The most blocks of ``slot_bytes`` bytes worth putting in one ``demote`` call."""

    @abc.abstractmethod
    def demote(self, keys: list[bytes], offsets: list[int], slot_bytes: int
               ) -> asyncio.Future[int]:
        """Copy pool blocks (key i at pool byte offset i) down; resolves, once the tier no
        longer reads those pool bytes, to how many it took (some may find no room). A tier may
        make them durable later; they count in ``leading`` only once it could serve them."""

    @abc.abstractmethod
    def promote(self, keys: list[bytes], offsets: list[int], slot_bytes: int
                ) -> asyncio.Future[list[bool]]:
        """Copy held blocks up into pool bytes at ``offsets``; per block, True if verified."""

    @abc.abstractmethod
    def forget(self, ns: bytes) -> int:
        """Drop every block of namespace ``ns`` (a cache reset); returns how many."""

    @abc.abstractmethod
    def info(self) -> TierInfo: ...

    @abc.abstractmethod
    async def close(self, timeout_s: float) -> None:
        """Let I/O in flight finish (up to ``timeout_s``), make what landed durable, release
        the tier's files. After it returns, the tier touches no pool memory."""
