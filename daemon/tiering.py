"""The pool and the tiers under it: which blocks go down, and how a lower-tier hit comes up.

``Tiering`` sits between the index (``daemon/index.py``, the pool) and the ``LowerTier``s
(``daemon/tier.py``), in order: the disk tier, then the remote tier. The server calls it at
four moments: before a lookup (``probe``, then ``before_lookup``), when a load starts, and on a
reset. It never copies bytes itself and never blocks the event loop.

- **Down: write-behind, oldest first, to every tier.** Every block that commits in the pool
  (stored by an engine, adopted from the previous daemon's pool, or brought up from a tier)
  joins each tier's queue in commit order, if that tier wants it; batches of it go down while
  the tier has room for more I/O, their pool slots pinned until written. So the blocks the
  pool's LRU will drop next are the ones already written, and whatever is on disk when the
  daemon stops (or the host reboots) is served by the next daemon. A block the pool evicts
  before its turn is counted (``missed_blocks``, per tier); under sustained stores faster than
  a tier, that is how the tier falls behind, never by slowing a request. The tiers are
  independent: a block goes to the disk and is published to the remote store alike.
- **Probe.** A tier whose index is not in memory (the remote store) is asked about the keys of
  each key list past what the pool and the tiers above it hold; the server answers the lookup
  when those probes resolve (each tier bounds its own).
- **Up: at lookup time, upper tiers first.** Before the index answers a lookup, each key
  list's first keys missing from the pool are looked up in the tiers in order (from memory);
  each run a tier holds gets FILLING slots and one ``promote`` from that tier. The lookup then
  counts them as hits at once, and the engine's load of such a slot waits (``pending``) until
  the fill has landed and been verified; a block that fails makes the load fail with
  ``BLOCK_LOST`` and the engine recomputes it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from kvpool.daemon.index import COMMITTED, Index, Slot
from kvpool.daemon.tier import LowerTier
from kvpool.shared.protocol import TierInfo


@dataclass(eq=False)
class _Lane:
    """One tier and the pool blocks waiting to go down to it."""

    tier: LowerTier
    queue: deque[tuple[Slot, int]] = field(default_factory=deque)   # (slot, generation)
    pump_scheduled: bool = False
    missed_blocks: int = 0


class Tiering:
    """Callers: the server's dispatch and lifecycle, on the event loop thread only."""

    def __init__(self, index: Index, lowers: list[LowerTier]) -> None:
        self.index = index
        self.lowers = lowers
        self._lanes = [_Lane(t) for t in lowers]
        self._fills: dict[int, asyncio.Future[list[bool]]] = {}   # slot id -> its fill
        index.on_commit = self._committed
        for lane in self._lanes:
            lane.tier.on_restored = lambda lane=lane: self._offer_pool(lane)
            lane.tier.on_ready = lambda lane=lane: self._schedule_pump(lane)

    def start(self) -> None:
        """Start the tiers and queue the pool's committed blocks (an adopted pool) for them;
        call on the loop."""
        for lane in self._lanes:
            lane.tier.start()
        self._committed(self.index.committed_slots())

    # ---- down ------------------------------------------------------------------------------

    def _committed(self, slots: list[Slot]) -> None:
        for lane in self._lanes:
            self._offer(lane, slots)

    def _offer_pool(self, lane: _Lane) -> None:
        """A tier came back after a fault: offer it every committed block, oldest first."""
        self._offer(lane, self.index.committed_slots())

    def _offer(self, lane: _Lane, slots: list[Slot]) -> None:
        lower = lane.tier
        if not lower.is_enabled:
            return
        for s in slots:
            if lower.wants(s.key, s.size_class.slot_bytes):
                lane.queue.append((s, s.generation))
        self._schedule_pump(lane)

    def _schedule_pump(self, lane: _Lane) -> None:
        if lane.queue and not lane.pump_scheduled:
            lane.pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump, lane)

    def _pump(self, lane: _Lane) -> None:
        """Start demote batches while the tier takes them (one slot size per batch)."""
        lane.pump_scheduled = False
        lower, queue = lane.tier, lane.queue
        while queue and lower.can_demote():
            batch: list[Slot] = []
            size = 0
            while queue:
                s, generation = queue[0]
                if s.state != COMMITTED or s.generation != generation or s.doomed:
                    queue.popleft()
                    lane.missed_blocks += 1
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
            done.add_done_callback(lambda _f, batch=batch: self._demoted(lane, batch))
        if not lower.is_enabled:
            queue.clear()

    def _demoted(self, lane: _Lane, batch: list[Slot]) -> None:
        self.index.unpin(batch)
        self._pump(lane)

    # ---- up --------------------------------------------------------------------------------

    def probe(self, ns: bytes, key_lists: list[list[bytes]]) -> asyncio.Future | None:
        """Ask the tiers that must (``LowerTier.probe``) about the keys past what the pool and
        the tiers above them hold; a future resolving when all have answered, or None."""
        index = self.index
        if not index.has_layout(ns):
            return None
        slot_bytes = index.layout_of(ns).slot_bytes
        starts = [index.leading(ns, keys) for keys in key_lists]
        waits = []
        for lower in self.lowers:
            if not lower.is_enabled:
                continue
            tails = [keys[i:] for keys, i in zip(key_lists, starts) if i < len(keys)]
            f = lower.probe(ns, tails, slot_bytes) if tails else None
            if f is not None:
                waits.append(f)
            starts = [i + lower.leading(ns, keys[i:], slot_bytes)
                      for keys, i in zip(key_lists, starts)]
        if not waits:
            return None
        return waits[0] if len(waits) == 1 else asyncio.gather(*waits)

    def before_lookup(self, ns: bytes, key_lists: list[list[bytes]], now: float) -> None:
        """Start bringing up the leading keys of each list that the pool lacks and a tier
        holds (the first tier in order that holds the next key), so the lookup that follows
        counts them. Where the pool has no room, the run stops there (the lookup's hits stop
        there too)."""
        index = self.index
        lowers = [t for t in self.lowers if t.is_enabled]
        if not lowers or not index.has_layout(ns):
            return
        slot_bytes = index.layout_of(ns).slot_bytes
        for keys in key_lists:
            i = index.leading(ns, keys)
            while i < len(keys):
                for lower in lowers:
                    n = lower.leading(ns, keys[i:], slot_bytes)
                    if n:
                        break
                else:
                    break
                slots = index.reserve_fills(ns, keys[i:i + n], now)
                if slots:
                    self._promote(lower, ns, keys[i:i + len(slots)], slots, slot_bytes)
                if len(slots) < n:
                    break
                i += n
                i += index.leading(ns, keys[i:])

    def _promote(self, lower: LowerTier, ns: bytes, hashes: list[bytes], slots: list[Slot],
                 slot_bytes: int) -> None:
        done = lower.promote([ns + h for h in hashes], [s.offset for s in slots], slot_bytes)
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
        """Forget ``ns`` in every tier as the pool does (its queued slots are dropped by the
        index, so they are skipped here)."""
        return sum(lower.forget(ns) for lower in self.lowers)

    def info(self) -> list[TierInfo]:
        return [msgspec.structs.replace(lane.tier.info(), missed_blocks=lane.missed_blocks)
                for lane in self._lanes]

    async def close(self, timeout_s: float) -> None:
        """Write down what is still queued (the pool may be unlinked next), then close the
        tiers, for at most ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        flushing = [lane for lane in self._lanes if lane.tier.flushes_at_exit]
        for lane in flushing:
            self._pump(lane)
        while (any(lane.queue and lane.tier.is_enabled for lane in flushing)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        for lane in self._lanes:
            await lane.tier.close(max(0.1, deadline - time.monotonic()))
