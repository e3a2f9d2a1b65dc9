"""The block index: the pool's namespaces, slot table and store path, and the read side on top
of them (lookups, leases, loads, fills from a lower tier) and housekeeping.

``Index`` builds its parts at construction and hands each its collaborators: ``Namespaces``
(``daemon/namespaces.py``: layouts, quotas, usage), ``Extents`` (``daemon/extents.py``: space),
``SlotTable`` (``daemon/slot_table.py``: every slot's state, the LRU), ``Room``
(``daemon/room.py``: where new slots come from), ``StorePath``
(``daemon/stores.py``: reservations and keyed stores). The server and the copy jobs call the
index; the parts never call it back.

- Lookups answered here are the round-trip kind (a client that cannot map the shared-memory
  index, a probe of a lower tier): with ``pin`` each hit run is held by a *lease* until released
  or expired; what lower tiers hold past it counts too, unpinned, ref 0 (their load brings it
  up). Schedulers that map the index read hits there and take no lease (issue 37).
- A load pins its slots for its copy. FILLING is a slot a lower tier is bringing back
  (``daemon/tiering.py``): a lookup counts it as a hit and a load may name it, but the copy
  must wait for ``end_fill``.

Everything runs on the daemon's event loop thread and never blocks. Time is passed in (``now``)
so tests control it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvpool.daemon.extents import FILLING, Extents, SizeClass, Slot
from kvpool.daemon.key_table import EMPTY
from kvpool.daemon.namespaces import Namespaces
from kvpool.daemon.pool import COMMITTED, Pool
from kvpool.daemon.room import Room
from kvpool.daemon.slot_table import SlotTable
from kvpool.daemon.stores import OpenedStore, StorePath
from kvpool.shared.errors import LeaseExpired, OutOfRange

__all__ = ["COMMITTED", "FILLING", "Index", "OpenedStore", "Slot"]


@dataclass(slots=True)
class Lease:
    owner: int
    slots: list[Slot]
    expires: float


@dataclass
class LookupStats:
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    loaded_blocks: int = 0
    stale_blocks: int = 0       # load refs whose slot was evicted or reused since the lookup


class Index:
    """All block state of one pool. Callers: the server's dispatch, the copy jobs and the
    tiering (event-loop thread only)."""

    def __init__(self, pool: Pool, lease_ttl_s: float, write_timeout_s: float,
                 namespace_quota: int = 0, reserve_ttl_s: float = 10.0,
                 defer_claims: bool = True, on_new_slots: Callable[[], None] | None = None
                 ) -> None:
        self.pool = pool
        self.lease_ttl_s = lease_ttl_s
        self.write_timeout_s = write_timeout_s
        self.namespaces = Namespaces(pool, namespace_quota)
        self.extents = Extents(pool, on_new_slots=on_new_slots)
        self.table = SlotTable(pool, self.extents, self.namespaces)
        self.room = Room(self.table, self.extents, self.namespaces)
        self.stores = StorePath(self.table, self.room, self.namespaces, pool, write_timeout_s,
                                reserve_ttl_s, defer_claims)
        self.stats = LookupStats()
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)

    # ---- namespaces and stores (the parts' own calls, for the server) ----------------------

    def register_namespace(self, ns: bytes, layout, quota_bytes: int = 0) -> None:
        """See ``Namespaces.register``: the namespace's evictable blocks seed a new quota's
        queue (found only then: a registration of a namespace of 130K blocks sorted them all,
        300 ms of the loop, with no quota to seed)."""
        self.namespaces.register(ns, layout, quota_bytes,
                                 lambda: [s.id for s in self._evictable_of(ns)])

    def _evictable_of(self, ns: bytes) -> list[Slot]:
        """The evictable slots of ``ns``, least recently used first: its size's queue holds
        every evictable slot in that order, so a filter of it, not a sort; one pass over the
        queue's ids (in C where built)."""
        cls = self.extents.classes.get(self.namespaces.layout_of(ns).slot_bytes)
        if cls is None or not len(cls.lru):
            return []
        return self.table.slots.of_namespace(cls.lru.order(), ns)

    def reserve(self, ns: bytes, count: int, owner: int, now: float) -> list[int]:
        return self.stores.reserve(ns, count, owner, now)

    def open_store(self, ns: bytes, refs: list[int], keys: list[bytes], rank: int,
                   mask: int | None = None, now: float = 0.0, head: int = 0) -> OpenedStore:
        return self.stores.open_store(ns, refs, keys, rank, mask, now, head)

    def begin_store(self, ns: bytes, refs: list[int], keys: list[bytes], rank: int,
                    mask: int | None = None, now: float = 0.0) -> list[Slot]:
        """``open_store`` with its ``finish`` done at once (tests and tools; the copy jobs
        start the copy in between)."""
        job = self.stores.open_store(ns, refs, keys, rank, mask, now)
        if job.finish is not None:
            job.finish()
        return job.slots

    def end_store(self, slots: list[Slot], rank: int, ok: bool, mask: int | None = None) -> int:
        return self.stores.end_store(slots, rank, ok, mask)

    def abort_store(self, refs: list[int], owner: int) -> int:
        return self.stores.abort(refs, owner)

    def layout_of(self, ns: bytes):
        return self.namespaces.layout_of(ns)

    def has_layout(self, ns: bytes) -> bool:
        return self.namespaces.has_layout(ns)

    def block_tokens(self, ns: bytes) -> int:
        return self.namespaces.block_tokens(ns)

    # ---- adoption --------------------------------------------------------------------------

    def adopt(self) -> int:
        """Rebuild the index from an adopted pool's tables; returns the blocks kept."""
        return self.table.adopt()

    # ---- lookups and leases ----------------------------------------------------------------

    def lookup(self, ns: bytes, key_lists: list[list[bytes]], pin: bool, owner: int,
               now: float, beyond: Callable[[bytes, list[bytes], int], list[int]] | None = None
               ) -> tuple[list[int], list[int], list[list[int]]]:
        """Leading committed (or filling) hits per key list, as slot refs; with ``pin``, each
        hit run under a new lease. Hits become most recently used. ``beyond(ns, keys, n)``
        (the lower tiers' ``held_past``) extends a list's run past its first ``n`` with refs
        that are neither pinned nor touched (0: a lower tier holds the block)."""
        shards = self.table.tables.get(ns, EMPTY).shards
        walk = self.table.records.leading
        hits, leases, refs = [], [], []
        found: list[Slot] = []
        n_keys = n_beyond = 0
        committed, filling = COMMITTED, FILLING
        for keys in key_lists:
            run, run_refs = walk(shards, keys, committed, filling)
            more = beyond(ns, keys, len(run)) if beyond is not None else []
            hits.append(len(run) + len(more))
            n_keys += len(keys)
            n_beyond += len(more)
            refs.append(run_refs + more if more else run_refs)
            found += run
            if pin and run:
                self.table.pin(run)
                lease_id = next(self._lease_ids)
                self._leases[lease_id] = Lease(owner, run, now + self.lease_ttl_s)
                leases.append(lease_id)
            else:
                leases.append(0)
        self.table.touch([s for s in found if s.state == committed])
        hit_blocks = len(found) + n_beyond
        self.count_lookup(ns, hit_blocks, n_keys - hit_blocks)
        return hits, leases, refs

    def touch(self, ns: bytes, hashes: list[bytes]) -> int:
        """Hits a scheduler read in the shared-memory index: those the pool still holds
        become most recently used, as a round-trip lookup's would. Returns how many."""
        found = self.table.tables.get(ns, EMPTY).find(hashes)
        held = [s for s in found if s is not None and s.state == COMMITTED]
        self.table.touch(held)
        return len(held)

    def count_lookup(self, ns: bytes, hit_blocks: int, miss_blocks: int) -> None:
        """Count hits and misses (a round-trip lookup's, or those a scheduler read in the
        shared-memory index and reported)."""
        st = self.stats
        block_tokens = self.namespaces.block_tokens(ns)
        st.hit_blocks += hit_blocks
        st.miss_blocks += miss_blocks
        st.hit_tokens += hit_blocks * block_tokens
        st.miss_tokens += miss_blocks * block_tokens

    def release_leases(self, lease_ids: list[int], owner: int) -> int:
        """Unpin leases of ``owner``; unknown or already released ids are skipped (releasing
        twice is how exit paths race each other, and harmless). Returns how many were live."""
        n = 0
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is not None and lease.owner == owner:
                del self._leases[lid]
                self.table.unpin(lease.slots)
                n += 1
        return n

    def leading(self, ns: bytes, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first on, a lookup would count as hits now
        (COMMITTED or FILLING). Changes nothing."""
        get = self.table.tables.get(ns, EMPTY).get
        n = 0
        for k in keys:
            s = get(k)
            if s is None or (s.state != COMMITTED and s.state != FILLING):
                break
            n += 1
        return n

    def committed_hashes(self, ns: bytes) -> list[bytes]:
        """Block hashes of the committed blocks of ``ns`` (for the KV event feed of an engine
        that starts or stops being able to load them), in slot order: a router keeps a set,
        and an order of use cost the loop a pass over the LRU queue that missed the cache at
        every slot. O(slots of the pool) in one C pass: ~11 ms at 524K slots (this VM)."""
        if not self.table.tables.get(ns, EMPTY):
            return []
        return self.table.committed_hashes(ns)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def leases_of(self, owner: int) -> int:
        return sum(1 for lease in self._leases.values() if lease.owner == owner)

    # ---- loads -----------------------------------------------------------------------------

    def resolve_load(self, ns: bytes, refs: list[int], keys: list[bytes]
                     ) -> list[Slot | None]:
        """Per block of a load job, the slot to copy from: its ref's slot while that still
        holds the block (committed or filling, of ``ns``), else, with ``keys``, the slot the
        pool holds its key in now, else None (evicted since the lookup: counted stale).
        ``OutOfRange`` (nothing changed) for a ref that names no slot of this pool; 0 names
        none. Pins nothing: the caller pins what it copies before the loop turns."""
        committed, filling = COMMITTED, FILLING
        by_id = self.table.slots
        out, redo = self.table.records.resolve(refs, by_id.rows, by_id.stride, ns, committed,
                                               filling)
        if redo:
            for i in redo:
                if (refs[i] & 0xFFFF_FFFF) >= self.pool.slot_ids:
                    raise OutOfRange(f"slot ref {refs[i]:#x} names no slot of this pool")
            table = self.table.tables.get(ns, EMPTY)
            for i in redo:
                s = table.get(keys[i]) if keys else None
                if s is not None and (s.state == committed or s.state == filling) \
                        and not s.doomed:
                    out[i] = s
                elif refs[i]:
                    self.stats.stale_blocks += 1
        return out

    def begin_load(self, ns: bytes, refs: list[int]) -> list[Slot]:
        """Validate a load job's slots (committed, same namespace as at lookup) and pin them;
        all or nothing."""
        slots = self.check_load(ns, refs)
        self.table.pin(slots)
        return slots

    def check_load(self, ns: bytes, refs: list[int]) -> list[Slot]:
        """``begin_load`` less its pins, which the caller (the copy jobs) must take with
        ``pin`` once it has handed the copy to its engine, before it gives the event loop back
        (until then nothing else runs there, so nothing can evict or reuse the slots)."""
        get = self.table.slots.get
        slots = [get(ref & 0xFFFF_FFFF) for ref in refs]
        committed, filling = COMMITTED, FILLING
        for s, ref in zip(slots, refs):
            if (s is None or s.ref != ref or (s.state != committed and s.state != filling)
                    or s.doomed or s.ns != ns):
                return self._check_load(ns, refs)
        return slots                  # type: ignore[return-value]

    def _check_load(self, ns: bytes, refs: list[int]) -> list[Slot]:
        """``check_load``'s checks one slot at a time, each failure with its own error."""
        out = []
        for ref in refs:
            s = self.table.slots.get(ref & 0xFFFF_FFFF)
            if s is None and (ref & 0xFFFF_FFFF) >= self.pool.slot_ids:
                raise OutOfRange(f"slot ref {ref:#x} names no slot of this pool")
            if (s is None or s.ref != ref or (s.state != COMMITTED and s.state != FILLING)
                    or s.doomed or s.ns != ns):
                raise LeaseExpired(f"slot ref {ref:#x} was evicted or replaced since the lookup "
                                   f"(hold a lease from lookup(pin=True) until the load ends)")
            out.append(s)
        return out

    def pin(self, slots: list[Slot]) -> None:
        self.table.pin(slots)

    def unpin(self, slots: list[Slot]) -> None:
        self.table.unpin(slots)

    def begin_read(self, slots: list[Slot]) -> None:
        """A lower tier reads these committed slots (see ``SlotTable.begin_read``)."""
        self.table.begin_read(slots)

    def end_read(self, slots: list[Slot]) -> None:
        self.table.end_read(slots)

    def end_load(self, slots: list[Slot], ok: bool) -> None:
        if ok:
            self.stats.loaded_blocks += len(slots)
        self.table.unpin(slots)

    @staticmethod
    def is_loadable(slots: list[Slot]) -> bool:
        """Whether every slot holds committed bytes (a FILLING one has not landed yet, or its
        fill failed)."""
        return all(s.state == COMMITTED and not s.doomed for s in slots)

    # ---- fills from a lower tier (daemon/tiering.py) ---------------------------------------

    def reserve_fills(self, ns: bytes, keys: list[bytes], now: float) -> list[Slot]:
        """FILLING slots for the leading ``keys`` of ``ns`` (none of them mapped), pinned until
        ``end_fill``; fewer (possibly none) where the pool or the quota has no room left."""
        layout = self.namespaces.layout_of(ns)
        table = self.table.table_of(ns)
        n = 0
        for k in keys:
            if k in table:
                break
            n += 1
        cls: SizeClass = self.extents.size_class(layout.slot_bytes)
        slots = self.room.allocate(cls, self.room.fit_quota(ns, cls.slot_bytes, n))
        self.table.claim(slots, ns, keys[:len(slots)], FILLING, 0, now)
        for s in slots:
            s.pins = 1
        return slots

    def end_fill(self, slots: list[Slot], ok: list[bool]) -> None:
        """The fill of ``slots`` ended: those with ``ok`` (and not reset meanwhile) commit, the
        others are dropped; the fill's pins go."""
        ready = []
        for s, good in zip(slots, ok):
            if s.doomed:
                continue
            if good:
                ready.append(s)
            else:
                self.table.drop(s)
        self.table.commit(ready)
        self.table.unpin(slots)

    def committed_in_use_order(self, per_run: int = 4096) -> Iterator[list[Slot]]:
        """The committed blocks, run by run, each read when it is asked for: every size's
        evictable ones least recently used first (its LRU queue's ids, taken at the first
        ask), then the pinned ones. No sort, and a caller may let the loop run between runs:
        a slot that changed meanwhile comes as it is then, or not at all once it is no
        longer committed (one pinned meanwhile may come twice)."""
        orders = [cls.lru.order() for cls in self.extents.classes.values()]
        get = self.table.slots.get
        for order in orders:
            ids = memoryview(order).cast("q")
            for i in range(0, len(ids), per_run):
                run = [s for s in map(get, ids[i:i + per_run].tolist()) if s is not None
                       and s.state == COMMITTED and not s.doomed]
                if run:
                    yield run
        yield from self.table.committed_runs(per_run, pinned=True)

    # ---- housekeeping ----------------------------------------------------------------------

    def expire(self, now: float) -> tuple[int, int, int]:
        """Drop leases past their TTL, slots being written past their write timeout and
        tickets past their reservation TTL; returns how many of each. Called by the server's
        housekeeping loop."""
        dead = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in dead:
            self.table.unpin(self._leases.pop(lid).slots)
        late = [s for s in self.table.writing.values() if s.deadline <= now]
        for s in late:
            self.table.drop(s)
        voids, unused = self.stores.expire(now)
        return len(dead), len(late) + voids, unused

    def release_owner(self, owner: int) -> None:
        """Everything a vanished client held (the server's disconnect and timeout paths): its
        leases, the slots its stores were writing, its tickets and voids."""
        self.release_leases([lid for lid, lease in self._leases.items() if lease.owner == owner],
                            owner)
        for s in [s for s in self.table.writing.values() if s.owner == owner]:
            self.table.drop(s)
        self.stores.release_owner(owner)

    def reset(self, ns: bytes) -> int:
        """Forget every block of ``ns``: lookups miss at once; pinned ones are freed when their
        last pin goes. Returns how many blocks were forgotten."""
        return self.table.reset(ns)

    def slot_counts(self) -> tuple[int, int, int]:
        """(writing, committed, used bytes); tickets take none."""
        return self.table.counts()

    def pinned_count(self) -> int:
        return self.table.pinned_count()

    @property
    def ticket_count(self) -> int:
        return self.stores.ticket_count

    @property
    def tickets(self):
        return self.stores.tickets
