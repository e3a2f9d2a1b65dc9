"""The pool and the tier under it: which blocks go down, and how a lower-tier hit comes up.

``Tiering`` sits between the index (``daemon/index.py``, the pool) and one ``LowerTier``
(``daemon/tier.py``). The server calls it at three moments: before a lookup, when a load starts,
and on a reset. It never copies bytes itself and never blocks the event loop.

- **Down: write-behind, oldest first.** Every block that commits in the pool (stored by an
  engine, or adopted from the previous daemon's pool) joins a queue in commit order; batches
  of it go down while the tier has room for more I/O, their pool slots pinned until written.
  So the blocks the pool's LRU will drop next are the ones already written, and whatever is on
  disk when the daemon stops (or the host reboots) is served by the next daemon. A block the
  pool evicts before its turn is counted (``missed_blocks``); under sustained stores faster
  than the disk, that is how the disk tier falls behind, never by slowing a request.
- **Up: at lookup time.** Before the index answers a lookup, each key list's first keys
  missing from the pool are looked up in the tier (from memory); the run it holds gets FILLING
  slots and one ``promote``. The lookup then counts them as hits at once, and the engine's load
  of such a slot waits (``pending``) until the fill has landed and been verified; a block that
  fails makes the load fail with ``BLOCK_LOST`` and the engine recomputes it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec

from kvpool.daemon.index import COMMITTED, Index, Slot
from kvpool.daemon.tier import LowerTier
from kvpool.shared.protocol import TierInfo


class Tiering:
    """Callers: the server's dispatch and lifecycle, on the event loop thread only."""

    def __init__(self, index: Index, lower: LowerTier) -> None:
        self.index = index
        self.lower = lower
        self._queue: deque[tuple[Slot, int]] = deque()   # (slot, generation) to demote
        self._fills: dict[int, asyncio.Future[list[bool]]] = {}   # slot id -> its fill
        self._pump_scheduled = False
        self.missed_blocks = 0
        index.on_commit = self._committed

    def start(self) -> None:
        """Queue the pool's committed blocks (an adopted pool) for the tier; call on the loop."""
        self._committed(self.index.committed_slots())

    # ---- down ------------------------------------------------------------------------------

    def _committed(self, slots: list[Slot]) -> None:
        lower = self.lower
        if not lower.is_enabled:
            return
        for s in slots:
            if lower.wants(s.key, s.size_class.slot_bytes):
                self._queue.append((s, s.generation))
        if self._queue and not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Start demote batches while the tier takes them (one slot size per batch)."""
        self._pump_scheduled = False
        lower, queue = self.lower, self._queue
        while queue and lower.can_demote():
            batch: list[Slot] = []
            size = 0
            while queue:
                s, generation = queue[0]
                if s.state != COMMITTED or s.generation != generation or s.doomed:
                    queue.popleft()
                    self.missed_blocks += 1
                    continue
                if batch and (s.size_class.slot_bytes != size
                              or len(batch) >= lower.batch_blocks(size)):
                    break
                queue.popleft()
                size = s.size_class.slot_bytes
                if lower.wants(s.key, size):
                    batch.append(s)
            if not batch:
                continue
            self.index.pin(batch)
            done = lower.demote([s.key for s in batch], [s.offset for s in batch], size)
            done.add_done_callback(lambda _f, batch=batch: self._demoted(batch))
        if not lower.is_enabled:
            queue.clear()

    def _demoted(self, batch: list[Slot]) -> None:
        self.index.unpin(batch)
        self._pump()

    # ---- up --------------------------------------------------------------------------------

    def before_lookup(self, ns: bytes, key_lists: list[list[bytes]], now: float) -> None:
        """Start bringing up the leading keys of each list that the pool lacks and the tier
        holds, so the lookup that follows counts them. Where the pool has no room, the run
        stops there (the lookup's hits stop there too)."""
        lower, index = self.lower, self.index
        if not lower.is_enabled or not index.has_layout(ns):
            return
        slot_bytes = index.layout_of(ns).slot_bytes
        for keys in key_lists:
            i = index.leading(ns, keys)
            while i < len(keys):
                n = lower.leading(ns, keys[i:], slot_bytes)
                if n == 0:
                    break
                slots = index.reserve_fills(ns, keys[i:i + n], now)
                if slots:
                    self._promote(ns, keys[i:i + len(slots)], slots, slot_bytes)
                if len(slots) < n:
                    break
                i += n
                i += index.leading(ns, keys[i:])

    def _promote(self, ns: bytes, hashes: list[bytes], slots: list[Slot], slot_bytes: int
                 ) -> None:
        done = self.lower.promote([ns + h for h in hashes], [s.offset for s in slots],
                                  slot_bytes)
        for s in slots:
            self._fills[s.id] = done
        # Added before any load's wait, so the slots are settled when a waiting load resumes.
        done.add_done_callback(lambda f: self._filled(slots, f))

    def _filled(self, slots: list[Slot], done: asyncio.Future[list[bool]]) -> None:
        for s in slots:
            if self._fills.get(s.id) is done:
                del self._fills[s.id]
        ok = done.result() if done.exception() is None else [False] * len(slots)
        self.index.end_fill(slots, ok)

    def pending(self, slots: list[Slot]) -> list[asyncio.Future]:
        """The fills a load of ``slots`` must wait for (none when all are in the pool)."""
        fills = self._fills
        if not fills:
            return []
        return list({id(f): f for f in (fills.get(s.id) for s in slots) if f is not None}
                    .values())

    # ---- the rest --------------------------------------------------------------------------

    def reset(self, ns: bytes) -> int:
        """Forget ``ns`` in the tier as the pool does (its queued slots are dropped by the
        index, so they are skipped here)."""
        return self.lower.forget(ns)

    def info(self) -> TierInfo:
        return msgspec.structs.replace(self.lower.info(), missed_blocks=self.missed_blocks)

    async def close(self, timeout_s: float) -> None:
        """Write down what is still queued (the pool may be unlinked next), for at most
        ``timeout_s`` together with closing the tier."""
        deadline = time.monotonic() + timeout_s
        self._pump()
        while self._queue and self.lower.is_enabled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.lower.close(max(0.1, deadline - time.monotonic()))
