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

Binding has a batch form and a one-by-one form: a first rank's job of distinct keys, none held,
with no quota on its namespace, is bound as one batch (``_bind_batch``); anything else ticket by
ticket (``_bind_each``). Both end in the same state (a test drives the same stores down both).

Runs on the daemon's event loop thread, never blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Callable

from kvpool.daemon.extents import SizeClass, Slot
from kvpool.daemon.namespaces import Namespaces
from kvpool.daemon.pool import WRITING, Pool
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

    slots: list[Slot]
    finish: Callable[[], None] | None   # its claims and pins left to do, see open_store
    has_voids: bool                     # whether any slot is void (nobody copies into those)


@dataclass(slots=True)
class _Binding:
    """One first rank's tickets and the room found for them (its keys fresh, see ``open_store``)."""

    ns: bytes
    refs: list[int]
    grants: list[Grant]
    keys: list[bytes]
    slots: list[Slot] = field(default_factory=list)


class StorePath:
    """Reservations and stores. Callers: the server's dispatch and the copy jobs (event loop)."""

    def __init__(self, table: SlotTable, namespaces: Namespaces, pool: Pool,
                 write_timeout_s: float, reserve_ttl_s: float, batch_binds: bool = True) -> None:
        self.table = table
        self.namespaces = namespaces
        self.pool = pool
        self.write_timeout_s = write_timeout_s
        self.reserve_ttl_s = reserve_ttl_s
        self.batch_binds = batch_binds        # False: every bind one by one (tests compare)
        self.tickets = Tickets(pool.geometry.num_extents * pool.slot_id_stride)
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
                   mask: int | None = None, now: float = 0.0) -> OpenedStore:
        """Check a store job and find its slots; all or nothing (it raises with nothing
        changed). ``mask``: the units it lands (``Layout.rank_mask``; default rank ``rank``'s
        shard). A first rank's tickets are bound here (see the module docstring).

        Where a first rank's keys are fresh, the room is found now (the copy needs its
        offsets; evictions happen now) but the claims and pins come back as ``finish``: the
        caller (the copy jobs) must call it once it has handed the copy to its engine, before
        it gives the event loop back (until then nothing else runs there, so nothing can evict,
        reuse or see the slots). So a big store's copy starts after its checks and room alone.
        """
        bit = 1 << rank if mask is None else mask
        if len(keys) != len(refs):
            raise ProtocolError(f"{len(keys)} keys for {len(refs)} slots")
        if len(set(refs)) != len(refs):
            raise ProtocolError("a store job names the same slot twice")
        if not bit:
            raise ProtocolError("a store job must land at least one unit")
        unbound = self.tickets.unbound
        grants = [unbound.get(r) for r in refs]
        if None not in grants and all(g.ns == ns for g in grants):
            if self.batch_binds and self._fresh(ns, keys):
                job = _Binding(ns, refs, grants, keys)       # type: ignore[arg-type]
                cls = self.table.extents.size_class(grants[0].slot_bytes)  # type: ignore[union-attr]
                job.slots = self.table.allocate(cls, len(refs))
                if len(job.slots) == len(refs):
                    return OpenedStore(job.slots, partial(self._bind_batch, job, bit, now), False)
                slots = self._bind_batch(job, bit, now)
                return OpenedStore(slots, None, True)
        items = self._check(ns, refs, keys, bit, grants)
        todo = [i for i, x in enumerate(items) if type(x) is Grant]
        if todo:
            got = self._bind_each(ns, [refs[i] for i in todo], [items[i] for i in todo],
                                  [keys[i] for i in todo], now)
            for i, s in zip(todo, got):
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
        ready: list[Slot] = []
        full = self.namespaces.layouts[slots[0].ns].full_mask if slots else 0
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
        if any(map(_VOID, ready)):
            # Every rank has reported a void ticket: nothing to show, nothing to free.
            for s in ready:
                if s.void:
                    self._forget_void(s)
            ready = [s for s in ready if not s.void]
        for s in ready:
            if self.bound.get(s.ticket) is s:
                del self.bound[s.ticket]
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

    def _fresh(self, ns: bytes, keys: list[bytes]) -> bool:
        """Whether ``keys`` can be bound as one batch: distinct, none held, no quota."""
        return (not self.namespaces.quota.get(ns, 0) and len(set(keys)) == len(keys)
                and self.table.tables.setdefault(ns, {}).keys().isdisjoint(keys))

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
            if s.key[16:] != key:
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

    def _bind_batch(self, job: _Binding, bit: int, now: float) -> list[Slot]:
        """Bind a first rank's fresh tickets to ``job.slots`` (room found in order; the
        tickets past them are void), claimed and pinned as one batch."""
        n = len(job.slots)
        deadline = now + self.write_timeout_s
        owner = job.grants[0].owner
        self.table.claim(job.slots, job.ns, job.keys[:n], WRITING, owner, deadline, job.refs[:n])
        for s, g in zip(job.slots, job.grants):
            if g.owner != owner:
                s.owner = g.owner
        slots = job.slots
        if n < len(job.refs):
            self.stats.no_room_blocks += len(job.refs) - n
            slots = slots + [self._void(job.ns, k, g.owner, r, deadline)
                             for r, g, k in zip(job.refs[n:], job.grants[n:], job.keys[n:])]
        self.bound.update(zip(job.refs, slots))
        self.tickets.spend(job.refs)
        _pin_store(slots, bit)
        return slots

    def _bind_each(self, ns: bytes, refs: list[int], grants: list[Grant], keys: list[bytes],
                   now: float) -> list[Slot]:
        """Bind tickets one at a time: a key held (or named earlier in the job) makes a
        duplicate; the rest get a slot each (quota applied) or none. Pins nothing."""
        table = self.table.tables.setdefault(ns, {})
        cls: SizeClass = self.table.extents.size_class(grants[0].slot_bytes)
        deadline = now + self.write_timeout_s
        out: list[Slot] = []
        for ref, grant, k in zip(refs, grants, keys):
            if k in table:
                self.stats.duplicate_blocks += 1
                out.append(self._void(ns, k, grant.owner, ref, deadline))
                continue
            got = (self.table.allocate(cls, 1)
                   if self.table.fit_quota(ns, cls.slot_bytes, 1) else [])
            if not got:
                self.stats.no_room_blocks += 1
                out.append(self._void(ns, k, grant.owner, ref, deadline))
                continue
            self.table.claim(got, ns, [k], WRITING, grant.owner, deadline, [ref])
            out.append(got[0])
        self.bound.update(zip(refs, out))
        self.tickets.spend(refs)
        return out

    def _void(self, ns: bytes, k: bytes, owner: int, ticket: int, deadline: float) -> Slot:
        """A void ticket's placeholder: a slot of no extent, which later ranks resolve to and
        which carries their landing bits until every one has reported it."""
        return Slot(-1, -1, -1, 0, _VOID_CLASS, state=WRITING, ns=ns, key=ns + k, owner=owner,
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
# The size class of void placeholders: they hold no pool space, so no real class counts them.
_VOID_CLASS = SizeClass(0)
