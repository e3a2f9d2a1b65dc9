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
  refs whose index lies above every slot id of the pool (``_TicketRefs``), with a generation,
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
from collections import Counter
from functools import partial
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.extents import FILLING, Extents, SizeClass, Slot
from kvpool.daemon.pool import COMMITTED, FREE, GENERATION_MASK, WRITING, Pool
from kvpool.daemon.tickets import Grant, Tickets
from kvpool.shared.errors import (LayoutMismatch, LeaseExpired, OutOfRange, PoolFull,
                                  ProtocolError, UnknownId)

__all__ = ["COMMITTED", "FILLING", "Index", "OpenedStore", "Slot"]
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import (MAX_RESERVE, SLOT_NO_SPACE, SLOT_PRESENT, NamespaceInfo,
                                    make_slot_ref)

@dataclass(slots=True)
class OpenedStore:
    """A store job ``Index.open_store`` let through."""

    slots: list[Slot]
    finish: Callable[[], None] | None   # its pins (and bindings) left to do, see open_store
    has_voids: bool                     # whether any slot is void (nobody copies into those)


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


class Index:
    """All slot state. Callers: the server's dispatch (event-loop thread only)."""

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

    # ---- namespaces ------------------------------------------------------------------------

    def register_namespace(self, ns: bytes, layout: Layout, quota_bytes: int = 0) -> None:
        """Bind a namespace to its layout's canonical form; ``LayoutMismatch`` if it is bound
        to another one.

        ``quota_bytes`` (0: none) is the engine's cap for the namespace. The latest registration
        decides (engines of one namespace serve one model with one config), bounded by the
        daemon's ``namespace_quota``.
        """
        layout.check()
        layout = layout.canonical()   # engines of every TP size of a head-split layout agree
        if quota_bytes < 0:
            raise OutOfRange(f"quota_bytes must be >= 0, got {quota_bytes}")
        known = self._layouts.get(ns)
        if known is None:
            self._layouts[ns] = layout
            self.pool.save_layouts(self._layouts)
        elif known != layout:
            raise LayoutMismatch(f"namespace {ns.hex()} is registered with another layout "
                                 f"({known.description or known.segment_bytes[:4]}...)")
        caps = [q for q in (quota_bytes, self.namespace_quota) if q > 0]
        if caps:
            self._set_quota(ns, min(caps))
        else:
            self._quota.pop(ns, None)
            self._ns_lru.pop(ns, None)

    def quota_of(self, ns: bytes) -> int:
        return self._quota.get(ns, 0)

    def used_bytes_of(self, ns: bytes) -> int:
        return self._ns_bytes.get(ns, 0)

    def namespace_usage(self) -> list[NamespaceInfo]:
        """Per registered namespace: blocks, bytes and quota (for `kvpool info` and metrics)."""
        return [NamespaceInfo(ns, layout.description, 0 if layout.kv_heads else layout.tp_size,
                              self._ns_blocks.get(ns, 0), self._ns_bytes.get(ns, 0),
                              self._quota.get(ns, 0))
                for ns, layout in self._layouts.items()]

    def _set_quota(self, ns: bytes, quota: int) -> None:
        self._quota[ns] = quota
        if ns not in self._ns_lru:
            slots = self._slots
            lru = self._ns_lru[ns] = LruPolicy(lambda sid: slots[sid].last_use)
            held = sorted((s for s in self._tables.get(ns, _EMPTY).values()
                           if s.state == COMMITTED), key=lambda s: s.last_use)
            for s in held:
                lru.insert(s.id)

    def layout_of(self, ns: bytes) -> Layout:
        try:
            return self._layouts[ns]
        except KeyError:
            raise UnknownId(f"namespace {ns.hex()} has no registered layout: no worker of "
                            f"that model and layout has registered") from None

    def has_layout(self, ns: bytes) -> bool:
        return ns in self._layouts

    @property
    def namespaces(self) -> int:
        return len(self._layouts)

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
        get = self._tables.get(ns, _EMPTY).get
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
        get = self._tables.get(ns, _EMPTY).get
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
        return [h for h, s in self._tables.get(ns, _EMPTY).items() if s.state == COMMITTED]

    def pinned_count(self) -> int:
        """Committed blocks held by a lease or an in-flight load (not evictable now)."""
        return sum(1 for s in self._slots.values() if s.state == COMMITTED and s.pins > 0)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def leases_of(self, owner: int) -> int:
        return sum(1 for lease in self._leases.values() if lease.owner == owner)

    # ---- stores ----------------------------------------------------------------------------

    def prepare_store(self, ns: bytes, keys: list[bytes], owner: int, now: float) -> list[int]:
        """A slot ref to write for each key not committed or in flight, else ``SLOT_PRESENT``;
        ``SLOT_NO_SPACE`` where nothing could be evicted. ``PoolFull`` if no key got room."""
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
                if s is None or s is _OVER_QUOTA:
                    out.append(SLOT_NO_SPACE)
                    full += 1
                    over_quota += s is _OVER_QUOTA
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
        caller to set; None where nothing could be evicted, ``_OVER_QUOTA`` where the quota
        stops it. Its pool record is the caller's to
        write, with ``_record_claims``, before the slot's ref leaves the daemon."""
        if quota and not self._fits_quota(ns, slot_bytes, quota):
            return _OVER_QUOTA
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
        """Tickets granted and not bound, aborted or expired yet (they take no pool space)."""
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
        allocation alone (bench/big_job_path.py times both)."""
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
        get, bound = self._slots.get, self._bound.get
        writing = WRITING
        slots = []
        add = slots.append
        for i, ref in enumerate(refs):
            s = bound(ref)
            if s is None:
                s = get(ref & 0xFFFF_FFFF)
                if s is None or s.ref != ref:
                    return None
            if (s.state != writing or s.doomed or s.ns != ns or (s.landed | s.writing) & bit
                    or (keys is not None and s.key[16:] != keys[i])):
                return None
            add(s)
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
                if s is None or s is _OVER_QUOTA:
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
        slots committed."""
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
                if s is None or s is _OVER_QUOTA:
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
        victims = list(self._tables.get(ns, _EMPTY).values())
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


_EMPTY: dict[bytes, Slot] = {}
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

# A sentinel for "this ref's slot exists but was reused": resolves to a slot in no valid state.
_STALE = Slot(-1, -1, -1, 0, SizeClass(0), state=FREE, doomed=True)
# What ``_claim`` answers when a namespace's quota, not the pool, is out of room.
_OVER_QUOTA = Slot(-2, -1, -1, 0, SizeClass(0), state=FREE, doomed=True)
# The size class of void placeholders: they hold no pool space, so no real class counts them.
_VOID_CLASS = SizeClass(0)
