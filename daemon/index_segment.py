"""The shared-memory index the daemon publishes: where each committed key is, for schedulers.

Owns the segment (``shared/index_format.py`` gives its format): creates it with the socket's
owner, group and mode, writes entries with the seqlock protocol, retires a previous daemon's
segment of the same name (marking it superseded, so readers still mapping it stop believing it),
and unlinks it at shutdown. ``KeyLocations`` (below) decides what an entry says: it watches the
slot table (a block committed is in the pool; a block that leaves the pool is in the first lower
tier that holds it, or nowhere) and the lower tiers (a block written down or dropped there).

The daemon is the only writer; it never reads the segment (``_where`` mirrors which entry holds
which key). Every call runs on the event loop thread and never blocks: one dict probe and a few
8-byte stores per key (``put``), plus a short backward shift per removal (``remove``).
A table too full to take a key leaves it unpublished and counts it (``unpublished``): lookups
then miss it, which costs a recompute, never a wrong block.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import posix_ipc

from kvpool.shared import index_format as f
from kvpool.shared.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.daemon.extents import Slot
    from kvpool.daemon.namespaces import Namespaces
    from kvpool.daemon.tier import LowerTier

log = logging.getLogger("kvpoold")

# Keys published at most per entry of the table: past it a probe grows long and new keys wait.
MAX_LOAD = 0.75
_FREE_STATE = 0
_SEQ_SHIFT = np.uint64(8)
_LOCATION = np.uint64(0xFF)
_ONE, _TWO = np.uint64(1), np.uint64(2)
# Up to this many entries are written one by one (a few 8-byte stores each beat numpy's setup)
_SCALAR_WRITES = 4


def capacity_for(pool_bytes: int, disk_bytes: int, setting: int = 0) -> int:
    """Entries of the table: ``setting`` when given (a power of two is taken above it), else
    enough for twice the blocks of 16 KiB a pool of ``pool_bytes`` and a disk tier of
    ``disk_bytes`` can hold, between 4096 and 2**22 (192 MiB of mostly untouched pages)."""
    want = setting or 2 * (pool_bytes + disk_bytes) // (16 << 10)
    want = min(max(want, 4096), 1 << 26 if setting else 1 << 22)
    return 1 << (want - 1).bit_length()


class IndexSegment:
    """One published table. Callers: ``KeyLocations`` and the server's lifecycle."""

    def __init__(self, name: str, capacity: int, daemon_id: str, mode: int = 0o600,
                 gid: int = -1, flags: int = 0) -> None:
        assert capacity & (capacity - 1) == 0, "a power of two"
        self.name = name
        self.capacity = capacity
        self.bits = f.capacity_bits(capacity)
        self._mask = capacity - 1
        size = f.HEADER_BYTES + capacity * f.ENTRY_BYTES
        _retire(name)
        old = os.umask(0)
        try:
            self._shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
        finally:
            os.umask(old)
        try:
            os.fchmod(self._shm.fd, mode)
            if gid >= 0:
                os.fchown(self._shm.fd, -1, gid)
            # Reserved now, as the pool is: a page first touched when /dev/shm is full would
            # be a SIGBUS in the daemon's next publish, not an error at start.
            os.posix_fallocate(self._shm.fd, 0, size)
            self._buf = mmap.mmap(self._shm.fd, size)
        except OSError as e:
            self._shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise ConfigError(f"cannot reserve {size} bytes in /dev/shm for the index {name}: "
                              f"{e.strerror}; lower index_entries or make room") from None
        except BaseException:
            self._shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        self._shm.close_fd()
        self._words = memoryview(self._buf)[f.HEADER_BYTES:].cast("Q")
        self._table = np.frombuffer(self._buf, np.uint64, capacity * f.ENTRY_WORDS,
                                    f.HEADER_BYTES).reshape(capacity, f.ENTRY_WORDS)
        self._where: dict[bytes, int] = {}             # key -> its entry
        self._keys: list[bytes | None] = [None] * capacity   # entry -> its key
        self._homes: list[int] = [0] * capacity        # entry -> its key's home (a removal's
        #                                                shift reads it for every entry after)
        self.unpublished = 0
        self._put_header(f.H_MAGIC, f.MAGIC)
        self._put_header(f.H_VERSION, f.FORMAT_VERSION)
        self._put_header(f.H_CAPACITY, capacity)
        self._put_header(f.H_FLAGS, flags)
        self._put_header(f.H_DAEMON_ID, daemon_id.encode()[:32])

    def __len__(self) -> int:
        return len(self._where)

    def put(self, key: bytes, location: int, ref: int = 0) -> bool:
        """Publish ``key`` (32 bytes) at ``location``; False (counted) when the table is too
        full to take a new key."""
        i = self._where.get(key)
        if i is None:
            if len(self._where) >= MAX_LOAD * self.capacity:
                self.unpublished += 1
                return False
            i = h = f.home(key, self.bits)
            keys = self._keys
            while keys[i] is not None:
                i = (i + 1) & self._mask
            keys[i] = key
            self._homes[i] = h
            self._where[key] = i
            self._write(i, location, ref, key)
            self._put_header(f.H_PUBLISHED, len(self._where))
        else:
            self._write(i, location, ref, key)
        return True

    def put_many(self, keys: Sequence[bytes], location: int, refs: Sequence[int]) -> int:
        """Publish each of ``keys`` at ``location`` with its ref; returns how many were
        published (a key the table is too full to take is counted in ``unpublished``). The
        entries are written together: every state odd, then the bodies, then every state even
        (each entry's seqlock still brackets its body), a few numpy calls for any count."""
        where, keys_at, homes, mask = self._where, self._keys, self._homes, self._mask
        limit = MAX_LOAD * self.capacity
        new = [k for k in keys if k not in where]
        new_homes = dict(zip(new, _homes(new, self.bits))) if new else {}
        entries: dict[int, tuple[int, int, bytes]] = {}
        published = 0
        for key, ref in zip(keys, refs):
            i = where.get(key)
            if i is None:
                if len(where) >= limit:
                    self.unpublished += 1
                    continue
                i = h = new_homes[key]
                while keys_at[i] is not None:
                    i = (i + 1) & mask
                keys_at[i] = key
                homes[i] = h
                where[key] = i
            entries[i] = (location, ref, key)
            published += 1
        if entries:
            self._write_many(entries)
            self._put_header(f.H_PUBLISHED, len(where))
        return published

    def location(self, key: bytes) -> int:
        """What the entry of ``key`` says now (``EMPTY`` if unpublished): the writer's view."""
        i = self._where.get(key)
        return f.EMPTY if i is None else self._words[i * f.ENTRY_WORDS] & 0xFF

    def remove(self, key: bytes) -> None:
        self.remove_many([key])

    def remove_many(self, keys: Sequence[bytes]) -> None:
        """Withdraw ``keys`` (those unpublished are skipped); the entries after each in its
        cluster move back so that no probe needs a tombstone. The entries that change are
        written together at the end (a reader racing it may miss a key that moved: a miss,
        never a wrong hit)."""
        where, keys_at, homes, mask = self._where, self._keys, self._homes, self._mask
        moved: dict[int, int] = {}      # entry -> the entry whose old contents it now holds
        cleared: set[int] = set()
        for key in keys:
            i = where.pop(key, None)
            if i is None:
                continue
            j = i
            while True:
                j = (j + 1) & mask
                k = keys_at[j]
                if k is None:
                    break
                if ((j - homes[j]) & mask) >= ((j - i) & mask):    # k may live at i: move it
                    keys_at[i] = k
                    homes[i] = homes[j]
                    where[k] = i
                    moved[i] = moved.pop(j, j)
                    cleared.discard(i)
                    i = j
            keys_at[i] = None
            moved.pop(i, None)
            cleared.add(i)
        if not moved and not cleared:
            return
        words, w = self._words, f.ENTRY_WORDS
        # a moved key keeps the location and ref of the entry it came from
        self._write_many({i: (words[j * w] & 0xFF, words[j * w + 1], keys_at[i])
                          for i, j in moved.items()}, cleared)
        self._put_header(f.H_PUBLISHED, len(where))

    def close(self) -> None:
        """Mark the segment superseded and unlink it (readers drop their mapping when they see
        the mark)."""
        if self._buf.closed:
            return
        self._put_header(f.H_SUPERSEDED, 1)
        self._table = None      # type: ignore[assignment]  (its export pins the mapping)
        self._words.release()
        self._buf.close()
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    def _write_many(self, entries: dict[int, tuple[int, int, bytes]],
                    cleared: set[int] = frozenset()) -> None:
        """Entries ``entries`` (entry -> location, ref and key) and the entries ``cleared``
        made EMPTY, under their sequence numbers: every state odd, then the bodies, then every
        state even with its location. Each phase is one numpy pass of 8-byte stores, and
        x86-64 keeps stores in program order, so a reader that sees an even state equal before
        and after its read of a body read a body written whole."""
        n = len(entries)
        if n + len(cleared) <= _SCALAR_WRITES:
            for i, (location, ref, key) in entries.items():
                self._write(i, location, ref, key)
            for i in cleared:
                self._write(i, f.EMPTY, 0, None)
            return
        idx = np.fromiter(list(entries) + list(cleared), np.int64, n + len(cleared))
        table = self._table
        state = table[idx, 0]
        seq = state >> _SEQ_SHIFT
        table[idx, 0] = ((seq + _ONE) << _SEQ_SHIFT) | (state & _LOCATION)
        body = np.zeros((len(idx), f.ENTRY_WORDS - 1), np.uint64)
        loc = np.zeros(len(idx), np.uint64)
        if n:
            written = list(entries.values())
            loc[:n] = np.fromiter((e[0] for e in written), np.uint64, n)
            body[:n, 0] = np.fromiter((e[1] for e in written), np.uint64, n)
            body[:n, 1:] = np.frombuffer(b"".join(e[2] for e in written),
                                         np.uint64).reshape(n, 4)
        table[idx, 1:] = body
        table[idx, 0] = ((seq + _TWO) << _SEQ_SHIFT) | loc

    def _write(self, i: int, location: int, ref: int, key: bytes | None) -> None:
        """One entry, under its sequence number: odd while the body changes, even after."""
        words = self._words
        base = i * f.ENTRY_WORDS
        seq = words[base] >> 8
        words[base] = ((seq + 1) << 8) | (words[base] & 0xFF)
        words[base + 1] = ref
        if key is None:
            words[base + 2] = words[base + 3] = words[base + 4] = words[base + 5] = 0
        else:
            words[base + 2] = int.from_bytes(key[0:8], "little")
            words[base + 3] = int.from_bytes(key[8:16], "little")
            words[base + 4] = int.from_bytes(key[16:24], "little")
            words[base + 5] = int.from_bytes(key[24:32], "little")
        words[base] = ((seq + 2) << 8) | location

    def _put_header(self, field: tuple[int, str], value) -> None:
        offset, fmt = field
        struct.pack_into(fmt, self._buf, offset, value)


def _homes(keys: list[bytes], bits: int) -> list[int]:
    """``index_format.home`` of each 32-byte key, in one numpy pass."""
    w = np.frombuffer(b"".join(keys), np.uint64).reshape(len(keys), 4)
    h = w[:, 0] ^ w[:, 1]
    h ^= w[:, 2]
    h ^= w[:, 3]
    h ^= h >> np.uint64(32)
    h *= np.uint64(f.HASH_MULTIPLIER)
    h >>= np.uint64(64 - bits)
    return h.tolist()


def _retire(name: str) -> None:
    """A segment of this name left by an earlier daemon (stopped or killed) is marked superseded
    for the readers still mapping it, then unlinked."""
    try:
        old = posix_ipc.SharedMemory(name, 0)
    except posix_ipc.ExistentialError:
        return
    try:
        if old.size >= f.HEADER_BYTES:
            with mmap.mmap(old.fd, f.HEADER_BYTES) as m:
                if m[:8] == f.MAGIC:
                    struct.pack_into(f.H_SUPERSEDED[1], m, f.H_SUPERSEDED[0], 1)
    finally:
        old.close_fd()
        posix_ipc.unlink_shared_memory(name)


class KeyLocations:
    """What each published entry says: a slot-table watcher (pool commits and removals) and the
    lower tiers' observer (blocks written down or dropped there). Pool first, then the tiers in
    order. Callers: the slot table and the tiering, on the event loop."""

    def __init__(self, segment: IndexSegment, namespaces: "Namespaces",
                 lowers: list["LowerTier"],
                 defer: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.segment = segment
        self.namespaces = namespaces
        self.lowers = lowers
        self._tier_location = {id(t): (f.DISK if i == 0 else f.REMOTE)
                               for i, t in enumerate(lowers)}
        # Keys that left the pool, withdrawn once the event loop's current callback is done
        # (``defer``: the loop's call_soon): a store that evicts launches its copy first.
        # Until then a reader may still see such a key in the pool: its ref's generation is
        # stale, so its load fails that block (a recompute), never reads the new block.
        self._defer = defer
        self._leaving: list[bytes] = []

    # -- the slot table's watcher --

    def committed(self, slots: list["Slot"]) -> None:
        self.flush()
        self.segment.put_many([s.key for s in slots], f.POOL, [s.ref for s in slots])

    def removed(self, slots: list["Slot"]) -> None:
        keys = [s.key for s in slots]
        if self._defer is None:
            self._withdraw(keys)
            return
        if not self._leaving:
            self._defer(self.flush)
        self._leaving += keys

    def flush(self) -> None:
        """Withdraw the keys that left the pool (or publish their lower tier) now; every other
        change calls this first, so changes reach the segment in the order they were made."""
        if self._leaving:
            keys, self._leaving = self._leaving, []
            self._withdraw(keys)

    def _withdraw(self, keys: list[bytes]) -> None:
        if not any(t.is_enabled for t in self.lowers):
            self.segment.remove_many(keys)
            return
        for k in keys:
            self._settle(k)

    # -- the lower tiers' observer --

    def tier_holds(self, tier: "LowerTier", keys: list[bytes]) -> None:
        """``tier`` can serve ``keys`` now: published there unless the pool (or an upper tier)
        has them."""
        self.flush()
        here = self._tier_location[id(tier)]
        segment = self.segment
        for k in keys:
            now = segment.location(k)
            if now == f.EMPTY or now > here:
                segment.put(k, here)

    def tier_dropped(self, tier: "LowerTier", keys: list[bytes]) -> None:
        self.flush()
        here = self._tier_location[id(tier)]
        for k in keys:
            if self.segment.location(k) == here:
                self._settle(k, skip=tier)

    def _settle(self, key: bytes, skip: "LowerTier | None" = None) -> None:
        """``key`` left the pool (or ``skip``): published at the first lower tier that holds
        it, else withdrawn."""
        layout = self.namespaces.layouts.get(key[:16])
        if layout is not None:
            for t in self.lowers:
                if t is not skip and t.is_enabled and t.leading(key[:16], [key[16:]],
                                                                 layout.slot_bytes):
                    self.segment.put(key, self._tier_location[id(t)])
                    return
        self.segment.remove(key)
