"""Reservation tickets: refs handed to a scheduler ahead of its stores, bound to nothing yet.

A ticket takes no pool space and evicts nothing (issue 26): it costs one dict entry here. The
index (``daemon/index.py``) finds a ticket's slot when the first rank's store names its key and
then spends the ticket; this module only grants, counts, expires and forgets them. Its ticket
refs are slot refs whose index lies above every slot id of the pool, with a generation, so a
ticket never names a slot, a slot ref never a ticket, and a stale ticket is refused.

Must never: touch the pool or a slot. Runs on the daemon's event loop thread, never blocks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from kvpool.daemon.pool import GENERATION_MASK
from kvpool.shared.protocol import make_slot_ref


@dataclass(slots=True, eq=False)
class Grant:
    """The tickets one ``reserve`` call handed out (one object for all of them: a ticket costs
    a dict entry, not an object)."""

    owner: int
    ns: bytes
    slot_bytes: int
    deadline: float
    refs: range                 # its ticket refs, consecutive
    live: int                   # how many of them are not bound, aborted or expired yet


class TicketRefs:
    """Ticket refs: slot refs whose index lies in [first, 2**32), above every slot id of the
    pool. A sequence number runs through that range and on into the generation (31 bits, so
    refs stay positive int64): a ticket ref repeats only after 2**31 passes through the range.
    The sequence starts at a random pass, as the pool's generations do, so a restarted daemon
    does not hand out the refs of the previous one (the server also refuses a store naming
    another daemon's grant). One grant's refs are consecutive integers (a ``range``), never
    split across passes."""

    def __init__(self, first: int) -> None:
        self.first = first
        # A pool has fewer than 2**32 records (daemon/pool.py); a pool so close to that
        # leaves a short range, which only makes the passes more frequent.
        self.span = max(1, (1 << 32) - first)
        self.seq = self.start = random.getrandbits(31) * self.span

    def take(self, n: int) -> range:
        n = min(n, self.span)
        off = self.seq % self.span
        if off + n > self.span:
            self.seq += self.span - off
            off = 0
        generation = (self.seq // self.span) & GENERATION_MASK
        self.seq += n
        lo = make_slot_ref(self.first + off, generation)
        return range(lo, lo + n)

    def issued(self, ref: int) -> bool:
        """Whether ``ref`` is a ticket ref this daemon has handed out (bound, spent or not):
        a store naming one that is gone is told it expired, any other is out of range."""
        index = ref & 0xFFFF_FFFF
        return (index >= self.first
                and self.start <= (ref >> 32) * self.span + index - self.first < self.seq)


class Tickets:
    """The unbound tickets of every owner. Callers: the index only."""

    def __init__(self, first_ref_index: int) -> None:
        self.unbound: dict[int, Grant] = {}       # ticket ref -> its grant
        self.grants: dict[Grant, None] = {}        # grants with a ticket left, oldest first
        self.held: dict[tuple[int, int], int] = {}     # (owner, slot bytes) -> its tickets
        self.refs = TicketRefs(first_ref_index)

    def __len__(self) -> int:
        return len(self.unbound)

    def grant(self, owner: int, ns: bytes, slot_bytes: int, count: int, cap: int,
              deadline: float) -> list[int]:
        """Up to ``count`` new tickets of ``ns`` for ``owner``, as many as keep its tickets of
        ``slot_bytes`` within ``cap``; they go at ``deadline`` unless spent first."""
        key = (owner, slot_bytes)
        held = self.held.get(key, 0)
        count = min(count, max(0, cap - held))
        if not count:
            return []
        refs = self.refs.take(count)
        grant = Grant(owner, ns, slot_bytes, deadline, refs, len(refs))
        self.unbound.update(dict.fromkeys(refs, grant))
        self.grants[grant] = None
        self.held[key] = held + len(refs)
        return list(refs)

    def spend(self, refs: list[int]) -> None:
        """Tickets ``refs`` (unbound, checked) are bound or given up: off their owners'
        counts, counted once per grant (a job's tickets come from a few grants)."""
        grants = list(map(self.unbound.pop, refs))
        if grants and grants.count(grants[0]) == len(grants):
            # one grant, nearly always: a C-level count, not a Counter (4% of a store job's
            # loop work, bench/investigations/store_job_ab.py)
            self._shrink(grants[0], len(grants))
            return
        for grant, n in Counter(grants).items():
            self._shrink(grant, n)

    def abort(self, ref: int, owner: int) -> bool | None:
        """Give up ticket ``ref`` of ``owner``: True if it went, False if it is another
        owner's, None if it is no unbound ticket."""
        grant = self.unbound.get(ref)
        if grant is None:
            return None
        if grant.owner != owner:
            return False
        del self.unbound[ref]
        self._shrink(grant, 1)
        return True

    def expire(self, now: float) -> int:
        """Drop every unbound ticket whose grant's deadline has passed; returns how many."""
        return sum(self._drop(g) for g in [g for g in self.grants if g.deadline <= now])

    def release_owner(self, owner: int) -> int:
        """Drop every unbound ticket of ``owner``; returns how many."""
        return sum(self._drop(g) for g in [g for g in self.grants if g.owner == owner])

    def _shrink(self, grant: Grant, n: int) -> None:
        grant.live -= n
        key = (grant.owner, grant.slot_bytes)
        left = self.held[key] - n
        if left:
            self.held[key] = left
        else:
            del self.held[key]
        if not grant.live:
            del self.grants[grant]

    def _drop(self, grant: Grant) -> int:
        unbound = self.unbound
        gone = [r for r in grant.refs if unbound.get(r) is grant]
        for r in gone:
            del unbound[r]
        self._shrink(grant, len(gone))
        return len(gone)
