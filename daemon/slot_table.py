"""The slot table: every slot's state, its key, its pins, and room for new slots.

Slot lifecycle (Plasma's CREATED → SEALED, with TP)::

    FREE --claim--> WRITING --every unit landed (commit)--> COMMITTED --evict/drop--> FREE
                       └── drop (abort, owner gone, timeout, failed rank) --> FREE
    FREE --claim(FILLING)--> FILLING --commit--> COMMITTED      (a lower tier brings it back)
                                └── drop --> FREE

- A WRITING or FILLING slot is mapped to its key (so a second store of the key is a duplicate)
  but only COMMITTED ones are hits; FILLING ones count as hits of a lookup that will wait for
  them. The pool record says WRITING for both, so a crash drops them.
- ``pins`` counts what holds a slot: loads and leases on committed slots, store jobs on WRITING
  ones, fills on FILLING ones, lower-tier writes. A slot dropped while pinned is *doomed*:
  unreachable at once, freed when the last pin goes.
- Evictable = COMMITTED, unpinned, not doomed. Exactly those slots sit in their size's LRU queue
  (and in their namespace's, under a quota): ``_queues`` (a batch) and ``_left_lru`` (one slot,
  queued or not) are the only places that change the queues, so choosing victims never walks a
  pinned slot.
- A committed slot leaves visibility in one place, ``_forget``: unmapped from its key, off the
  queues, off its namespace's count, and announced to the watchers (KV events, the lower tiers,
  the shared-memory index).
- Slot refs carry the slot's generation (bumped at each claim), so a stale ref never touches a
  reused slot.

Room for new slots is ``daemon/room.py``'s to find; it evicts through ``evict_many``, whose
records, counts, queues and events of a batch are written together, so a store of 1024 blocks
on a full pool pays a few C-level passes, not 1024 scans (issue 36). A load's pins and unpins
and a scheduler's hits are one pass and one call per queue each, likewise.

Runs on the daemon's event loop thread, never blocks: no I/O besides writing slot records into
the mapped pool.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from typing import Iterator, Protocol

import numpy as np

from kvpool.daemon.extents import FILLING, Extents, SizeClass, Slot
from kvpool.daemon.key_table import EMPTY, KeyTable
from kvpool.daemon.namespaces import Namespaces
from kvpool.daemon.pool import COMMITTED, FREE, GENERATION_MASK, WRITING, Pool
from kvpool.shared.protocol import make_slot_ref

__all__ = ["COMMITTED", "FILLING", "FREE", "WRITING", "Slot", "SlotTable", "SlotWatcher"]


class SlotWatcher(Protocol):
    """Told, synchronously and before any slot is reused, about blocks that became visible
    (``committed``) and blocks that stopped being visible (``removed``)."""

    def committed(self, slots: list[Slot]) -> None: ...

    def removed(self, slots: list[Slot]) -> None: ...


@dataclass
class TableStats:
    evictions: int = 0
    stored_blocks: int = 0
    adopted_blocks: int = 0


class SlotTable:
    """All slot state of one pool. Callers: the store path (``daemon/stores.py``) and the index
    (``daemon/index.py``), on the event loop thread only."""

    def __init__(self, pool: Pool, extents: Extents, namespaces: Namespaces) -> None:
        self.pool = pool
        self.extents = extents
        self.namespaces = namespaces
        self.slots = extents.slots              # slot id -> slot, read on every hot path
        self.records = extents.records          # the batch passes over slots
        # namespace -> block hash -> its WRITING, FILLING or COMMITTED slot. Per-namespace
        # key tables (daemon/key_table.py) keep a lookup to one probe per key with no key
        # concatenation.
        self.tables: dict[bytes, KeyTable] = {}
        self.writing: dict[int, Slot] = {}
        self.filling: dict[int, Slot] = {}
        self.stats = TableStats()
        self.watchers: list[SlotWatcher] = []
        self._tick = itertools.count(1)

    def watch(self, watcher: SlotWatcher) -> None:
        """Subscribe ``watcher`` to commits and removals (at its construction)."""
        self.watchers.append(watcher)

    def table_of(self, ns: bytes) -> KeyTable:
        """The key table of ``ns``, made empty where it has none."""
        table = self.tables.get(ns)
        if table is None:
            table = self.tables[ns] = KeyTable()
        return table

    def now_tick(self) -> int:
        return next(self._tick)

    # ---- adoption --------------------------------------------------------------------------

    def adopt(self) -> int:
        """Rebuild from an adopted pool's records; returns the blocks kept. WRITING records
        (stores that never finished) and records of unknown layouts are freed. Called once,
        before the server accepts requests."""
        self.namespaces.adopt()
        layouts = self.namespaces.layouts
        kept = 0
        for cls, slots in self.extents.adopt():
            recs = self.pool.records(slots[0].extent)
            adopted: list[Slot] = []
            free: list[Slot] = []
            for slot, rec in zip(slots, recs):
                key = bytes(rec["key"])
                layout = layouts.get(key[:16])
                table = self.table_of(key[:16])
                if (int(rec["state"]) == COMMITTED and layout is not None
                        and layout.slot_bytes == cls.slot_bytes and key[16:] not in table):
                    slot.state, slot.key, slot.ns = COMMITTED, key, key[:16]
                    slot.block_hash = key[16:]
                    slot.ref = make_slot_ref(slot.id, int(rec["generation"]))
                    slot.landed = layout.full_mask
                    table[key[16:]] = slot
                    adopted.append(slot)
                else:
                    if int(rec["state"]) != FREE:
                        rec["state"] = FREE
                    free.append(slot)
            self.extents.put_free(cls, free)
            if adopted:
                # each used now, and evictable (nothing pins an adopted block)
                self.records.touch(adopted, self.now_tick(), self.extents.newest_use)
                self._count_bytes_many(adopted, cls.slot_bytes)
                self._queues(adopted, "insert_many", cls=cls)
            for ns, k in _per_ns(adopted):
                self.namespaces.blocks[ns] = self.namespaces.blocks.get(ns, 0) + k
            kept += len(adopted)
        self.stats.adopted_blocks = kept
        return kept

    # ---- claims ----------------------------------------------------------------------------

    def claim(self, slots: list[Slot], ns: bytes, hashes: list[bytes], state: int, owner: int,
              deadline: float, tickets: list[int] | None = None, pin_units: int = 0) -> None:
        """Give free ``slots`` (from ``allocate``) to ``hashes`` of ``ns`` in ``state``
        (WRITING or FILLING), with new generations, mapped in the namespace's table, counted,
        and their WRITING records written in one pass before any ref of theirs leaves.
        ``pin_units``: a store job's units in flight on each, with its pin (the store path's
        ``_pin_store`` in the same pass)."""
        if not slots:
            return
        tick = self.now_tick()
        table = self.table_of(ns)
        pins = 1 if pin_units else 0
        # A FREE slot holds no pins, reads, landed units or flags and no ticket (``free`` and
        # ``evict_many`` leave it so; it is freed when its last pin or read goes), and a
        # WRITING slot's ``last_use`` is read by nothing (its commit stamps it): one pass
        # (``daemon/slot_record.py``'s ``claim``, in C where built) writes what a claim
        # changes, a store's pin and units in flight with it. (This pass was the largest piece
        # of a busy event loop's Python on an H200 host.)
        generations = self.records.claim(slots, hashes, tickets, ns, state, owner, deadline,
                                         pin_units, pins, _REF_LIMIT)
        newest = self.extents.newest_use
        for e in set(map(_EXTENT, slots)):
            newest[e] = tick
        table.put_many(hashes, slots)
        ids = list(map(_ID, slots))
        (self.writing if state == WRITING else self.filling).update(zip(ids, slots))
        self._count_bytes(ns, len(slots) * slots[0].size_class.slot_bytes)
        self.pool.write_states(ids, WRITING, generations)

    # ---- commits, pins, hits ---------------------------------------------------------------

    def commit(self, slots: list[Slot]) -> None:
        """Make landed (or filled) slots visible: records first (one vectorised write per
        extent), then the state lookups read, the queues, the counts and the watchers."""
        if not slots:
            return
        self.pool.commit_records(*self.records.record_lists(slots))
        tick = self.now_tick()
        evictable = self.records.commit(slots, tick, COMMITTED, self.writing, self.filling)
        # what the batch shares, read in one pass (nearly always one namespace and one size);
        # its evictable slots queued in one batch (two calls a slot were ~12% of a store job's
        # loop work, bench/investigations/store_job_ab.py)
        ns, cls, extent, _ = self.records.batch_of(slots)
        if evictable:
            self._queues(evictable, "insert_many", ns, cls)
        blocks = self.namespaces.blocks
        for n, k in _per_ns(slots, ns):
            blocks[n] = blocks.get(n, 0) + k
        newest = self.extents.newest_use
        for e in ((extent,) if extent >= 0 else set(map(_EXTENT, slots))):
            newest[e] = tick
        self.stats.stored_blocks += len(slots)
        for w in self.watchers:
            w.committed(slots)

    def pin(self, slots: list[Slot]) -> None:
        """Hold slots against eviction and reuse (a load copies out of them, a lease was
        given): a use of each block."""
        left = self.records.pin(slots, self.now_tick(), self.extents.newest_use, COMMITTED)
        if left:
            self._queues(left, "remove_many")

    def unpin(self, slots: list[Slot]) -> None:
        """Take back one pin of each slot; a slot whose last pin goes is freed if it was
        dropped or hidden meanwhile, else evictable again, most recently used."""
        evictable, to_free = self.records.unpin(slots, self.now_tick(), self.extents.newest_use,
                                                COMMITTED, FREE, self.extents.draining)
        # (apart: freeing a slot touches no queued one, nor does queueing a freed one)
        for s in to_free:
            self._free_unless_read(s)
        if evictable:
            self._queues(evictable, "insert_many")

    def begin_read(self, slots: list[Slot]) -> None:
        """A lower tier reads committed slots to write them down: their bytes stay until
        ``end_read``, but they keep their place in the LRU queue (a tier's write is no use of
        the block) and may still be chosen as victims: then their space waits for the read."""
        for s in slots:
            s.reads += 1

    def end_read(self, slots: list[Slot]) -> None:
        for s in slots:
            s.reads -= 1
            if not s.reads and not s.pins and s.doomed and s.state != FREE:
                self.free(s)

    def touch(self, slots: list[Slot]) -> None:
        """Hits on committed slots: most recently used."""
        queued = self.records.touch(slots, self.now_tick(), self.extents.newest_use)
        if queued:
            self._queues(queued, "touch_many")

    def offsets(self, slots: list[Slot]) -> np.ndarray:
        """The slots' pool offsets, as an int64 array a copy engine takes (one pass)."""
        return np.frombuffer(self.records.offsets(slots), np.int64)

    def _queues(self, slots: list[Slot], op: str, ns: bytes | None = None,
                cls: SizeClass | None = None) -> None:
        """``op`` (``insert_many``, ``touch_many``, ``remove_many``) on the eviction queues of
        ``slots``: their size's, and their namespace's where it has a quota; one call per
        queue, in the slots' order (a load's per-slot calls were most of its pins' cost).
        ``ns``, ``cls``: the namespace and size all of them share, where known."""
        if ns is None or cls is None:
            ns, cls, _, _ = self.records.batch_of(slots)
        for c, group in _by_class(slots, cls):
            getattr(c.lru, op)(map(_ID, group))
        quota_lrus = self.namespaces.lru
        if quota_lrus:
            per_ns = _per_ns(slots, ns)
            for n, _ in per_ns:
                own = quota_lrus.get(n)
                if own is not None:
                    getattr(own, op)(map(_ID, _in_ns(slots, n, per_ns)))

    # ---- leaving ---------------------------------------------------------------------------

    def evict_many(self, victims: list[Slot]) -> None:
        """Evict committed, unpinned slots (from the queues' heads) onto their free lists, the
        bookkeeping in batches: queues, counts, records in one pass each."""
        if not victims:
            return
        # What the batch shares, read in one pass (nearly always one namespace, one size, one
        # extent): the groupings below are then given, not walked for. A subset shares them too.
        ns, cls, extent, read = self.records.batch_of(victims)
        self._forget_many(victims, ns, cls)
        if read:
            # Being written down by a lower tier: gone from the pool now, their space once the
            # read ends (end_read frees them).
            for s in victims:
                if s.reads:
                    s.doomed = True
            self.stats.evictions += read
            victims = [s for s in victims if not s.reads]
            if not victims:
                return
        self.pool.write_states(self.records.evict(victims, FREE), FREE)
        self.stats.evictions += len(victims)
        for c, group in _by_class(victims, cls):
            self._count_bytes_many(group, -c.slot_bytes, ns)
            self.extents.release_many(c, group, extent)

    def drop(self, s: Slot) -> None:
        """Make ``s`` unreachable now (a store refused or timed out, a reset, a failed fill)
        and free it once unpinned."""
        s.doomed = True
        self._forget(s)
        if not s.pins and not s.reads:
            self.free(s)
        else:
            self.writing.pop(s.id, None)

    def hide(self, s: Slot) -> None:
        """Take a pinned committed slot out of lookups' sight; freed when its last pin goes
        (an extent being drained asks this). A load holding it still reads it."""
        self.stats.evictions += 1
        self._forget(s)

    def free(self, s: Slot) -> None:
        """Back to FREE and to its free list (or its extent's drain)."""
        self._forget(s)
        self.writing.pop(s.id, None)
        self.filling.pop(s.id, None)
        if s.state != FREE:
            self._count_bytes(s.ns, -s.size_class.slot_bytes)
        s.state = FREE
        s.doomed = s.void = False
        s.landed = s.writing = s.ticket = 0
        self.pool.write_state(s.id, FREE)
        self.extents.release(s)

    def reset(self, ns: bytes) -> int:
        """Forget every block of ``ns`` (lookups miss at once; pinned ones are freed when their
        last pin goes). Returns how many blocks were forgotten."""
        victims = list(self.tables.get(ns, EMPTY).values())
        for s in victims:
            self.drop(s)
        return len(victims)

    # ---- reading ---------------------------------------------------------------------------

    def committed_runs(self, per_run: int = 8192, pinned: bool = False
                       ) -> Iterator[list[Slot]]:
        """The committed, undoomed slots (``pinned``: the pinned ones only), extent by extent:
        a run each time about ``per_run`` slots have been looked at (so a run of the few
        pinned ones may be short, or empty), each read when it is asked for."""
        run: list[Slot] = []
        looked = 0
        for row in self.slots.rows:
            if row is None:
                continue
            run += [s for s in row if s is not None and s.state == COMMITTED and not s.doomed
                    and (s.pins or not pinned)]
            looked += len(row)
            if looked >= per_run:
                yield run
                run, looked = [], 0
        if run:
            yield run

    def pinned_count(self) -> int:
        """Committed blocks held by a lease, a load or a lower tier's read (their space is not
        free to reuse now). One pass over every slot, in C where built: the gauges' refresh
        asks every few seconds, and its Python loop held the loop ~100 ms at 522K slots."""
        return self.records.held_count(self.slots.rows, COMMITTED)

    def committed_hashes(self, ns: bytes) -> list[bytes]:
        """The block hashes of the committed blocks of ``ns``, in slot order: one pass over
        the extents' rows (in C where built), which the memory prefetcher follows. A walk of
        the namespace's key table took 0.7-0.8 s at 524K blocks (this VM), and one of its
        size's LRU queue ~40 ms once churn had scattered the queue's order over the rows."""
        return self.records.committed_hashes(self.slots.rows, ns, COMMITTED)

    def counts(self) -> tuple[int, int, int]:
        """(writing, committed, used bytes): FILLING slots count as writing."""
        committed = sum(self.namespaces.blocks.values())
        used = sum(self.namespaces.bytes_used.values())
        return len(self.writing) + len(self.filling), committed, used

    # ---- the rules -------------------------------------------------------------------------

    def _free_unless_read(self, s: Slot) -> None:
        """Free ``s`` now, or (doomed) when the lower tier reading it is done."""
        if s.reads:
            s.doomed = True
            self._forget(s)
        else:
            self.free(s)

    def _left_lru(self, s: Slot) -> None:
        s.size_class.lru.remove(s.id)
        quota_lrus = self.namespaces.lru
        if quota_lrus:
            own = quota_lrus.get(s.ns)
            if own is not None:
                own.remove(s.id)

    def _forget(self, s: Slot) -> None:
        """``s`` leaves its key: unmapped if it is still the key's slot; a committed one also
        leaves the queues and its namespace's count, and the watchers are told."""
        table = self.tables.get(s.ns)
        h = s.block_hash
        if table is None or table.get(h) is not s:
            return
        del table[h]
        if s.state == COMMITTED:
            self._left_lru(s)
            self.namespaces.blocks[s.ns] -= 1
            for w in self.watchers:
                w.removed([s])

    def _forget_many(self, victims: list[Slot], ns: bytes | None = None,
                     cls: SizeClass | None = None) -> None:
        """``_forget`` of committed, mapped, unpinned slots, in batches (``ns``, ``cls``: the
        namespace and size all of them share, where known)."""
        blocks = self.namespaces.blocks
        per_ns = _per_ns(victims, ns)
        for n, k in per_ns:
            # a committed block is its key's slot
            self.tables[n].delete_many(map(_BLOCK_HASH, _in_ns(victims, n, per_ns)))
            blocks[n] -= k
        self._queues(victims, "remove_many", ns, cls)
        for w in self.watchers:
            w.removed(victims)

    def _count_bytes(self, ns: bytes, delta: int) -> None:
        used = self.namespaces.bytes_used
        used[ns] = used.get(ns, 0) + delta

    def _count_bytes_many(self, slots: list[Slot], per_slot: int,
                          ns: bytes | None = None) -> None:
        for n, k in _per_ns(slots, ns):
            self._count_bytes(n, k * per_slot)


def _per_ns(slots: list[Slot], ns: bytes | None = None) -> list[tuple[bytes, int]]:
    """(namespace, slots of it) for ``slots`` (``ns``: the one they all share, where known):
    nearly always one namespace, found in one C-level pass (a Counter, or a generator per
    slot, cost a tenth of a store's eviction)."""
    if not slots:
        return []
    if ns is not None:
        return [(ns, len(slots))]
    names = set(map(_NS, slots))
    if len(names) == 1:
        return [(names.pop(), len(slots))]
    return list(Counter(map(_NS, slots)).items())


def _in_ns(slots: list[Slot], ns: bytes, per_ns: list[tuple[bytes, int]]) -> list[Slot]:
    """Those of ``slots`` in ``ns`` (all of them where ``per_ns`` names one namespace)."""
    return slots if len(per_ns) == 1 else [s for s in slots if s.ns == ns]


def _by_class(slots: list[Slot], cls: SizeClass | None = None
              ) -> list[tuple[SizeClass, list[Slot]]]:
    """``slots`` grouped by size class, in order (``cls``: the one they all share, where
    known; nearly always one class: one call)."""
    if cls is not None:
        return [(cls, slots)] if slots else []
    classes = set(map(_CLASS, slots))
    if len(classes) == 1:
        return [(classes.pop(), slots)]
    groups: dict[int, tuple[SizeClass, list[Slot]]] = {}
    for s in slots:
        groups.setdefault(id(s.size_class), (s.size_class, []))[1].append(s)
    return list(groups.values())


# A slot ref's generation is its upper half: a claim adds one, and past the last generation
# (at this limit) it starts again at 0 (the ref is then the slot id).
_REF_LIMIT = (GENERATION_MASK + 1) << 32

# C-level getters for batch passes over slots (a generator costs ~2x more).
_ID = attrgetter("id")
_NS = attrgetter("ns")
_BLOCK_HASH = attrgetter("block_hash")
_EXTENT = attrgetter("extent")
_CLASS = attrgetter("size_class")
