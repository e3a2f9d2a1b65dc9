"""What the disk tier's directory holds, in memory, and its space: ``DiskCatalog``.

No I/O and no threads: ``daemon/disk_tier.py`` asks it where new blocks go and tells it what
landed, was read or failed; it answers from memory and hands back the indices to free.

- **Tables.** Namespace → block hash → ``DiskBlock``. A block is WRITING until the tier says
  its data and record are durable, then VALID: only VALID blocks count in ``leading``, enter
  the LRU and are announced (by the tier) as held. Every block leaving the LRU is announced as
  dropped (``events.dropped``), whatever took it: an eviction, a reset, a failed read.
- **Placement.** A new block gets the lowest free index of its size, else the file's next,
  else the LRU's oldest unread block: the same size reuses its index in place, another size's
  is released and the search goes on. Lowest first keeps the files dense and runs sequential.
- **Readers.** Blocks being promoted are pinned (``readers``), so the LRU cannot hand their
  index to a write; one dropped while read is released when its last reader ends.
- **Space.** ``used_bytes`` (blocks held and being written) never passes ``capacity_bytes``.
  A released index is counted free at once but returns to its size's free heap (``reuse``)
  only after the tier has zeroed its record and punched its space (``take_to_free``), so no
  write can race the free of the same index.
- **Restart.** ``adopt`` rebuilds the tables and the LRU in write order from what the store's
  scan found: a key found twice keeps its newest copy, and beyond capacity the oldest go.
- **No rebuild of everything.** A disk holds millions of blocks, and a dict (or an
  OrderedDict) of them rebuilds itself whole, with the GIL held, as it grows and as it sheds
  its deletions' holes: 152 ms for an OrderedDict of 1M churned (this VM), once about every 1M
  writes of a full disk, on the daemon's event loop. So the tables are key tables of 256 dicts
  (``daemon/key_table.py``) and the LRU is the pool's queue of ids (``daemon/eviction.py``):
  a VALID block takes a dense id while it is queued (``_by_id``), given back when it leaves.
  Nor does the cyclic collector walk them: a ``DiskBlock`` is not tracked by it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvpool.daemon.disk_store import Found
from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.key_table import KeyTable
from kvpool.daemon.tier import TierEvents

WRITING, VALID = 1, 2


@dataclass(slots=True, eq=False)
class SizeFile:
    """The indices of one block size's data file."""
    slot_bytes: int
    free: list[int] = field(default_factory=list)   # heap of free block indices
    high: int = 0                                    # indices below this have been used


class DiskBlock(msgspec.Struct, eq=False, gc=False):
    """One block's record. Untracked by the cyclic collector (``gc=False``: it refers to
    nothing that refers back): a disk holds millions, each written block survives into the
    oldest generation, and their churn set off full collections that walked every one with
    the GIL held (``bench/investigations/disk_gc.py``)."""

    key: bytes                 # namespace + block hash, as in the pool
    size: SizeFile
    index: int                 # block index in its size's file
    state: int = WRITING
    checksum: int = 0
    seq: int = 0               # write order (the LRU order a restart rebuilds)
    readers: int = 0           # promotions in flight
    doomed: bool = False       # dropped while in flight: freed when that ends
    lru_id: int = -1           # its id in the LRU while queued (VALID, reachable), else -1


def _tables_of(raw: bytes, blocks: list[DiskBlock]) -> dict[bytes, KeyTable]:
    """The tables (namespace → block hash → block) of ``blocks``, whose keys are ``raw`` (32
    bytes each, in order): grouped with numpy, as ``DiskCatalog.adopt`` needs at startup."""
    names = np.frombuffer(raw, "V16")
    ns_of, hashes = names[0::2], names[1::2].tolist()
    uniq, inverse = np.unique(ns_of, return_inverse=True)
    by_ns = np.argsort(inverse, kind="stable")
    cuts = np.flatnonzero(np.diff(inverse[by_ns])) + 1
    tables: dict[bytes, KeyTable] = {}
    for ns, group in zip(uniq.tolist(), np.split(by_ns, cuts)):
        g = group.tolist()
        tables[ns] = KeyTable()
        tables[ns].put_many(list(map(hashes.__getitem__, g)), list(map(blocks.__getitem__, g)))
    return tables


class DiskCatalog:
    """Called on the daemon's event loop only (by ``DiskTier``), or at startup before it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        # The tier's listener once it is bound (``DiskTier.bind``): nobody listens until then.
        self.events: TierEvents = TierEvents()
        self._tables: dict[bytes, KeyTable] = {}
        self._lru = LruPolicy()
        self._by_id: list[DiskBlock | None] = []    # LRU id -> its block
        self._free_ids: list[int] = []
        self._sizes: dict[int, SizeFile] = {}
        self._to_free: dict[SizeFile, list[int]] = {}
        self._seq = 1
        self.used_bytes = 0
        self.blocks = 0
        self.evicted_blocks = self.adopted_blocks = 0

    def size(self, slot_bytes: int) -> SizeFile:
        size = self._sizes.get(slot_bytes)
        if size is None:
            size = self._sizes[slot_bytes] = SizeFile(slot_bytes)
        return size

    def adopt(self, found: list[Found]) -> list[tuple[int, np.ndarray]]:
        """Index what the store's scan found, before anything else is placed. Returns the
        (slot bytes, indices) of the copies not kept, whose records the store must free.
        Vectorised but for one object per block (0.6 s per 100k blocks as a plain loop on a
        2-core host)."""
        sizes = [self.size(f.slot_bytes) for f in found]
        for f, size in zip(found, sizes):
            size.high = f.file_blocks
            size.free = list(range(f.file_blocks))     # until a record says otherwise
        if not any(len(f.indices) for f in found):
            return []
        which = np.concatenate([np.full(len(f.indices), i) for i, f in enumerate(found)])
        index = np.concatenate([f.indices for f in found])
        rec = np.concatenate([f.records for f in found])
        order = np.argsort(rec["seq"], kind="stable")
        which, index, rec = which[order], index[order], rec[order]
        n = len(rec)
        keep = np.zeros(n, bool)
        _, newest = np.unique(rec["key"][::-1], return_index=True)
        keep[n - 1 - newest] = True
        nbytes = np.asarray([f.slot_bytes for f in found], np.int64)[which] * keep
        keep &= np.cumsum(nbytes[::-1])[::-1] <= self.capacity_bytes   # the newest that fit
        kept = np.flatnonzero(keep)
        raw = rec["key"][kept].tobytes()
        keys = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        blocks = list(map(DiskBlock, keys, [sizes[w] for w in which[kept].tolist()],
                          index[kept].tolist(), itertools.repeat(VALID, len(kept)),
                          rec["checksum"][kept].tolist(), rec["seq"][kept].tolist()))
        self._lru = LruPolicy(len(blocks))
        self._by_id, self._free_ids = [], []
        for b in blocks:
            self._queue(b)
        self._tables = _tables_of(raw, blocks)
        self.blocks = self.adopted_blocks = len(blocks)
        self.used_bytes = int(nbytes[kept].sum())
        self._seq = int(rec["seq"].max()) + 1
        stale_of: list[tuple[int, np.ndarray]] = []
        for w, size in enumerate(sizes):
            mine = (which == w)
            held = index[mine & keep]
            size.free = np.setdiff1d(np.arange(size.high), held).tolist()   # sorted: a heap
            stale = index[mine & ~keep]
            if len(stale):
                stale_of.append((size.slot_bytes, stale))
        return stale_of

    # ---- questions (from memory) ------------------------------------------------------------

    def held_keys(self) -> list[bytes]:
        """The keys of every VALID block, oldest use first. (The queue's ids as one bytes,
        read an id at a time: its iterator makes a list of every id as ints in one C call,
        which held the GIL ~65 ms at 575K blocks, this VM, while a restarted daemon
        published them from a thread.)"""
        by_id, ids = self._by_id, memoryview(self._lru.order()).cast("q")
        return [by_id[i].key for i in ids]    # type: ignore[union-attr]

    def leading(self, ns: bytes, hashes: list[bytes], slot_bytes: int) -> int:
        table = self._tables.get(ns)
        if table is None:
            return 0
        n = 0
        for h in hashes:
            b = table.get(h)
            if b is None or b.state != VALID or b.size.slot_bytes != slot_bytes:
                break
            n += 1
        return n

    def wants(self, key: bytes, slot_bytes: int) -> bool:
        if slot_bytes > self.capacity_bytes:
            return False
        table = self._tables.get(key[:16])
        return table is None or key[16:] not in table

    # ---- writes -----------------------------------------------------------------------------

    def claim(self, keys: list[bytes], size: SizeFile) -> tuple[list[DiskBlock], list[int]]:
        """New WRITING blocks for the first of ``keys`` that fit, their bytes counted, in the
        tables already (so ``wants`` says no while they are written); and which of their indices
        overwrite a block evicted for them (the store zeroes those records first)."""
        blocks: list[DiskBlock] = []
        replaced: list[int] = []
        for key in keys:
            got = self._place(size)
            if got is None:
                break
            index, reused = got
            b = DiskBlock(key, size, index, WRITING, seq=self._seq)
            self._seq += 1
            table = self._tables.get(key[:16])
            if table is None:
                table = self._tables[key[:16]] = KeyTable()
            table[key[16:]] = b
            blocks.append(b)
            if reused:
                replaced.append(index)
        return blocks, replaced

    def landed(self, b: DiskBlock, checksum: int) -> bool:
        """``b``'s data and record are durable. Whether it can be served: not when it was
        dropped (a reset) while written, which releases it now."""
        b.checksum = checksum
        b.state = VALID
        if b.doomed:
            self._release(b)
            return False
        self._queue(b)
        self.blocks += 1
        return True

    def lose(self, blocks: list[DiskBlock]) -> None:
        """Blocks whose write failed or will not be committed: unreachable, their space
        uncounted but never freed (the tier is off; their records were never written)."""
        for b in blocks:
            b.doomed = True
            self._unmap(b)
        self.used_bytes -= sum(b.size.slot_bytes for b in blocks)

    def _place(self, size: SizeFile) -> tuple[int, bool] | None:
        """(block index, whether it overwrites a block evicted for it) for one new block of
        ``size``, with its bytes counted; None if nothing can make room."""
        need = size.slot_bytes
        while self.used_bytes + need > self.capacity_bytes:
            victim = self._oldest_unread()
            if victim is None:
                return None
            self.evicted_blocks += 1
            self._unmap(victim)
            if victim.size is size:
                return victim.index, True    # its bytes are counted for the new block
            self._release(victim)
        self.used_bytes += need
        if size.free:
            return heapq.heappop(size.free), False
        size.high += 1
        return size.high - 1, False

    # ---- reads ------------------------------------------------------------------------------

    def pin(self, key: bytes, slot_bytes: int) -> DiskBlock | None:
        """The servable block ``key`` of ``slot_bytes``, pinned against eviction and marked
        used; None if there is none. Every pin ends with ``unpin``."""
        table = self._tables.get(key[:16])
        b = table.get(key[16:]) if table is not None else None
        if b is None or b.state != VALID or b.doomed or b.size.slot_bytes != slot_bytes:
            return None
        b.readers += 1
        self._lru.touch(b.lru_id)
        return b

    def unpin(self, blocks: list[DiskBlock | None], bad: list[DiskBlock]) -> None:
        """The reads of ``blocks`` (None: not pinned) ended; ``bad`` failed verification and
        is dropped. A block dropped while read is released by its last reader."""
        for b in blocks:
            if b is not None:
                b.readers -= 1
        for b in bad:
            self._unmap(b)
            b.doomed = True
        for b in blocks:
            if b is not None and b.doomed and b.readers == 0:
                self._release(b)

    # ---- the rest ---------------------------------------------------------------------------

    def forget(self, ns: bytes) -> int:
        """Drop every block of ``ns`` (a reset); those being written or read are released
        when that ends. Returns how many."""
        table = self._tables.get(ns)
        if table is None:
            return 0
        blocks = list(table.values())
        for b in blocks:
            self._unmap(b)
            b.doomed = True
            if b.state == VALID and b.readers == 0:
                self._release(b)
        return len(blocks)

    @property
    def has_to_free(self) -> bool:
        return bool(self._to_free)

    def take_to_free(self) -> dict[SizeFile, list[int]]:
        """The indices released since the last call, per size, for the store to free; each
        comes back through ``reuse`` once that is done (or never, if it fails)."""
        todo, self._to_free = self._to_free, {}
        return todo

    def reuse(self, size: SizeFile, indices: list[int]) -> None:
        for i in indices:
            heapq.heappush(size.free, i)

    def _unmap(self, b: DiskBlock) -> None:
        """Make ``b`` unreachable (table, LRU); its index stays taken."""
        table = self._tables.get(b.key[:16])
        if table is not None and table.get(b.key[16:]) is b:
            del table[b.key[16:]]
        if b.lru_id >= 0:
            self._lru.remove(b.lru_id)
            self._by_id[b.lru_id] = None
            self._free_ids.append(b.lru_id)
            b.lru_id = -1
            self.blocks -= 1
            self.events.dropped([b.key])

    def _queue(self, b: DiskBlock) -> None:
        """``b`` enters the LRU, most recently used, under a free id."""
        if self._free_ids:
            b.lru_id = self._free_ids.pop()
            self._by_id[b.lru_id] = b
        else:
            b.lru_id = len(self._by_id)
            self._by_id.append(b)
        self._lru.insert(b.lru_id)

    def _oldest_unread(self) -> DiskBlock | None:
        """The least recently used block no promotion is reading, or None. Reads in flight
        are few: the queue's head is asked for, more of it only past them."""
        n = 8
        while True:
            ids = self._lru.victims(n)
            for i in ids:
                b = self._by_id[i]
                if b is not None and b.readers == 0:
                    return b
            if len(ids) < n:
                return None
            n *= 4

    def _release(self, b: DiskBlock) -> None:
        """Give ``b``'s space back: counted now, its index in ``take_to_free``."""
        self.used_bytes -= b.size.slot_bytes
        self._to_free.setdefault(b.size, []).append(b.index)
