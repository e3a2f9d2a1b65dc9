"""The pool and the tiers under it: which blocks go down, and how a lower-tier hit comes up.

``Tiering`` sits between the index (``daemon/index.py``, the pool) and the ``LowerTier``s
(``daemon/tier.py``), in order: the disk tier, then the remote tier. The server calls it at
four moments: before a lookup (``probe``), during it (``held_past``), when a load starts, and
on a reset. It never copies bytes itself and never blocks the event loop.

- **Down: write-behind, oldest first, to every tier.** Every block that commits in the pool
  (stored by an engine, adopted from the previous daemon's pool, or brought up from a tier)
  joins each tier's queue in commit order, if that tier wants it; batches of it go down while
  the tier has room for more I/O, their pool slots pinned until written. So the blocks the
  pool's LRU will drop next are the ones already written, and whatever is on disk when the
  daemon stops (or the host reboots) is served by the next daemon. A block the pool evicts
  before its turn is counted (``missed_blocks``, per tier); under sustained stores faster than
  a tier, that is how the tier falls behind, never by slowing a request. The tiers are
  independent: a block goes to the disk and is published to the remote store alike.
- **A burst waits for the tiers, briefly.** A store that would have to evict blocks a tier
  has yet to write (``must_hold``) is held by the copy jobs until the tiers' writes make clean
  room, for at most ``STORE_HOLD_S``: a burst larger than the pool's clean room then loses
  nothing, where it used to push the blocks queued for the disk out before their turn. A hold
  that runs out means the tiers cannot keep up with the stores: stores stop waiting until the
  tiers have caught up (``overloaded``), and the pool drops blocks as above, so a tier slower
  than the stores never slows them by more than one hold.
- **Probe.** A tier whose index is not in memory (the remote store) is asked about the keys of
  each key list past what the pool and the tiers above it hold; the server answers the lookup
  when those probes resolve (each tier bounds its own).
- **Up: at load time, upper tiers first.** A lookup counts the blocks a tier holds past the
  pool's (``held_past``; the shared-memory index publishes the same), bringing nothing up. The
  load names each block's key, and its staging window (``fetch``, from ``daemon/loads.py``)
  gives the blocks the pool lacks FILLING slots and one ``promote`` per run of a tier, a window
  at a time; a block that fails makes that block's load fail and the engine recomputes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import msgspec

from kvpool.daemon.index import COMMITTED, FILLING, Index, Slot
from kvpool.daemon.key_table import EMPTY
from kvpool.daemon.tier import LowerTier, TierEvents
from kvpool.shared.protocol import TierInfo

if TYPE_CHECKING:
    from kvpool.daemon.index_segment import KeyLocations

log = logging.getLogger("kvpoold")

# The longest a store waits for the lower tiers to write what it would evict (see the module
# docstring): a few batches of any disk, and short beside a vLLM step's budget for its stores.
STORE_HOLD_S = 0.25

# Blocks the pool's offer to its tiers takes per turn of the loop (``Tiering._offer_pool``).
OFFER_RUN_BLOCKS = 4096


@dataclass(eq=False)
class _Lane:
    """One tier and the pool blocks waiting to go down to it."""

    tier: LowerTier
    queue: deque[tuple[Slot, int]] = field(default_factory=deque)   # (slot, generation)
    pump_scheduled: bool = False
    missed_blocks: int = 0
    offering: "asyncio.Task[None] | None" = None    # the pool's offer to it (``_offer_pool``)


class _LaneEvents(TierEvents):
    """What one tier tells the tiering: a comeback or room to write (its lane is pumped again),
    keys it serves or dropped (told to the shared-memory index, once there is one)."""

    def __init__(self, tiering: "Tiering", lane: _Lane) -> None:
        self.tiering = tiering
        self.lane = lane

    def restored(self) -> None:
        self.tiering._offer_pool([self.lane])

    def ready(self) -> None:
        self.tiering._schedule_pump(self.lane)

    def held(self, keys: list[bytes]) -> None:
        if self.tiering.locations is not None:
            self.tiering.locations.tier_holds(self.lane.tier, keys)

    def dropped(self, keys: list[bytes]) -> None:
        if self.tiering.locations is not None:
            self.tiering.locations.tier_dropped(self.lane.tier, keys)


class Tiering:
    """Callers: the server's dispatch and lifecycle, on the event loop thread only."""

    def __init__(self, index: Index, lowers: list[LowerTier]) -> None:
        self.index = index
        self.lowers = lowers
        self._lanes = [_Lane(t) for t in lowers]
        self._fills: dict[int, asyncio.Future[list[bool]]] = {}   # slot id -> its fill
        # (slot id, generation) -> how many tiers still have it queued or in flight: a block
        # the pool should not evict if it can wait (``must_hold``).
        self._dirty: Counter[tuple[int, int]] = Counter()
        # The tiers fell behind the stores (a hold ran out): no store waits until they have
        # written everything queued.
        self.overloaded = False
        # Told when a tier's write ends (the copy jobs retry the stores they hold).
        self._on_progress: Callable[[], None] | None = None
        # The shared-memory index, told what each tier holds (``observe``).
        self.locations: "KeyLocations | None" = None
        index.table.watch(self)
        for lane in self._lanes:
            lane.tier.bind(_LaneEvents(self, lane))

    def observe(self, locations: "KeyLocations") -> None:
        """Tell ``locations`` (the shared-memory index) what each tier holds now and, from then
        on, what each writes down or drops."""
        self.locations = locations
        for lane in self._lanes:
            locations.tier_holds(lane.tier, list(lane.tier.held_keys()))

    def start(self) -> None:
        """Start the tiers and offer them the pool's committed blocks (an adopted pool); call
        on the loop."""
        for lane in self._lanes:
            lane.tier.start()
        self._offer_pool(self._lanes, fresh_only=True)

    # ---- down ------------------------------------------------------------------------------

    def committed(self, slots: list[Slot]) -> None:
        """Blocks that became visible in the pool go down to every tier that wants them (the
        slot table's watcher call)."""
        for lane in self._lanes:
            self._offer(lane, slots)

    def removed(self, slots: list[Slot]) -> None:
        """Blocks that left the pool: their queued writes are skipped when reached."""

    def _offer_pool(self, lanes: list[_Lane], fresh_only: bool = False) -> None:
        """Offer the ``lanes``' tiers every committed block, oldest first (at the start, and
        to a tier back after a fault), a run per turn of the loop: the whole pool in one turn
        (a sort of every committed slot by use, then the tier's ``wants`` of each) held the
        loop ~90 ms at 130K adopted blocks over a disk tier (fill_gaps.py --restart --disk,
        this VM). A run reads its slots as they are then, and ``_pump`` skips what left.
        ``fresh_only`` (every lane at once): a block already queued for the tiers (its commit
        came after the offer began) is not offered again."""
        task = asyncio.get_running_loop().create_task(self._offer_runs(lanes, fresh_only))
        for lane in lanes:
            old, lane.offering = lane.offering, task
            if old is not None and not any(other.offering is old for other in self._lanes):
                old.cancel()

    async def _offer_runs(self, lanes: list[_Lane], fresh_only: bool) -> None:
        me, dirty = asyncio.current_task(), self._dirty
        for slots in self.index.committed_in_use_order(OFFER_RUN_BLOCKS):
            mine = [lane for lane in lanes if lane.offering is me]   # (a newer offer took one)
            if not mine:
                return
            if fresh_only:
                slots = [s for s in slots if (s.id, s.generation) not in dirty]
            for lane in mine:
                self._offer(lane, slots)
            await asyncio.sleep(0)
        for lane in lanes:
            if lane.offering is me:
                lane.offering = None

    def _offer(self, lane: _Lane, slots: list[Slot]) -> None:
        lower = lane.tier
        if not lower.is_enabled:
            return
        dirty = self._dirty
        for s in slots:
            if lower.wants(s.key, s.size_class.slot_bytes):
                lane.queue.append((s, s.generation))
                dirty[s.id, s.generation] += 1
        self._schedule_pump(lane)

    def _clean(self, s: Slot, generation: int) -> None:
        """One tier is done with ``s`` (written, skipped, or it left the pool first)."""
        key = (s.id, generation)
        left = self._dirty[key] - 1
        if left > 0:
            self._dirty[key] = left
            return
        del self._dirty[key]
        if not self._dirty and self.overloaded:
            self.overloaded = False
            log.info("lower tiers caught up: stores wait for them again when a burst would "
                     "evict blocks they have yet to write")

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
                    self._clean(s, generation)
                    lane.missed_blocks += 1
                    continue
                if batch and (s.size_class.slot_bytes != size
                              or len(batch) >= lower.batch_blocks(size)):
                    break
                queue.popleft()
                size = s.size_class.slot_bytes
                if lower.wants(s.key, size):
                    batch.append(s)
                else:
                    self._clean(s, generation)
            if not batch:
                continue
            self.index.begin_read(batch)
            done = lower.demote([s.key for s in batch], [s.offset for s in batch], size)
            done.add_done_callback(lambda _f, batch=batch: self._demoted(lane, batch))
        if not lower.is_enabled:
            for s, generation in queue:
                self._clean(s, generation)
            queue.clear()
            self._progress()

    def _demoted(self, lane: _Lane, batch: list[Slot]) -> None:
        for s in batch:           # pinned while written: still the generation queued
            self._clean(s, s.generation)
        self.index.end_read(batch)
        self._pump(lane)
        self._progress()

    def when_progress(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a tier's write ends (the copy jobs, which hold stores
        until the tiers make room, subscribe at their construction)."""
        self._on_progress = callback

    def _progress(self) -> None:
        if self._on_progress is not None:
            self._on_progress()

    @property
    def behind(self) -> bool:
        """Some tier has blocks still to write, and stores wait for the tiers (a store may
        have to be held: ``must_hold``)."""
        return bool(self._dirty) and not self.overloaded

    def must_hold(self, ns: bytes, n: int) -> bool:
        """Whether a store of ``n`` new blocks of ``ns`` should wait for the tiers: it would
        evict a block one of them has yet to write, and they keep up (not ``overloaded``). The
        pool's clean room is free slots, unassigned extents, and the unpinned blocks no tier
        waits for at the head of the LRU (looked at as far as the blocks being written and
        queued could reach, not promoting anything)."""
        if not self.behind or n <= 0:
            return False
        index = self.index
        if not index.has_layout(ns):
            return False
        extents = index.extents
        slot_bytes = index.layout_of(ns).slot_bytes
        cls = extents.size_class(slot_bytes)
        room = len(cls.free) + len(extents.free_extents) * (
            index.pool.geometry.extent_bytes // slot_bytes)
        if room >= n:
            return False
        slots, dirty = extents.slots, self._dirty
        need = n - room
        # The queue holds only unpinned blocks: the clean ones among its first are the room.
        head = cls.lru.victims(need + len(dirty) + 64)
        clean = sum(1 for sid in head if (sid, slots[sid].generation) not in dirty)
        return clean < need

    def hold_expired(self) -> None:
        """A store waited ``STORE_HOLD_S`` and the tiers did not make room: they cannot keep
        up, so stores stop waiting for them until they have caught up."""
        if not self.overloaded:
            self.overloaded = True
            log.warning("lower tiers are behind the stores (%d blocks queued): stores no longer "
                        "wait for them, and blocks the pool evicts first are counted missed",
                        sum(len(lane.queue) for lane in self._lanes))

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

    def held_past(self, ns: bytes, keys: list[bytes], start: int) -> list[int]:
        """A round-trip lookup's hits past the pool's leading run (``keys[start:]``): per key
        from there on, while the pool or an enabled tier holds it, its slot ref, 0 where a lower
        tier holds it. Nothing is brought up and nothing pinned: the load names each block's key
        and its staging window brings up what the pool lacks, as for hits read in the
        shared-memory index, so a run larger than the pool is served in order, not cut."""
        index = self.index
        lowers = [t for t in self.lowers if t.is_enabled]
        if not lowers or start >= len(keys) or not index.has_layout(ns):
            return []
        slot_bytes = index.layout_of(ns).slot_bytes
        get = index.table.tables.get(ns, EMPTY).get
        refs: list[int] = []
        i = start
        while i < len(keys):
            s = get(keys[i])
            if s is not None and (s.state == COMMITTED or s.state == FILLING) and not s.doomed:
                refs.append(s.ref)
                i += 1
                continue
            n = next((n for n in (t.leading(ns, keys[i:], slot_bytes) for t in lowers) if n), 0)
            if not n:
                break
            refs += [0] * n         # a key of the run the pool holds too: the load finds it
            i += n
        return refs

    def fetch(self, ns: bytes, hashes: list[bytes], now: float
              ) -> tuple[list[Slot | None], bool]:
        """Bring blocks of ``ns`` the pool lacks up from the first tier that holds each (a
        load's staging window, ``daemon/loads.py``): per hash, a FILLING slot (pinned by its
        fill until it lands; ``pending`` gives what to wait for), or None where no enabled tier
        holds it or the pool had no room; and whether it ran out of room (a tier held a block
        it found no slot for). Consecutive hashes of one tier share one promote."""
        index = self.index
        out: list[Slot | None] = [None] * len(hashes)
        lowers = [t for t in self.lowers if t.is_enabled]
        if not lowers or not index.has_layout(ns):
            return out, False
        slot_bytes = index.layout_of(ns).slot_bytes
        in_pool = index.table.tables.get(ns, EMPTY)
        i = 0
        while i < len(hashes):
            lower = None if hashes[i] in in_pool else next(
                (t for t in lowers if t.leading(ns, hashes[i:i + 1], slot_bytes)), None)
            if lower is None:       # held by no tier (or being written into the pool)
                i += 1
                continue
            n = max(1, lower.leading(ns, hashes[i:], slot_bytes))
            run = hashes[i:i + n]
            slots = index.reserve_fills(ns, run, now)
            if slots:
                self._promote(lower, ns, run[:len(slots)], slots, slot_bytes)
                out[i:i + len(slots)] = slots
            if len(slots) < n:
                if not slots:
                    return out, True    # no room left in the pool for more
                i += len(slots)
                continue
            i += n
        return out, False

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
        for lane in self._lanes:
            if lane.offering is not None:
                lane.offering.cancel()
                lane.offering = None
        flushing = [lane for lane in self._lanes if lane.tier.flushes_at_exit]
        for lane in flushing:
            self._pump(lane)
        while (any(lane.queue and lane.tier.is_enabled for lane in flushing)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        for lane in self._lanes:
            await lane.tier.close(max(0.1, deadline - time.monotonic()))
