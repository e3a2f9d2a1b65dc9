"""A pool slot's in-memory record, and the store and load paths' passes over a batch of them.

``Slot`` says where a block lives and, for the slot table, what state it is in. Two
implementations with the same fields and passes: ``daemon/_slot_record.c`` where the install
built it (its ints inline in one object, each pass one C loop: a store job's claims, ends and
commits, and a load's resolve, pins and unpins, touch every slot of the job while the slots
are cold, issue 36), else the dataclass and the Python passes below, which stay the
reference. ``RECORDS`` is the one in use; an ``Extents`` takes it at construction, and every
slot of a pool is of that one kind.

The passes change only the slots given (and ``end``'s ``bound``, ``commit``'s maps): the slot
table and the store path keep their rules, and call them where their loops were.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from operator import attrgetter
from types import SimpleNamespace

from kvpool.daemon.key_table import SHARDS, shard_index

try:
    from kvpool.daemon import _slot_record
except ImportError:       # no C compiler at install: the dataclass and the Python passes
    _slot_record = None


@dataclass(slots=True, eq=False)
class Slot:
    id: int
    extent: int
    index: int
    offset: int                 # pool byte offset of rank 0's shard
    size_class: object          # its extents.SizeClass
    state: int = 0              # FREE
    ns: bytes = b""
    key: bytes = b""            # ns + block hash (32 bytes), as in the slot record
    block_hash: bytes = b""     # key[16:], kept: batch passes unmap it without slicing
    # The slot ref of the current generation, which is the ref's upper half (``generation``):
    # one int a slot, made once a claim (see ``claim``).
    ref: int = 0
    pins: int = 0
    reads: int = 0              # lower-tier reads in flight (no pin: see SlotTable.begin_read)
    landed: int = 0             # bit u: unit u (a head, or a rank's shard) is in
    writing: int = 0            # bit u: a store job of unit u is in flight
    owner: int = 0              # who bound it (while WRITING)
    deadline: float = 0.0       # WRITING: dropped if not landed by then
    last_use: int = 0           # tick of its commit, its last hit or its last unpin
    doomed: bool = False        # unreachable; freed when its last pin goes
    void: bool = False          # a ticket bound to no slot (duplicate, no room): never written
    ticket: int = 0             # the ticket ref that bound it, while WRITING (0: none)

    @property
    def generation(self) -> int:
        return self.ref >> 32


def make_slots(base: int, extent: int, first_offset: int, slot_bytes: int, size_class: object,
               generations: list[int]) -> list[Slot]:
    """A fresh extent's slots, ids from ``base``, refs at the recorded ``generations``."""
    return [Slot(base + i, extent, i, first_offset + i * slot_bytes, size_class,
                 ref=(g << 32) | (base + i)) for i, g in enumerate(generations)]


def claim(slots: list[Slot], hashes: list[bytes], tickets: list[int] | None, ns: bytes,
          state: int, owner: int, deadline: float, pin_units: int, pins: int,
          ref_limit: int) -> list[int]:
    """``SlotTable.claim``'s pass: each slot's next generation (past ``ref_limit``, its id
    again), state, key, owner, deadline, units in flight, pins and ticket. Returns the new
    generations."""
    _same_length(slots, hashes, "hashes")
    if tickets is not None:
        _same_length(slots, tickets, "tickets")
    # checked whole before any slot changes, as the compiled pass does (C-level passes)
    if not set(map(type, slots)) <= {Slot}:
        raise TypeError("a claim's slots must all be slots")
    if not set(map(type, hashes)) <= {bytes}:
        raise TypeError("a claim's hashes must all be bytes")
    generations = []
    for i, (s, h) in enumerate(zip(slots, hashes)):
        ref = s.ref + _GENERATION_ONE
        s.ref = ref if ref < ref_limit else s.id
        s.state = state
        s.ns = ns
        s.key = ns + h
        s.block_hash = h
        s.owner = owner
        s.deadline = deadline
        s.writing = pin_units
        s.pins = pins
        s.ticket = 0 if tickets is None else tickets[i]
        generations.append(s.ref >> 32)
    return generations


def end(slots: list[Slot], bit: int, ok: bool, full: int, bound: dict[int, Slot]
        ) -> tuple[list[Slot], list[Slot]]:
    """``StorePath.end_store``'s pass: units ``bit`` no longer in flight and one pin less on
    each slot; with ``ok`` they landed, and the slots now full are ready (their ticket's binding
    leaves ``bound`` where it is still theirs); without, each is doomed. Returns (ready,
    doomed)."""
    ready: list[Slot] = []
    doomed: list[Slot] = []
    for s in slots:
        s.writing &= ~bit
        s.pins -= 1
        if not ok:
            s.doomed = True
        elif not s.doomed:
            s.landed |= bit
            if s.landed == full:
                ready.append(s)
                if bound.get(s.ticket) is s:
                    del bound[s.ticket]
                continue
        if s.doomed:
            doomed.append(s)
    return ready, doomed


def commit(slots: list[Slot], tick: int, committed: int, writing: dict[int, Slot],
           filling: dict[int, Slot]) -> list[Slot]:
    """``SlotTable.commit``'s pass: out of ``writing`` (else ``filling``), ``committed``, no
    ticket, last used at ``tick``. Returns the unpinned ones (evictable)."""
    evictable = []
    pop_w, pop_f = writing.pop, filling.pop
    for s in slots:
        if pop_w(s.id, None) is None:
            pop_f(s.id, None)
        s.state = committed
        s.ticket = 0
        s.last_use = tick
        if not s.pins:
            evictable.append(s)
    return evictable


def evict(victims: list[Slot], free: int) -> list[int]:
    """``SlotTable.evict_many``'s pass over victims freed now: ``free``, nothing landed.
    Returns their ids."""
    for s in victims:
        s.state = free
        s.landed = 0
    return [s.id for s in victims]


def batch_of(slots: list[Slot]) -> tuple[bytes | None, object | None, int, int]:
    """What a batch shares: its namespace and size class where every slot has the same (else
    None), its extent where all sit in one (else -1), and how many slots a lower tier reads."""
    if not slots:
        return None, None, -1, 0
    names = set(map(_NS, slots))
    classes = set(map(id, map(_CLASS, slots)))
    extents = set(map(_EXTENT, slots))
    return (names.pop() if len(names) == 1 else None,
            slots[0].size_class if len(classes) == 1 else None,
            extents.pop() if len(extents) == 1 else -1,
            sum(1 for s in slots if s.reads > 0))


def record_lists(slots: list[Slot]) -> tuple[list[int], list[bytes], list[int]]:
    """What the pool's records of a commit need: (ids, keys, generations)."""
    return (list(map(_ID, slots)), list(map(_KEY, slots)),
            [s.ref >> 32 for s in slots])


def slot_at(rows: list[list[Slot] | None], stride: int, sid: int) -> Slot | None:
    """The slot of id ``sid`` (>= 0) in ``rows`` (as ``slots_of``'s), or None."""
    e, i = divmod(sid, stride)
    row = rows[e] if e < len(rows) else None
    if row is None:
        return None
    if type(row) is not list:
        raise TypeError(f"an extent's row is a {type(row).__name__}, not a list")
    return row[i] if i < len(row) else None


def slots_of(rows: list[list[Slot] | None], stride: int, ids: list[int]) -> list[Slot]:
    """The slots of ``ids`` (``rows``: each extent's slots by index, an id being its extent
    times ``stride`` plus its index); KeyError for an id that names none."""
    if stride <= 0:
        raise ValueError("the stride must be positive")
    out = []
    for sid in ids:
        s = slot_at(rows, stride, sid) if isinstance(sid, int) and sid >= 0 else None
        if s is None:
            raise KeyError(sid)
        out.append(s)
    return out


def resolve(refs: list[int], rows: list[list[Slot] | None], stride: int, ns: bytes,
            committed: int, filling: int) -> tuple[list[Slot | None], list[int]]:
    """``Index.resolve_load``'s first pass: per ref, the slot it names (``rows``, ``stride``:
    as ``slots_of``'s) while that slot still holds it (the same ref, ``committed`` or
    ``filling``, not doomed, of ``ns``), else None; and the indices of the Nones (0 refs too),
    for the caller's look by key. Changes nothing."""
    if stride <= 0:
        raise ValueError("the stride must be positive")
    found: list[Slot | None] = []
    redo: list[int] = []
    for i, ref in enumerate(refs):
        if not isinstance(ref, int):
            raise TypeError(f"refs[{i}] is a {type(ref).__name__}, not an int")
        s = slot_at(rows, stride, ref & 0xFFFF_FFFF) if ref else None
        if (s is None or s.ref != ref or (s.state != committed and s.state != filling)
                or s.doomed or s.ns != ns):
            s = None
            redo.append(i)
        found.append(s)
    return found, redo


def held_count(rows: list[list[Slot] | None], committed: int) -> int:
    """``SlotTable.pinned_count``'s pass: how many slots of ``rows`` (each extent's slot list,
    or None) are ``committed`` and pinned or read."""
    n = 0
    for row in rows:
        if row is None:
            continue
        if type(row) is not list:
            raise TypeError(f"an extent's row is a {type(row).__name__}, not a list")
        n += sum(1 for s in row if s is not None and s.state == committed
                 and (s.pins > 0 or s.reads > 0))
    return n


def of_namespace(rows: list[list[Slot] | None], stride: int, order: bytes, ns: bytes
                 ) -> list[Slot]:
    """The slots named by ``order`` (native int64 ids, as an LRU queue's ``order()``) whose
    namespace is ``ns``, in that order. ``rows``, ``stride``: as ``slots_of``'s; KeyError for
    an id that names no slot."""
    if not isinstance(ns, bytes):
        raise TypeError(f"the namespace is a {type(ns).__name__}, not bytes")
    ids = memoryview(order).cast("B")
    if len(ids) % 8:
        raise ValueError("the order is not a whole number of int64 ids")
    return [s for s in slots_of(rows, stride, ids.cast("q").tolist()) if s.ns == ns]


def committed_hashes(rows: list[list[Slot] | None], ns: bytes, committed: int
                     ) -> list[bytes]:
    """The block hashes of the slots of ``rows`` (each extent's slot list, or None) of
    namespace ``ns`` that are ``committed`` and not doomed, in slot order."""
    if not isinstance(ns, bytes):
        raise TypeError(f"the namespace is a {type(ns).__name__}, not bytes")
    out = []
    for row in rows:
        if row is None:
            continue
        if type(row) is not list:
            raise TypeError(f"an extent's row is a {type(row).__name__}, not a list")
        out += [s.block_hash for s in row if s is not None and s.state == committed
                and not s.doomed and s.ns == ns]
    return out


def leading(shards: tuple[dict[bytes, Slot], ...], keys: list[bytes], committed: int,
            filling: int) -> tuple[list[Slot], list[int]]:
    """``Index.lookup``'s walk of one key list: the slots (``shards``: a key table's dicts,
    block hash -> slot, ``daemon/key_table.py``) of its keys from the first on while each is
    held (``committed`` or ``filling``, not doomed), and their refs. Changes nothing."""
    if not isinstance(shards, tuple) or len(shards) != SHARDS:
        raise TypeError("the shards must be a key table's 256 dicts")
    run = []
    for k in keys:
        s = shards[shard_index(k)].get(k)
        if s is None or (s.state != committed and s.state != filling) or s.doomed:
            break
        run.append(s)
    return run, [s.ref for s in run]


def pin(slots: list[Slot], tick: int, newest_use: list[int], committed: int) -> list[Slot]:
    """``SlotTable.pin``'s pass: one pin more on each slot, each used at ``tick`` (its
    ``last_use`` and its extent's ``newest_use``). Returns those that left the queues
    (committed, not doomed, unpinned until now), in order."""
    _check_extents(slots, newest_use)
    left = []
    for s in slots:
        if not s.pins and s.state == committed and not s.doomed:
            left.append(s)
        s.pins += 1
        s.last_use = newest_use[s.extent] = tick
    return left


def unpin(slots: list[Slot], tick: int, newest_use: list[int], committed: int, free: int,
          draining: dict[int, object]) -> tuple[list[Slot], list[Slot]]:
    """``SlotTable.unpin``'s pass: one pin less on each slot. Of those whose last pin went and
    that are not ``free``: the doomed ones and the committed ones of a ``draining`` extent are
    to be freed; the other committed ones are used at ``tick`` and evictable again. Returns
    (evictable, to_free), both in order."""
    _check_extents(slots, newest_use)
    evictable: list[Slot] = []
    to_free: list[Slot] = []
    for s in slots:
        s.pins -= 1
        if s.pins or s.state == free:
            continue
        if s.doomed or (s.state == committed and s.extent in draining):
            to_free.append(s)
        elif s.state == committed:
            s.last_use = newest_use[s.extent] = tick
            evictable.append(s)
    return evictable, to_free


def touch(slots: list[Slot], tick: int, newest_use: list[int]) -> list[Slot]:
    """``SlotTable.touch``'s pass: each slot used at ``tick``. Returns the unpinned ones
    (queued: to be made most recently used there), in order."""
    _check_extents(slots, newest_use)
    for s in slots:
        s.last_use = newest_use[s.extent] = tick
    return [s for s in slots if not s.pins]


def offsets(slots: list[Slot]) -> bytearray:
    """Each slot's pool offset as native int64s, in order."""
    return bytearray(array("q", map(_OFFSET, slots)))


def _check_extents(slots: list[Slot], newest_use: list[int]) -> None:
    # checked whole before any slot changes, as the compiled passes do
    if not set(map(type, slots)) <= {Slot}:
        raise TypeError("a pass's slots must all be slots")
    for s in slots:
        if not 0 <= s.extent < len(newest_use):
            raise IndexError(f"slot {s.id}'s extent {s.extent} is not one of the "
                             f"{len(newest_use)}")


def _same_length(slots: list, other: list, what: str) -> None:
    if len(other) != len(slots):
        raise ValueError(f"{len(other)} {what} for {len(slots)} slots")


_GENERATION_ONE = 1 << 32
_NS, _CLASS, _EXTENT = attrgetter("ns"), attrgetter("size_class"), attrgetter("extent")
_ID, _KEY, _OFFSET = attrgetter("id"), attrgetter("key"), attrgetter("offset")

_PASSES = ("make_slots", "claim", "end", "commit", "evict", "batch_of", "record_lists",
           "resolve", "slots_of", "held_count", "of_namespace", "committed_hashes", "leading",
           "pin", "unpin", "touch", "offsets")
PYTHON = SimpleNamespace(name="python", Slot=Slot, **{p: globals()[p] for p in _PASSES})
COMPILED = None if _slot_record is None else SimpleNamespace(
    name="compiled", Slot=_slot_record.Slot, **{p: getattr(_slot_record, p) for p in _PASSES})
# What a new pool's slots are made of (tests switch it to run one path or the other).
RECORDS = COMPILED or PYTHON
