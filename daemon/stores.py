"""The one store path: reservations (tickets), keyed stores that bind them, and a store's end.

A scheduler reserves *tickets* (``reserve``, ``daemon/tickets.py``): refs bound to nothing,
taking no pool space and evicting nothing (with slots claimed at reservation, a full 64 MiB
pool lost 505 of its 3968 blocks to each client's stock). It assigns a ticket to a key without
asking; each TP rank's worker then sends a store naming the tickets and their keys. The first
rank's store *binds* each ticket (``open_store``): to a new slot for its key (evicting least
recently used blocks, applying the namespace's quota), or to a *void* placeholder (``Slot.void``,
outside the pool) where the key is held already, being written, named twice in the job (a
duplicate), or where no room could be made. A void is written by no rank (the copy skips it) and
forgotten once every rank has reported it. Later ranks naming the ticket get what the first one
bound, so dedup happens at bind time, in one place, and a key is never visible twice nor torn.
Unused tickets expire after ``reserve_ttl_s``; a restarted daemon knows none (they never
touched a pool record).

A first rank's tickets are bound as one job: its duplicates are found, the quota applied and the
room for the rest found in one batch (``_find_room``), then the slots claimed in one pass
(``_claim``). Where nothing can come out void (keys distinct and unheld, no quota, room for all:
the common case), the claim is deferred until the job's copy has gone out (``open_store``'s
``finish``); a test drives the same stores with and without that deferral and compares the
state after. Where, besides, the pool's free and evictable slots assure room for the whole job
(``Room.assured``), only the head its copy engine starts with gets room before the copy
(``open_store``'s ``head``): ``finish`` finds the rest's while the head copies, and the job's
offsets past the head reach the engine late (``LateOffsets``). On a full pool, finding room for
1024 blocks cost ~1 ms before the first byte could move.

Runs on the daemon's event loop thread, never blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Callable

from kvpool.daemon.extents import SizeClass, Slot
from kvpool.daemon.key_table import EMPTY
from kvpool.daemon.namespaces import Namespaces
from kvpool.daemon.pool import WRITING, Pool
from kvpool.daemon.room import Room
from kvpool.daemon.slot_table import SlotTable
from kvpool.daemon.tickets import Grant, Tickets
from kvpool.shared.errors import LayoutMismatch, OutOfRange, ProtocolError, UnknownId
from kvpool.shared.protocol import MAX_RESERVE


@dataclass
class StoreStats:
    duplicate_blocks: int = 0   # tickets bound to a key already held (void: never written)
    no_room_blocks: int = 0     # tickets that found no slot (all written or pinned): not stored


@dataclass(slots=True)
class OpenedStore:
    """A store job ``StorePath.open_store`` let through."""

    # Its slots, in ticket order; only its head while ``late`` is set: ``place`` (or
    # ``finish``) appends the rest to this same list.
    slots: list[Slot]
    finish: Callable[[], None] | None   # its claims and pins left to do, see open_store
    has_voids: bool                     # whether any slot is void (nobody copies into those)
    late: int = 0                       # tickets past the head, bound by ``finish``
    # Where ``late``: finds room for the tickets up to the given count (default: all) and
    # appends their slots, unclaimed (``finish`` places what is left first): their offsets,
    # before the claims' bookkeeping.
    place: Callable[..., None] | None = None
    short: bool = False                 # ``place`` found no room for some of those (voids)


@dataclass(slots=True)
class _Binding:
    """A first rank's tickets on their way to slots: per ticket, its slot, or None for a void
    (``duplicate`` says which kind)."""

    ns: bytes
    refs: list[int]
    grants: list[Grant]
    keys: list[bytes]
    slots: list[Slot | None]
    duplicate: list[bool]


class StorePath:
    """Reservations and stores. Callers: the server's dispatch and the copy jobs (event loop)."""

    def __init__(self, table: SlotTable, room: Room, namespaces: Namespaces, pool: Pool,
                 write_timeout_s: float, reserve_ttl_s: float, defer_claims: bool = True) -> None:
        self.table = table
        self.room = room
        self.namespaces = namespaces
        self.pool = pool
        self.write_timeout_s = write_timeout_s
        self.reserve_ttl_s = reserve_ttl_s
        self.defer_claims = defer_claims      # False: claims at once (tests compare the two)
        self.tickets = Tickets(pool.slot_ids)
        # Ticket refs a first rank bound -> the slot or void later ranks must get, until the
        # slot commits, or is freed (then its ``ticket`` no longer names the ref).
        self.bound: dict[int, Slot] = {}
        self.stats = StoreStats()

    # ---- reservations ----------------------------------------------------------------------

    def reserve(self, ns: bytes, count: int, owner: int, now: float) -> list[int]:
        """Up to ``count`` ticket refs of ``ns`` for ``owner`` (a scheduler's
        ``ReserveRequest``), bound to nothing, taken back at ``now + reserve_ttl_s`` unless a
        store binds them first. Pins nothing, takes no pool space and evicts nothing. Fewer
        only where ``owner`` would hold more tickets of this slot size than the pool has slots
        of it (a bound on the daemon's memory, never on a burst of stores). ``UnknownId`` for
        a namespace no worker registered yet."""
        if not 0 <= count <= MAX_RESERVE:
            raise OutOfRange(f"a reservation asks for 0..{MAX_RESERVE} slots, not {count}")
        slot_bytes = self.namespaces.layout_of(ns).slot_bytes
        per_extent = self.pool.slots_per_extent(slot_bytes)
        if per_extent == 0:
            raise LayoutMismatch(f"a slot of {slot_bytes} bytes does not fit one extent of "
                                 f"{self.pool.geometry.extent_bytes} bytes: raise extent_size")
        return self.tickets.grant(owner, ns, slot_bytes, count,
                                  self.pool.geometry.num_extents * per_extent,
                                  now + self.reserve_ttl_s)

    def abort(self, refs: list[int], owner: int) -> int:
        """Give back tickets of ``owner`` that will not be written (a scheduler's
        ``AbortStoreRequest``): an unbound one just goes, a bound one takes its slot with it.
        Unknown or stale refs are skipped (an abort may cross the slot's expiry). Returns how
        many went."""
        n = 0
        for ref in refs:
            gone = self.tickets.abort(ref, owner)
            if gone is not None:
                n += gone
                continue
            s = self._bound_slot(ref)
            if s is not None and s.owner == owner and not s.doomed:
                self._drop(s)
                n += 1
        return n

    # ---- a store job -----------------------------------------------------------------------

    def open_store(self, ns: bytes, refs: list[int], keys: list[bytes], rank: int,
                   mask: int | None = None, now: float = 0.0, head: int = 0) -> OpenedStore:
        """Check a store job and find its slots; all or nothing (it raises with nothing
        changed). ``mask``: the units it lands (``Layout.rank_mask``; default rank ``rank``'s
        shard). A first rank's tickets are bound here (see the module docstring).

        Where a first rank's keys are fresh, the room is found now (the copy needs its
        offsets; evictions happen now) but the claims and pins come back as ``finish``: the
        caller (the copy jobs) must call it once it has handed the copy to its engine, before
        it gives the event loop back (until then nothing else runs there, so nothing can evict,
        reuse or see the slots). So a big store's copy starts after its checks and room alone.

        With ``head`` (what the copy engine needs to start, ``CopyEngine.store_head``), where
        the whole job is sure of room, only its first ``head`` tickets get room now: ``place``
        finds the rest's (``late``), so the copy of the head starts before it, and ``finish``
        claims them all (placing first where ``place`` was not called).
        """
        bit = 1 << rank if mask is None else mask
        if len(keys) != len(refs):
            raise ProtocolError(f"{len(keys)} keys for {len(refs)} slots")
        if len(set(refs)) != len(refs):
            raise ProtocolError("a store job names the same slot twice")
        if not bit:
            raise ProtocolError("a store job must land at least one unit")
        if not refs:
            return OpenedStore([], None, False)     # nothing to bind: the job ends at once
        unbound = self.tickets.unbound
        # (a job's tickets nearly always come from one reserve: one Grant to check. Each
        # ticket's grant is looked up once, here: the claims reuse the list)
        grants = list(map(unbound.get, refs))
        given = set(grants)
        if None not in given and all(g.ns == ns for g in given):
            if self.defer_claims and 0 < head < len(refs):
                opened = self._open_head(ns, refs, grants, keys, head, bit, now)
                if opened is not None:
                    return opened
            job = self._find_room(ns, refs, grants, keys)     # type: ignore[arg-type]
            if self.defer_claims and None not in job.slots:
                return OpenedStore(job.slots, partial(self._claim, job, bit, now),  # type: ignore
                                   False)
            slots = self._claim(job, bit, now)
            return OpenedStore(slots, None, any(map(_VOID, slots)))
        items = self._check(ns, refs, keys, bit, grants)
        todo = [i for i, x in enumerate(items) if type(x) is Grant]
        if todo:
            job = self._find_room(ns, [refs[i] for i in todo], [items[i] for i in todo],
                                  [keys[i] for i in todo])
            for i, s in zip(todo, self._claim(job, 0, now)):     # pinned below, with the rest
                items[i] = s
        slots: list[Slot] = items       # type: ignore[assignment]  (every Grant replaced)
        _pin_store(slots, bit)
        return OpenedStore(slots, None, any(map(_VOID, slots)))

    def end_store(self, slots: list[Slot], rank: int, ok: bool, mask: int | None = None) -> int:
        """A store job (or a chunk of it) ended: commit slots whose every unit has landed; drop
        those of a failed job. ``mask`` as given to ``open_store``. Returns how many slots
        committed. Called by the copy jobs once per slot per job: it takes back the pin
        ``open_store`` gave each slot."""
        bit = 1 << rank if mask is None else mask
        full = self.namespaces.layouts[slots[0].ns].full_mask if slots else 0
        # (one pass, the ticket's binding ended in it: a second loop over the ready slots was
        # ~6% of the event loop's Python in bench/host_scale.py's host-path stores, py-spy)
        ready, doomed = self.table.records.end(slots, bit, ok, full, self.bound)
        for s in doomed:
            self._drop(s)
        if any(map(_VOID, ready)):
            # Every rank has reported a void ticket: nothing to show, nothing to free.
            for s in ready:
                if s.void:
                    self._forget_void(s)
            ready = [s for s in ready if not s.void]
        self.table.commit(ready)
        return len(ready)

    # ---- housekeeping ----------------------------------------------------------------------

    def expire(self, now: float) -> tuple[int, int]:
        """Drop voids past their write timeout and tickets past their reservation TTL, and
        forget bindings whose slot has gone; returns (voids, tickets) dropped."""
        voids = [s for s in self.bound.values() if s.void and s.deadline <= now]
        for s in voids:
            self._forget_void(s)
        stale = [r for r, s in self.bound.items() if not s.void and s.ticket != r]
        for r in stale:
            del self.bound[r]
        return len(voids), self.tickets.expire(now)

    def release_owner(self, owner: int) -> None:
        """A vanished client's tickets, voids and bindings (the index drops its WRITING slots
        first)."""
        for ref in [r for r, s in self.bound.items() if s.owner == owner]:
            s = self.bound.pop(ref)
            if s.void:
                s.doomed = True
        self.tickets.release_owner(owner)

    @property
    def ticket_count(self) -> int:
        """Tickets granted and not bound, aborted or expired yet (they take no pool space)."""
        return len(self.tickets)

    # ---- the rules -------------------------------------------------------------------------

    def _check(self, ns: bytes, refs: list[int], keys: list[bytes], bit: int,
               grants: list[Grant | None]) -> list[Slot | Grant]:
        """The store check, one ref at a time: per ref its bound slot (or void), or its grant
        for an unbound ticket of ``ns``; each failure with its own error, nothing changed."""
        items: list[Slot | Grant] = []
        for ref, key, grant in zip(refs, keys, grants):
            if grant is not None and grant.ns == ns:
                items.append(grant)
                continue
            s = self._bound_slot(ref)
            if s is None:
                if grant is None and not self.tickets.refs.issued(ref):
                    raise OutOfRange(f"slot ref {ref:#x} is no ticket this daemon granted (one "
                                     f"granted before a restart?): reserve again")
                raise UnknownId(f"ticket {ref:#x} is not reserved for this namespace (aborted, "
                                f"reset, expired, timed out, committed or another namespace's)")
            if s.doomed or s.ns != ns:
                raise UnknownId(f"ticket {ref:#x} is not reserved for this namespace (aborted, "
                                f"reset, expired, timed out or another namespace's)")
            if s.block_hash != key:
                raise ProtocolError(f"ticket {ref:#x} is bound to another key than the one "
                                    f"this store names")
            if (s.landed | s.writing) & bit:
                raise ProtocolError(f"units {bit:#x} of ticket {ref:#x} overlap units already "
                                    f"stored or being stored ({s.landed | s.writing:#x}): "
                                    f"overlapping head ranges, or the same rank twice")
            items.append(s)
        return items

    def _bound_slot(self, ref: int) -> Slot | None:
        """What a first rank bound ticket ``ref`` to, while it is still bound (WRITING)."""
        s = self.bound.get(ref)
        if s is None or s.state != WRITING or (not s.void and s.ticket != ref):
            return None
        return s

    def _find_room(self, ns: bytes, refs: list[int], grants: list[Grant], keys: list[bytes]
                   ) -> _Binding:
        """Which of a first rank's tickets get a slot: a key held already, or named earlier in
        the job, is a duplicate; the others get room (the quota applied, then free slots and
        evictions in one batch) in order, and those past the room found get none. Changes the
        pool's room (evictions) but claims nothing."""
        table = self.table.tables.get(ns, EMPTY)
        if self._all_fresh(ns, keys):
            duplicate = [False] * len(keys)     # the usual job: a C-level check, not a loop
        else:
            seen: set[bytes] = set()
            duplicate = []
            for k in keys:
                duplicate.append(k in table or k in seen)
                seen.add(k)
        fresh = duplicate.count(False)
        slot_bytes = grants[0].slot_bytes           # a namespace's tickets are of one size
        cls = self.table.extents.size_class(slot_bytes)
        room = self.room.allocate(cls, self.room.fit_quota(ns, slot_bytes, fresh))
        if not any(duplicate) and len(room) == len(keys):
            slots: list[Slot | None] = room         # type: ignore[assignment]
        else:
            given = iter(room)
            slots = [None if dup else next(given, None) for dup in duplicate]
        return _Binding(ns, refs, grants, keys, slots, duplicate)

    def _all_fresh(self, ns: bytes, keys: list[bytes]) -> bool:
        """Whether ``keys`` are distinct and none is held or in flight in ``ns`` (C-level
        checks, not a loop)."""
        return len(set(keys)) == len(keys) and \
            not self.table.tables.get(ns, EMPTY).holds_any(keys)

    def _open_head(self, ns: bytes, refs: list[int], grants: list[Grant], keys: list[bytes],
                   head: int, bit: int, now: float) -> OpenedStore | None:
        """A first rank's fresh job (its tickets unbound, of ``ns``, ``grants`` theirs)
        with room for its first ``head`` tickets and the rest left to ``finish``
        (``open_store``), or None where it may not all be bound to slots (duplicates, a quota
        that lets fewer in, a pool that may not make room for all)."""
        if not self._all_fresh(ns, keys):
            return None
        n = len(keys)
        slot_bytes = grants[0].slot_bytes           # a namespace's tickets are of one size
        cls = self.table.extents.size_class(slot_bytes)
        if self.room.fit_quota(ns, slot_bytes, n) < n or not self.room.assured(cls, n):
            return None
        opened = OpenedStore(self.room.allocate(cls, head), None, False, n - head)

        def place(upto: int = n) -> None:
            slots = opened.slots
            want = min(upto, n) - len(slots)
            if want > 0 and not opened.short:
                room = self.room.allocate(cls, want)
                opened.short = len(room) < want       # (not with room assured)
                slots += room

        def finish() -> None:
            place()
            slots = opened.slots
            room: list[Slot | None] = slots + [None] * (n - len(slots))  # voids where short
            # (the tickets are as checked: nothing ran on the loop since)
            slots[:] = self._claim(_Binding(ns, refs, grants, keys, room, [False] * n), bit, now)
        opened.place, opened.finish = place, finish
        return opened

    def _claim(self, job: _Binding, bit: int, now: float) -> list[Slot]:
        """Claim ``job``'s slots for its keys (one pass, WRITING), make voids of the tickets
        without one, spend the tickets and pin the job for units ``bit``."""
        deadline = now + self.write_timeout_s
        if None not in job.slots:
            slots: list[Slot] = job.slots           # type: ignore[assignment]
            self.table.claim(slots, job.ns, job.keys, WRITING, job.grants[0].owner, deadline,
                             job.refs, pin_units=bit)
        else:
            given = [(s, k, r) for s, k, r in zip(job.slots, job.keys, job.refs) if s is not None]
            self.table.claim([g[0] for g in given], job.ns, [g[1] for g in given], WRITING,
                             job.grants[0].owner, deadline, [g[2] for g in given],
                             pin_units=bit)
            dups = job.duplicate.count(True)
            self.stats.duplicate_blocks += dups
            self.stats.no_room_blocks += len(job.slots) - len(given) - dups
            slots = [s if s is not None else self._void(job.ns, k, g.owner, r, deadline)
                     for s, k, g, r in zip(job.slots, job.keys, job.grants, job.refs)]
            if bit:
                _pin_store([s for s in slots if s.void], bit)
        if len(set(map(_OWNER, job.grants))) > 1:     # one job, tickets of several clients
            for s, g in zip(slots, job.grants):
                s.owner = g.owner
        self.bound.update(zip(job.refs, slots))
        self.tickets.spend(job.refs)
        return slots

    def _void(self, ns: bytes, k: bytes, owner: int, ticket: int, deadline: float) -> Slot:
        """A void ticket's placeholder: a slot of no extent, which later ranks resolve to and
        which carries their landing bits until every one has reported it."""
        return self.table.records.Slot(-1, -1, -1, 0, _VOID_CLASS, state=WRITING, ns=ns,
                                       key=ns + k, block_hash=k, owner=owner,
                                       deadline=deadline, void=True, ticket=ticket)

    def _drop(self, s: Slot) -> None:
        if s.void:
            self._forget_void(s)
        else:
            self.table.drop(s)

    def _forget_void(self, s: Slot) -> None:
        s.doomed = True
        if self.bound.get(s.ticket) is s:
            del self.bound[s.ticket]


def _pin_store(slots: list[Slot], bit: int) -> None:
    """A store job's hold on its (distinct, checked) slots: units ``bit`` in flight, a pin."""
    for s in slots:
        s.writing |= bit
        s.pins += 1


_VOID = attrgetter("void")
_OWNER = attrgetter("owner")
# The size class of void placeholders: they hold no pool space, so no real class counts them.
_VOID_CLASS = SizeClass(0)
