"""The store half of the block index: prepared stores, tickets given slots by keyed stores,
the store check, and a store's end. See ``daemon/index.py``'s docstring for the slot lifecycle
and tickets.

``StorePath`` is a base class of ``Index``, not an object of its own: a store touches most of
the index's tables (key tables, slots being written, bound tickets, namespace counts, LRUs) on
its hot path, where an attribute hop per table per call would cost more than the split is
worth. It reads and writes only state ``Index.__init__`` sets up (annotated below), and calls
back the index's own internals (``_commit``, ``_drop``, ``_evict``, ``_resolve``...).
Runs on the daemon's event loop thread, never blocks.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Callable

from kvpool.daemon.extents import Extents, SizeClass, Slot
from kvpool.daemon.pool import FREE, GENERATION_MASK, WRITING, Pool
from kvpool.daemon.tickets import Grant, Tickets
from kvpool.shared.errors import LayoutMismatch, OutOfRange, PoolFull, ProtocolError, UnknownId
from kvpool.shared.protocol import MAX_RESERVE, SLOT_NO_SPACE, SLOT_PRESENT, make_slot_ref

if TYPE_CHECKING:
    from kvpool.daemon.eviction import LruPolicy
    from kvpool.daemon.index import IndexStats
    from kvpool.shared.layout import Layout


@dataclass(slots=True)
class OpenedStore:
    """A store job ``Index.open_store`` let through."""

    slots: list[Slot]
    finish: Callable[[], None] | None   # its pins (and bindings) left to do, see open_store
    has_voids: bool                     # whether any slot is void (nobody copies into those)


class StorePath:
    """Stores, for ``Index`` (the server's dispatch calls them on the event-loop thread)."""

    # Index's state this half reads and writes (set up by ``Index.__init__``).
    pool: Pool
    extents: Extents
    tickets: Tickets
    stats: "IndexStats"
    write_timeout_s: float
    reserve_ttl_s: float
    _slots: dict[int, Slot]
    _tables: dict[bytes, dict[bytes, Slot]]
    _writing: dict[int, Slot]
    _bound: dict[int, Slot]
    _layouts: dict[bytes, "Layout"]
    _ns_bytes: dict[bytes, int]
    _ns_blocks: dict[bytes, int]
    _quota: dict[bytes, int]
    _ns_lru: dict[bytes, "LruPolicy"]
    _tick: itertools.count
    events: list[tuple[str, bytes, bytes]] | None

    # ---- stores ----------------------------------------------------------------------------

    def prepare_store(self, ns: bytes, keys: list[bytes], owner: int, now: float) -> list[int]:
        """A slot ref to write for each key not committed or in flight, else ``SLOT_PRESENT``;
        ``SLOT_NO_SPACE`` where nothing could be evicted. ``PoolFull`` if no key got room.
        Called by the server's dispatch of a ``PrepareStoreRequest`` (tools; the vLLM
        connector reserves tickets). The slots are WRITING for ``owner`` until their store
        ends or ``write_timeout_s`` passes; nothing is pinned until a store job names them."""
        layout = self.layout_of(ns)
        out: list[int] = []
        full = over_quota = 0
        table = self._tables.setdefault(ns, {})
        quota = self._quota.get(ns, 0)
        slot_bytes = layout.slot_bytes
        deadline = now + self.write_timeout_s
        writing = self._writing
        claimed: list[Slot] = []
        try:
            for k in keys:
                s = table.get(k)
                if s is not None:
                    out.append(SLOT_PRESENT)
                    continue
                s = self._claim(ns, table, k, slot_bytes, quota)
                if s is None or s is OVER_QUOTA:
                    out.append(SLOT_NO_SPACE)
                    full += 1
                    over_quota += s is OVER_QUOTA
                    continue
                s.state, s.owner, s.deadline = WRITING, owner, deadline
                writing[s.id] = s
                out.append(s.ref)
                claimed.append(s)
        finally:
            self._record_claims(claimed)
        allocated = len(claimed)
        if full and not allocated and not any(r == SLOT_PRESENT for r in out):
            if over_quota:
                raise PoolFull(f"namespace {ns.hex()} is at its quota of {quota} bytes and every "
                               f"block of it is being written or pinned")
            raise PoolFull(f"no room for {full} blocks of {layout.slot_bytes} bytes: every slot "
                           f"is being written or pinned by a lease or a transfer")
        return out

    def _claim(self, ns: bytes, table: dict[bytes, Slot], k: bytes, slot_bytes: int,
               quota: int) -> Slot | None:
        """A slot for key ``k`` of ``ns``, counted and mapped in ``table``, its state for the
        caller to set; None where nothing could be evicted, ``OVER_QUOTA`` where the quota
        stops it. Its pool record is the caller's to
        write, with ``_record_claims``, before the slot's ref leaves the daemon."""
        if quota and not self._fits_quota(ns, slot_bytes, quota):
            return OVER_QUOTA
        s = self.extents.allocate(slot_bytes)
        if s is None:
            return None
        s.ns, s.key, s.owner = ns, ns + k, 0
        s.generation = (s.generation + 1) & GENERATION_MASK
        s.ref = make_slot_ref(s.id, s.generation)
        s.landed = s.writing = 0
        s.doomed = s.void = False
        table[k] = s
        self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + slot_bytes
        return s

    def _record_claims(self, slots: list[Slot]) -> None:
        """Write the WRITING records (new generations first) of slots ``_claim`` gave out, in
        one write: per slot, record writes cost more than the rest of a claim. Safe to do after
        the claims: until the reply leaves, no ref of theirs is out, and nothing in a claiming
        call frees a slot it claimed (a victim's FREE record, written when it was evicted, is
        overwritten here in the right order)."""
        if slots:
            self.pool.write_states([s.id for s in slots], WRITING,
                                   [s.generation for s in slots])

    # ---- reservations (stores planned without a round trip) --------------------------------

    def reserve(self, ns: bytes, count: int, owner: int, now: float) -> list[int]:
        """Up to ``count`` ticket refs of ``ns`` for ``owner`` (the server's dispatch of a
        scheduler's ``ReserveRequest``), bound to nothing, taken back at ``now +
        reserve_ttl_s`` unless a store binds them first. Pins nothing, takes no pool space and
        evicts nothing: the slots are found when the first rank's store names the tickets'
        keys. Fewer only where ``owner`` would hold more tickets of this slot size than the
        pool has slots of it (a bound on the daemon's memory, never on a burst of stores).
        ``UnknownId`` for a namespace no worker registered yet."""
        if not 0 <= count <= MAX_RESERVE:
            raise OutOfRange(f"a reservation asks for 0..{MAX_RESERVE} slots, not {count}")
        slot_bytes = self.layout_of(ns).slot_bytes
        per_extent = self.pool.slots_per_extent(slot_bytes)
        if per_extent == 0:
            raise LayoutMismatch(f"a slot of {slot_bytes} bytes does not fit one extent of "
                                 f"{self.pool.geometry.extent_bytes} bytes: raise extent_size")
        return self.tickets.grant(owner, ns, slot_bytes, count,
                                  self.pool.geometry.num_extents * per_extent,
                                  now + self.reserve_ttl_s)

    @property
    def ticket_count(self) -> int:
        """Tickets granted and not bound, aborted or expired yet (they take no pool space).
        Read by the server's ``info``; pins nothing."""
        return len(self.tickets)

    def _fits_quota(self, ns: bytes, slot_bytes: int, quota: int) -> bool:
        """Make room for one more slot under ``ns``'s quota by evicting its own least recently
        used blocks; False if its unpinned blocks cannot make enough."""
        lru = self._ns_lru[ns]
        while self._ns_bytes.get(ns, 0) + slot_bytes > quota:
            victim = lru.oldest(self.extents.is_pinned)
            if victim is None:
                return False
            self._evict(self._slots[victim])
        return True

    def abort_store(self, refs: list[int], owner: int) -> int:
        """Drop prepared slots and tickets of ``owner`` that will not be written (the server's
        dispatch of a scheduler's ``AbortStoreRequest``): an unbound ticket just goes; a bound
        one takes its slot with it. Unknown or stale refs are skipped (an abort may cross the
        slot's expiry). Returns how many were dropped."""
        n = 0
        bound = self._bound
        for ref in refs:
            gone = self.tickets.abort(ref, owner)
            if gone is not None:
                n += gone
                continue
            s = bound.get(ref) or self._resolve(ref)
            if s is not None and s.state == WRITING and not s.doomed and s.owner == owner:
                self._drop(s)
                n += 1
        return n

    def begin_store(self, ns: bytes, refs: list[int], rank: int, mask: int | None = None, *,
                    keys: list[bytes] | None = None, now: float = 0.0) -> list[Slot]:
        """Validate a store job's slots and pin them; all or nothing. ``mask`` is the units the
        job lands (``Layout.rank_mask``; default: rank ``rank``'s shard, ``1 << rank``).
        Callers: tests and tools; the server uses ``open_store``.

        With ``keys`` (one block hash per ref), tickets are bound here: each to a slot for its
        key, or void (``Slot.void``: the caller copies nothing into it) where the key is
        already committed, being written or filled, or named twice, or where no slot could be
        found. Tickets and slots bound earlier (by another rank's store, or by
        ``prepare_store``) must be bound to the same key.
        """
        job = self.open_store(ns, refs, rank, mask, keys=keys, now=now)
        if job.finish is not None:
            job.finish()
        return job.slots

    def open_store(self, ns: bytes, refs: list[int], rank: int, mask: int | None = None, *,
                   keys: list[bytes] | None = None, now: float = 0.0) -> "OpenedStore":
        """``begin_store`` with what can wait left for after the job's copy has gone out: its
        checks are done (it raises as ``begin_store``, with nothing changed) and its tickets
        have their slots (the copy needs their offsets: allocation may evict LRU blocks now),
        but its pins, and the binding of those slots where none is void (every ref an unbound
        ticket, its keys distinct and none held, no quota on ``ns``, room for all), may come
        back as ``finish``. The caller (the server's dispatch) must call it once it has handed
        the copy to its engine, before anything else touches the index: before it ends the job
        and before it gives the event loop back (until then nothing else runs there, so nothing
        can evict, reuse or see the slots). So a big store's copy starts after its checks and
        allocation alone (bench/investigations/big_job_path.py times both)."""
        bit = 1 << rank if mask is None else mask
        if keys is not None and len(keys) != len(refs):
            raise ProtocolError(f"{len(keys)} keys for {len(refs)} slots")
        if bit and len(set(refs)) == len(refs):     # (a slot named twice: _check_store says)
            if keys is not None:
                grants = list(map(self.tickets.unbound.get, refs))
                if None not in grants:      # the first rank: every ref an unbound ticket
                    if all(g.ns == ns for g in set(grants)):
                        return self._open_tickets(ns, refs, grants, keys, bit, now)
            if keys is None or not any(grants):
                slots = self._check_fast(ns, refs, bit, keys)
                if slots is not None:
                    return OpenedStore(slots, partial(_pin_store, slots, bit),
                                       keys is not None and any(map(_SLOT_VOID, slots)))
        items = self._check_store(ns, refs, rank, bit, keys)
        if len(set(refs)) != len(refs):
            raise ProtocolError("a store job names the same slot twice")
        todo = [i for i, x in enumerate(items) if type(x) is Grant]
        if todo:
            assert keys is not None      # _check_store refuses a keyless ticket
            got = self._bind(ns, [refs[i] for i in todo], [items[i] for i in todo],
                             [keys[i] for i in todo], now)
            for i, s in zip(todo, got):
                items[i] = s
        slots: list[Slot] = items       # type: ignore[assignment]  (every Grant replaced)
        _pin_store(slots, bit)
        return OpenedStore(slots, None, keys is not None and any(map(_SLOT_VOID, slots)))

    def _open_tickets(self, ns: bytes, refs: list[int], grants: list[Grant], keys: list[bytes],
                      bit: int, now: float) -> "OpenedStore":
        """The first rank's store of unbound tickets (checked): slots found now, the rest of
        the binding deferred where nothing can come out void."""
        slot_bytes = grants[0].slot_bytes       # a namespace's tickets are of one size
        if self._fresh_keys(ns, keys):
            slots = self.extents.allocate_many(slot_bytes, len(refs), self._evict_many)
            if len(slots) == len(refs):
                return OpenedStore(slots, partial(self._bind_fresh, ns, refs, grants, keys,
                                                  slots, bit, now), False)
            return OpenedStore(self._bind_fresh(ns, refs, grants, keys, slots, bit, now), None,
                               True)
        slots = self._bind(ns, refs, grants, keys, now)
        _pin_store(slots, bit)
        return OpenedStore(slots, None, any(map(_SLOT_VOID, slots)))

    def _check_fast(self, ns: bytes, refs: list[int], bit: int, keys: list[bytes] | None
                    ) -> list[Slot] | None:
        """The slots of ``refs`` (distinct: slot refs ``prepare_store`` granted, or tickets a
        first rank bound) if each is WRITING for ``ns``, free of ``bit`` and, with ``keys``,
        bound to its key: the common case, and the one check every store path shares, in one
        pass that changes nothing. Else None, for ``_check_store`` to say why (or to take a
        job that mixes unbound tickets with bound refs)."""
        get = self._slots.get
        slots = [get(ref & 0xFFFF_FFFF) for ref in refs]
        if self._bound and None in slots:
            # Ticket refs name no pool slot: those a first rank bound resolve through it.
            bound = self._bound.get
            slots = [s if s is not None else bound(ref) for s, ref in zip(slots, refs)]
        writing = WRITING
        # Two loops rather than one with a per-slot test of ``keys``: this is the per-slot cost
        # of every store. (A bound ticket's slot answers to the ticket ref: ``s.ticket``.)
        if keys is None:
            for s, ref in zip(slots, refs):
                if (s is None or (s.ref != ref and s.ticket != ref) or s.state != writing
                        or s.doomed or s.ns != ns or (s.landed | s.writing) & bit):
                    return None
        else:
            for s, ref, k in zip(slots, refs, keys):
                if (s is None or (s.ref != ref and s.ticket != ref) or s.state != writing
                        or s.doomed or s.ns != ns or (s.landed | s.writing) & bit
                        or s.key[16:] != k):
                    return None
        return slots

    def _fresh_keys(self, ns: bytes, keys: list[bytes]) -> bool:
        """Whether ``keys`` can go into ``ns``'s table whole: distinct, none held, no quota."""
        return (not self._quota.get(ns, 0) and len(set(keys)) == len(keys)
                and self._tables.setdefault(ns, {}).keys().isdisjoint(keys))

    def _check_store(self, ns: bytes, refs: list[int], rank: int, bit: int,
                     keys: list[bytes] | None) -> list[Slot | Grant]:
        """``begin_store``'s checks one ref at a time, each failure with its own error: per
        ref, its slot, or its grant for an unbound ticket."""
        items: list[Slot | Grant] = []
        resolve, tickets, bound = self._resolve, self.tickets.unbound, self._bound
        for i, ref in enumerate(refs):
            grant = tickets.get(ref)
            if grant is not None and grant.ns == ns:
                if keys is None:
                    raise UnknownId(f"slot ref {ref:#x} is reserved, not bound to a key: a store "
                                    f"into a reserved slot must name its key")
                items.append(grant)
                continue
            s = bound.get(ref) or resolve(ref)
            if s is None and grant is None and not self.tickets.refs.issued(ref):
                raise OutOfRange(f"slot ref {ref:#x} names no slot of this pool and no ticket "
                                 f"this daemon granted (one granted before a restart?)")
            # (A WRITING slot's ``ns`` is its key's namespace: no slice of the key needed.)
            if s is None or s.state != WRITING or s.doomed or s.ns != ns:
                raise UnknownId(f"slot ref {ref:#x} is not prepared or reserved for this "
                                f"namespace (aborted, reset, expired, timed out or never "
                                f"granted)")
            if keys is not None and s.key[16:] != keys[i]:
                raise ProtocolError(f"slot ref {ref:#x} is bound to another key than the one "
                                    f"this store names")
            if (s.landed | s.writing) & bit:
                raise ProtocolError(f"rank {rank} stores units {bit:#x} of slot ref {ref:#x}, "
                                    f"which overlap units already stored or being stored "
                                    f"({s.landed | s.writing:#x}): overlapping head ranges, or "
                                    f"the same rank twice")
            items.append(s)
        return items

    def _evict_many(self, cls: SizeClass, n: int) -> int:
        """Evict up to ``n`` of ``cls``'s least recently used unpinned blocks onto its free
        list, the bookkeeping in batches (records in one write, counts once per namespace);
        returns how many. Only while ``cls`` is the pool's one size (so no extent drains)."""
        # The queue's head is nearly always the victims as they stand: checked in C-level
        # passes (a per-slot scan costs more than the rest of the eviction).
        ids, stamps = cls.lru.head(n)
        victims = list(map(self._slots.__getitem__, ids))
        if list(map(_SLOT_LAST_USE, victims)) != stamps or any(map(_SLOT_PINS, victims)):
            ids = cls.lru.oldest_many(n, self.extents.is_pinned)
            victims = list(map(self._slots.__getitem__, ids))
        if not ids:
            return 0
        tables = self._tables
        for s in victims:
            del tables[s.ns][s.key[16:]]    # a committed block is its key's slot
            s.state = FREE
            s.landed = 0
        cls.lru.remove_many(ids)
        for ns, k in Counter(map(_SLOT_NS, victims)).items():
            self._ns_blocks[ns] -= k
            self._ns_bytes[ns] -= k * cls.slot_bytes
            own = self._ns_lru.get(ns)
            if own is not None:
                own.remove_many([s.id for s in victims if s.ns == ns])
        if self.events is not None:
            self.events.extend(("removed", s.ns, s.key[16:]) for s in victims)
        self.pool.write_states(ids, FREE)
        self.stats.evictions += len(ids)
        cls.free += reversed(victims)       # oldest popped first
        return len(ids)

    def _bind_fresh(self, ns: bytes, refs: list[int], grants: list[Grant], keys: list[bytes],
                    slots: list[Slot], bit: int, now: float) -> list[Slot]:
        """Bind checked, unbound tickets whose keys are fresh (``_fresh_keys``) to ``slots``
        (from ``_allocate_many``, in order; the tickets past them found no room: void) and pin
        them for units ``bit``. Counts, the table, the records and the owners' tickets take
        the batch whole; the per-slot state is what is left (why ``open_store`` defers it)."""
        n = len(slots)
        deadline = now + self.write_timeout_s
        mask, state = GENERATION_MASK, WRITING
        for s, ref, grant, key in zip(slots, refs, grants, map(ns.__add__, keys)):
            gen = s.generation = (s.generation + 1) & mask
            s.ref = (gen << 32) | s.id
            s.state = state
            s.ns = ns
            s.key = key
            s.owner = grant.owner
            s.deadline = deadline
            s.ticket = ref
            s.writing = bit
            s.pins += 1
        self._writing.update(zip(map(_SLOT_ID, slots), slots))
        self._tables[ns].update(zip(keys, slots))
        self._bound.update(zip(refs, slots))
        if n:
            self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + n * slots[0].size_class.slot_bytes
        self._record_claims(slots)
        if n < len(refs):
            self.stats.no_room_blocks += len(refs) - n
            voids = [self._void(ns, k, g.owner, r, deadline)
                     for r, g, k in zip(refs[n:], grants[n:], keys[n:])]
            _pin_store(voids, bit)
            self._bound.update(zip(refs[n:], voids))     # later ranks must find them void too
            slots = slots + voids
        self.tickets.spend(refs)
        return slots

    def _bind(self, ns: bytes, refs: list[int], grants: list[Grant], keys: list[bytes],
              now: float) -> list[Slot]:
        """Bind checked, unbound tickets to slots for their keys one at a time (a key may be
        held, named twice, or under a quota): each gets a slot (``_claim``: evicting, quota
        applied), or a void placeholder as a duplicate or for want of room. Pins nothing."""
        table = self._tables.setdefault(ns, {})
        quota = self._quota.get(ns, 0)
        slot_bytes = grants[0].slot_bytes
        deadline = now + self.write_timeout_s
        writing = self._writing
        out: list[Slot] = []
        claimed: list[Slot] = []
        try:
            for ref, grant, k in zip(refs, grants, keys):
                if k in table:                # held already, or named earlier in this job
                    self.stats.duplicate_blocks += 1
                    out.append(self._void(ns, k, grant.owner, ref, deadline))
                    continue
                s = self._claim(ns, table, k, slot_bytes, quota)
                if s is None or s is OVER_QUOTA:
                    self.stats.no_room_blocks += 1      # as SLOT_NO_SPACE: not pooled
                    out.append(self._void(ns, k, grant.owner, ref, deadline))
                    continue
                s.state, s.owner, s.deadline, s.ticket = WRITING, grant.owner, deadline, ref
                writing[s.id] = s
                out.append(s)
                claimed.append(s)
        finally:
            self._record_claims(claimed)
        self._bound.update(zip(refs, out))
        self.tickets.spend(refs)
        return out

    def _void(self, ns: bytes, k: bytes, owner: int, ticket: int, deadline: float) -> Slot:
        """A void ticket's placeholder: a slot of no extent, which later ranks resolve to and
        which carries their landing bits until every one has reported it."""
        return Slot(-1, -1, -1, 0, _VOID_CLASS, state=WRITING, ns=ns, key=ns + k, owner=owner,
                    deadline=deadline, void=True, ticket=ticket)

    def _forget_void(self, s: Slot) -> None:
        s.doomed = True
        if self._bound.get(s.ticket) is s:
            del self._bound[s.ticket]

    def end_store(self, slots: list[Slot], rank: int, ok: bool, mask: int | None = None) -> int:
        """A store job finished (or failed): commit slots whose every unit has landed; drop
        the others of a failed job. ``mask`` as given to ``begin_store``. Returns how many
        slots committed. Called by the server as chunks land and at the job's end, once per
        slot per job: it takes back the pin ``open_store``/``begin_store`` gave each slot."""
        bit = 1 << rank if mask is None else mask
        ready: list[Slot] = []
        full = self._layouts[slots[0].ns].full_mask if slots else 0
        for s in slots:
            s.writing &= ~bit
            s.pins -= 1
            if not ok:
                s.doomed = True
            elif not s.doomed:
                s.landed |= bit
                if s.landed == full:
                    ready.append(s)
            if s.doomed:
                self._drop(s)
        if any(map(_SLOT_VOID, ready)):
            voids = [s for s in ready if s.void]
            ready = [s for s in ready if not s.void]
            # Every rank has reported a void ticket: nothing to show, nothing to free.
            for s in voids:
                self._forget_void(s)
        if ready:
            self._commit(ready)
        return len(ready)


# C-level getters for batch passes over slots (a generator costs ~2x more).
_SLOT_VOID = attrgetter("void")
_SLOT_ID = attrgetter("id")
_SLOT_LAST_USE = attrgetter("last_use")
_SLOT_NS = attrgetter("ns")
_SLOT_PINS = attrgetter("pins")


def _pin_store(slots: list[Slot], bit: int) -> None:
    """A store job's hold on its (distinct, checked) slots: units ``bit`` in flight, a pin."""
    for s in slots:
        s.writing |= bit
        s.pins += 1


# What ``_claim`` answers when a namespace's quota, not the pool, is out of room.
OVER_QUOTA = Slot(-2, -1, -1, 0, SizeClass(0), state=FREE, doomed=True)
# The size class of void placeholders: they hold no pool space, so no real class counts them.
_VOID_CLASS = SizeClass(0)
