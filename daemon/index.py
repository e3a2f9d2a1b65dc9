"""The block index: key → slot, slot states, per-rank landing, leases, owners, tickets.

Everything here runs on the daemon's event loop thread and never blocks: no I/O besides writing
slot records into the mapped pool, no waiting. Time is passed in (``now``) so tests control it.

Slot lifecycle (Plasma's CREATED → SEALED, with TP):

    FREE --prepare_store--> WRITING --every unit landed--> COMMITTED --evict/reset--> FREE
                               └── abort / owner gone / write timeout / failed rank --> FREE
    FREE --reserve_fills--> FILLING --end_fill(ok)--> COMMITTED
                               └── end_fill(failed) / reset --> FREE
    ticket --first rank's keyed store--> FREE --(allocated)--> WRITING (bound to its key)
       └── abort / owner gone / reservation TTL --> gone (it never held a slot)

- A WRITING slot is invisible to lookups; it becomes COMMITTED only when every unit of its
  layout has landed (``Layout.full_mask``: every KV head of a head-split layout, whatever TP
  size wrote them; every rank's shard of a rank-sharded one), so a partial store is never
  visible. Stores name the units they land as a bit mask (``Layout.rank_mask``).
- ``pins`` counts leases and in-flight jobs. Eviction takes only COMMITTED, unpinned slots.
  A slot dropped while pinned is *doomed*: unreachable at once, freed when the last pin goes.
- Slot refs carry the slot's generation, so a stale ref never touches a reused slot.
- A reservation (``reserve``) is a *ticket*: a ref handed to a scheduler ahead of its stores,
  bound to nothing, taking no pool space and evicting nothing (a scheduler's stock for a few
  steps of stores must not push committed blocks out: with slots claimed at ``reserve``, a full
  64 MiB pool lost 505 of its 3968 blocks to each client's stock). The scheduler assigns a
  ticket to a key without asking; the first rank's store (``open_store`` with keys) gives it a
  slot for its key, evicting as ``prepare_store`` would and applying the namespace's quota, or
  makes it *void* (``Slot.void``, a placeholder outside the pool): a duplicate (its key is
  held, being written or named twice in the job) or a block with no room (every slot written
  or pinned, or the quota's own blocks all pinned; ``IndexStats.no_room_blocks``). A void
  ticket is written by no rank (the server skips its copy) and forgotten once every rank has
  reported it. Later ranks naming the ticket get what the first one bound, so dedup happens
  at bind time, in one place, and a key is never visible twice nor torn. Ticket refs are slot
  refs whose index lies above every slot id of the pool, with a generation (``daemon/tickets.py``),
  so they never name a slot and a stale one is refused. Unused tickets expire after
  ``reserve_ttl_s``; a restarted daemon knows none (they never touched a pool record).
- FILLING is a slot a lower tier is bringing back (``daemon/tiering.py``): lookups count it
  as a hit and loads may name it, but the caller must not copy out of it before ``end_fill``.
  It is pinned by its fill, recorded as WRITING in the pool (a crash drops it), and becomes
  COMMITTED like a store. The index knows nothing of where the bytes come from.

Space: the extents, free lists and the search for room (eviction, taking an idle size's extent,
draining one) are ``daemon/extents.py``'s; it asks this module to evict, hide or drop a slot.

Quotas: a namespace may have a byte cap (declared by its engines, bounded by the daemon's
``namespace_quota``). Its prepared and committed slots count against it; a store that would pass
it evicts that namespace's own least recently used blocks first, never another namespace's, and
gets ``SLOT_NO_SPACE`` when none of its own can go. A quota is a cap, not a reservation: pool-wide
pressure still evicts by the pool-wide LRU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.extents import FILLING, Extents, SizeClass, Slot
from kvpool.daemon.namespaces import EMPTY_TABLE, NamespaceTable
from kvpool.daemon.pool import COMMITTED, FREE, Pool
from kvpool.daemon.stores import OVER_QUOTA, OpenedStore, StorePath
from kvpool.daemon.tickets import Tickets
from kvpool.shared.errors import LeaseExpired, OutOfRange
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import make_slot_ref

__all__ = ["COMMITTED", "FILLING", "Index", "OpenedStore", "Slot"]


@dataclass(slots=True)
class Lease:
    owner: int
    slots: list[Slot]
    expires: float


@dataclass
class IndexStats:
    hit_blocks: int = 0
    miss_blocks: int = 0
    evictions: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    adopted_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    duplicate_blocks: int = 0   # tickets bound to a key already held (void: never written)
    no_room_blocks: int = 0     # tickets that found no slot (all written or pinned): not stored


class Index(NamespaceTable, StorePath):
    """All slot state. Callers: the server's dispatch (event-loop thread only). Its
    namespaces (``daemon/namespaces.py``) and its store path (``daemon/stores.py``) are in
    base classes of their own; lookups, leases, loads, fills, housekeeping and the slot state
    transitions are here."""

    def __init__(self, pool: Pool, lease_ttl_s: float, write_timeout_s: float,
                 namespace_quota: int = 0, reserve_ttl_s: float = 10.0) -> None:
        self.pool = pool
        self.namespace_quota = namespace_quota
        self.lease_ttl_s = lease_ttl_s
        self.write_timeout_s = write_timeout_s
        self.reserve_ttl_s = reserve_ttl_s
        self.tickets = Tickets(pool.geometry.num_extents * pool.slot_id_stride)
        # Tickets a first rank bound -> the slot (or void placeholder) later ranks must get,
        # until that slot leaves WRITING.
        self._bound: dict[int, Slot] = {}
        self.stats = IndexStats()
        self.extents = Extents(pool, self._evict, self._hide, self._drop)
        self._slots = self.extents.slots      # slot id -> slot, read on every hot path
        # namespace -> block hash -> slot (WRITING or COMMITTED). Per-namespace tables keep a
        # lookup to one dict probe per key with no key concatenation.
        self._tables: dict[bytes, dict[bytes, Slot]] = {}
        self._writing: dict[int, Slot] = {}
        self._layouts: dict[bytes, Layout] = {}
        # Space per namespace: bytes of its WRITING and COMMITTED slots; for namespaces with a
        # quota, the cap and an LRU of their own committed slots (the victims the cap may take).
        self._ns_bytes: dict[bytes, int] = {}
        self._ns_blocks: dict[bytes, int] = {}      # committed blocks per namespace
        self._quota: dict[bytes, int] = {}
        self._ns_lru: dict[bytes, LruPolicy] = {}
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._tick = itertools.count(1)
        self._filling: dict[int, Slot] = {}
        # (kind, ns, block hash) for the KV event publisher; None when nobody listens.
        self.events: list[tuple[str, bytes, bytes]] | None = None
        # Told about every batch of slots that became COMMITTED (the lower tiers' feed).
        self.on_commit: Callable[[list[Slot]], None] | None = None

    # ---- adoption --------------------------------------------------------------------------

    def adopt(self) -> int:
        """Rebuild the index from an adopted pool's tables; returns the blocks kept.

        WRITING records (stores that never finished) and records of unknown layouts are freed.
        Called once, before the server accepts requests.
        """
        pool = self.pool
        self._layouts = pool.load_layouts()
        kept = 0
        for cls, slots in self.extents.adopt():
            slot_bytes = cls.slot_bytes
            recs = pool.records(slots[0].extent)
            for slot, rec in zip(slots, recs):
                key = bytes(rec["key"])
                layout = self._layouts.get(key[:16])
                table = self._tables.setdefault(key[:16], {})
                if (int(rec["state"]) == COMMITTED and layout is not None
                        and layout.slot_bytes == slot_bytes and key[16:] not in table):
                    slot.state, slot.key, slot.ns = COMMITTED, key, key[:16]
                    slot.generation = int(rec["generation"])
                    slot.ref = make_slot_ref(slot.id, slot.generation)
                    slot.landed = layout.full_mask
                    slot.last_use = next(self._tick)
                    table[key[16:]] = slot
                    cls.lru.insert(slot.id)
                    self._ns_bytes[slot.ns] = self._ns_bytes.get(slot.ns, 0) + slot_bytes
                    self._ns_blocks[slot.ns] = self._ns_blocks.get(slot.ns, 0) + 1
                    kept += 1
                else:
                    if int(rec["state"]) != FREE:
                        rec["state"] = FREE
                    cls.free.append(slot)
            cls.free.reverse()
        self.stats.adopted_blocks = kept
        return kept

    # ---- lookups and leases ----------------------------------------------------------------

    def lookup(self, ns: bytes, key_lists: list[list[bytes]], pin: bool, owner: int,
               now: float) -> tuple[list[int], list[int], list[list[int]]]:
        """Leading committed hits per key list; with ``pin``, each hit run under a new lease.

        Hit slots become most recently used (stamped here, reordered lazily by the LRU when it
        next looks for victims, so a hit costs one attribute write).
        """
        get = self._tables.get(ns, EMPTY_TABLE).get
        tick = next(self._tick)
        hits, leases, refs = [], [], []
        n_hit = n_keys = 0
        # One pass per key list, in the order a prefix is read: the per-key Python here is
        # most of a lookup's cost in the daemon (256 keys: 27 -> 22 us as three passes became
        # one). Hits run until the first key that is absent or neither COMMITTED nor FILLING.
        committed, filling = COMMITTED, FILLING
        for keys in key_lists:
            run: list = []            # slot refs of the hit run; with ``pin``, its slots
            add = run.append
            for k in keys:
                s = get(k)
                if s is None or (s.state != committed and s.state != filling):
                    break
                s.last_use = tick     # the LRU promotes stamped slots when it next scans
                add(s if pin else s.ref)
            n = len(run)
            hits.append(n)
            n_hit += n
            n_keys += len(keys)
            if pin and n:
                refs.append([s.ref for s in run])
                lease_id = next(self._lease_ids)
                for s in run:
                    s.pins += 1
                self._leases[lease_id] = Lease(owner, run, now + self.lease_ttl_s)
                leases.append(lease_id)
            else:
                refs.append(run)
                leases.append(0)
        self.stats.hit_blocks += n_hit
        self.stats.miss_blocks += n_keys - n_hit
        block_tokens = self.block_tokens(ns)
        self.stats.hit_tokens += n_hit * block_tokens
        self.stats.miss_tokens += (n_keys - n_hit) * block_tokens
        return hits, leases, refs

    def release_leases(self, lease_ids: list[int], owner: int) -> int:
        """Unpin leases of ``owner``; unknown or already released ids are skipped (releasing
        twice is how exit paths race each other, and harmless). Returns how many were live."""
        n = 0
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is not None and lease.owner == owner:
                del self._leases[lid]
                self._unpin(lease.slots)
                n += 1
        return n

    def block_tokens(self, ns: bytes) -> int:
        """Tokens per block of ``ns``; 0 for a namespace no worker registered yet."""
        layout = self._layouts.get(ns)
        return layout.block_tokens if layout is not None else 0

    def leading(self, ns: bytes, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first on, a lookup would count as hits now
        (COMMITTED or FILLING). Changes nothing."""
        get = self._tables.get(ns, EMPTY_TABLE).get
        n = 0
        for k in keys:
            s = get(k)
            if s is None or (s.state != COMMITTED and s.state != FILLING):
                break
            n += 1
        return n

    def committed_hashes(self, ns: bytes) -> list[bytes]:
        """Block hashes of the committed blocks of ``ns`` (for the KV event feed of an engine
        that starts or stops being able to load them). O(blocks of ns)."""
        return [h for h, s in self._tables.get(ns, EMPTY_TABLE).items() if s.state == COMMITTED]

    def pinned_count(self) -> int:
        """Committed blocks held by a lease or an in-flight load (not evictable now)."""
        return sum(1 for s in self._slots.values() if s.state == COMMITTED and s.pins > 0)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def leases_of(self, owner: int) -> int:
        return sum(1 for lease in self._leases.values() if lease.owner == owner)

    # ---- loads -----------------------------------------------------------------------------

    def begin_load(self, ns: bytes, refs: list[int]) -> list[Slot]:
        """Validate a load job's slots (committed, same tenancy as at lookup) and pin them;
        all or nothing."""
        slots = self.check_load(ns, refs)
        self.pin(slots)
        return slots

    def check_load(self, ns: bytes, refs: list[int]) -> list[Slot]:
        """``begin_load`` less its pins, which the caller (the server's dispatch) must take
        with ``pin`` once it has handed the copy to its engine, before it gives the event loop
        back (until then nothing else runs there, so nothing can evict or reuse the slots). A
        big load's copy starts after one pass that changes nothing (a 2 GiB load's 1024 slots:
        ~150 us on a 2-core host; the pins take ~40 more)."""
        get = self._slots.get
        slots = [get(ref & 0xFFFF_FFFF) for ref in refs]
        committed, filling = COMMITTED, FILLING
        # (A committed or filling slot's ``ns`` is its key's namespace.)
        for s, ref in zip(slots, refs):
            if (s is None or s.ref != ref or (s.state != committed and s.state != filling)
                    or s.doomed or s.ns != ns):
                return self._check_load(ns, refs)
        return slots

    def _check_load(self, ns: bytes, refs: list[int]) -> list[Slot]:
        """``check_load``'s checks one slot at a time, each failure with its own error."""
        slots = []
        for ref in refs:
            s = self._resolve(ref)
            if s is None:
                raise OutOfRange(f"slot ref {ref:#x} names no slot of this pool")
            if (s.state != COMMITTED and s.state != FILLING) or s.doomed or s.key[:16] != ns:
                raise LeaseExpired(f"slot ref {ref:#x} was evicted or replaced since the lookup "
                                   f"(hold a lease from lookup(pin=True) until the load ends)")
            slots.append(s)
        return slots

    def end_load(self, slots: list[Slot], ok: bool) -> None:
        if ok:
            self.stats.loaded_blocks += len(slots)
        self._unpin(slots)

    @staticmethod
    def is_loadable(slots: list[Slot]) -> bool:
        """Whether every slot holds committed bytes (a FILLING one has not landed yet, or its
        fill failed)."""
        return all(s.state == COMMITTED and not s.doomed for s in slots)

    # ---- fills from a lower tier and pins for it (daemon/tiering.py) -----------------------

    def reserve_fills(self, ns: bytes, keys: list[bytes], now: float) -> list[Slot]:
        """FILLING slots for the leading ``keys`` of ``ns`` (none of them mapped), pinned until
        ``end_fill``; fewer (possibly none) where the pool or the quota has no room left."""
        layout = self.layout_of(ns)
        table = self._tables.setdefault(ns, {})
        quota = self._quota.get(ns, 0)
        out: list[Slot] = []
        try:
            for k in keys:
                if k in table:
                    break
                s = self._claim(ns, table, k, layout.slot_bytes, quota)
                if s is None or s is OVER_QUOTA:
                    break
                s.state = FILLING
                s.pins = 1
                s.deadline = now
                self._filling[s.id] = s
                out.append(s)
        finally:
            self._record_claims(out)
        return out

    def end_fill(self, slots: list[Slot], ok: list[bool]) -> None:
        """The fill of ``slots`` ended: those with ``ok`` (and not reset meanwhile) commit, the
        others are dropped; the fill's pins go."""
        ready = []
        for s, good in zip(slots, ok):
            self._filling.pop(s.id, None)
            if s.doomed:
                continue
            if good:
                ready.append(s)
            else:
                self._drop(s)
        if ready:
            self._commit(ready)
        self._unpin(slots)

    def pin(self, slots: list[Slot]) -> None:
        """Hold committed slots against eviction and reuse (a lower tier reads them, a load
        copies out of them)."""
        for s in slots:
            s.pins += 1

    def unpin(self, slots: list[Slot]) -> None:
        self._unpin(slots)

    def committed_slots(self) -> list[Slot]:
        """Every committed slot, least recently used first (for a lower tier to take in)."""
        return sorted((s for s in self._slots.values() if s.state == COMMITTED and not s.doomed),
                      key=lambda s: s.last_use)

    # ---- housekeeping ----------------------------------------------------------------------

    def expire(self, now: float) -> tuple[int, int, int]:
        """Drop leases past their TTL, prepared or bound slots past their write timeout and
        tickets past their reservation TTL; returns how many of each. Called by the server's
        housekeeping loop."""
        dead = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in dead:
            self._unpin(self._leases.pop(lid).slots)
        late = [s for s in self._writing.values() if s.deadline <= now]
        for s in late:
            self._drop(s)
        voids = [s for s in self._bound.values() if s.void and s.deadline <= now]
        for s in voids:
            self._forget_void(s)
        unused = self.tickets.expire(now)
        return len(dead), len(late) + len(voids), unused

    def release_owner(self, owner: int) -> None:
        """Everything a vanished client held (the server's disconnect and timeout paths): its
        leases, the slots it prepared, its tickets and the slots they were bound to."""
        self.release_leases([lid for lid, lease in self._leases.items() if lease.owner == owner],
                            owner)
        for s in [s for s in self._writing.values() if s.owner == owner]:
            self._drop(s)
        for s in [s for s in self._bound.values() if s.void and s.owner == owner]:
            self._forget_void(s)
        self.tickets.release_owner(owner)

    def reset(self, ns: bytes) -> int:
        """Forget every block of ``ns``: lookups miss at once; pinned ones are freed when their
        last pin goes. Returns how many blocks were forgotten."""
        victims = list(self._tables.get(ns, EMPTY_TABLE).values())
        for s in victims:
            self._drop(s)
        return len(victims)

    def slot_counts(self) -> tuple[int, int, int]:
        """(writing, committed, used bytes); tickets take none."""
        writing = len(self._writing) + len(self._filling)
        classes = self.extents.classes.values()
        committed = sum(len(c.lru) for c in classes)
        used = sum(s.size_class.slot_bytes for s in self._writing.values())
        used += sum(s.size_class.slot_bytes for s in self._filling.values())
        used += sum(len(c.lru) * c.slot_bytes for c in classes)
        return writing, committed, used

    # ---- internals -------------------------------------------------------------------------

    def _resolve(self, ref: int) -> Slot | None:
        s = self._slots.get(ref & 0xFFFF_FFFF)
        if s is None or s.ref != ref:
            return None if s is None else _STALE
        return s

    def _commit(self, slots: list[Slot]) -> None:
        """Make landed slots visible: records first (one vectorised write per extent), then
        the in-memory state lookups read."""
        ids = [s.id for s in slots]
        self.pool.commit_records(ids, [s.key for s in slots], [s.generation for s in slots])
        tick = next(self._tick)
        pop_writing = self._writing.pop
        pop_bound = self._bound.pop
        for s in slots:
            pop_writing(s.id, None)
            s.state = COMMITTED
            s.last_use = tick
            if s.ticket:
                pop_bound(s.ticket, None)
                s.ticket = 0
        # The LRUs and counts take the batch whole: one size and one namespace nearly always
        # (a store job's slots are of one namespace), so one call each instead of one per slot.
        first = slots[0]
        if len(slots) == 1 or all(s.ns == first.ns for s in slots):
            groups = [(first.ns, first.size_class, ids)]
        else:
            by: dict[bytes, tuple[bytes, SizeClass, list[int]]] = {}
            for s in slots:
                by.setdefault(s.ns, (s.ns, s.size_class, []))[2].append(s.id)
            groups = list(by.values())
        for ns, cls, group in groups:
            cls.lru.insert_many(group, tick)     # a namespace's slots are of one size
            self._ns_blocks[ns] = self._ns_blocks.get(ns, 0) + len(group)
            own = self._ns_lru.get(ns)
            if own is not None:
                own.insert_many(group, tick)
        self.stats.stored_blocks += len(slots)
        if self.events is not None:
            self.events.extend(("stored", s.ns, s.key[16:]) for s in slots)
        if self.on_commit is not None:
            self.on_commit(slots)

    def _evict(self, s: Slot) -> None:
        self.stats.evictions += 1
        self._free(s)

    def _hide(self, s: Slot) -> None:
        """Evict a pinned committed slot as far as lookups can tell; freed when its last pin
        goes (an extent being drained asks this)."""
        self.stats.evictions += 1
        if self._unmap(s):
            self._forget_committed(s)
            if self.events is not None:
                self.events.append(("removed", s.ns, s.key[16:]))

    def _drop(self, s: Slot) -> None:
        """Make ``s`` unreachable now and free it once unpinned."""
        if s.void:
            self._forget_void(s)
            return
        s.doomed = True
        if self._unmap(s):
            if s.state == COMMITTED:
                self._forget_committed(s)
                if self.events is not None:
                    self.events.append(("removed", s.ns, s.key[16:]))
        self._writing.pop(s.id, None)
        if s.pins == 0:
            self._free(s)

    def _free(self, s: Slot) -> None:
        if s.state == COMMITTED and self._unmap(s):
            self._forget_committed(s)
            if self.events is not None:
                self.events.append(("removed", s.ns, s.key[16:]))
        self._writing.pop(s.id, None)
        self._filling.pop(s.id, None)
        if s.ticket:
            self._bound.pop(s.ticket, None)
            s.ticket = 0
        if s.state != FREE:
            self._ns_bytes[s.ns] -= s.size_class.slot_bytes
        s.state = FREE
        s.doomed = s.void = False
        s.landed = s.writing = 0
        self.pool.write_state(s.id, FREE)
        self.extents.release(s)

    def _forget_committed(self, s: Slot) -> None:
        """Take a committed slot out of the LRUs that may evict it."""
        s.size_class.lru.remove(s.id)
        self._ns_blocks[s.ns] -= 1
        own = self._ns_lru.get(s.ns)
        if own is not None:
            own.remove(s.id)

    def _unmap(self, s: Slot) -> bool:
        """Remove ``s`` from its namespace table if it is still the slot for its key."""
        table = self._tables.get(s.ns)
        h = s.key[16:]
        if table is not None and table.get(h) is s:
            del table[h]
            return True
        return False

    def _unpin(self, slots: list[Slot]) -> None:
        for s in slots:
            s.pins -= 1
            if s.doomed and s.pins == 0 and s.state != FREE:
                self._free(s)
            elif (s.pins == 0 and s.state == COMMITTED and self.extents.draining
                  and s.extent in self.extents.draining):
                self._free(s)       # hidden when its extent began to drain


# A sentinel for "this ref's slot exists but was reused": resolves to a slot in no valid state.
_STALE = Slot(-1, -1, -1, 0, SizeClass(0), state=FREE, doomed=True)
