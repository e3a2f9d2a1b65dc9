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
from typing import TYPE_CHECKING

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
        self._where: dict[bytes, int] = {}             # key -> its entry
        self._keys: list[bytes | None] = [None] * capacity   # entry -> its key
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
            i = f.home(key, self.bits)
            keys = self._keys
            while keys[i] is not None:
                i = (i + 1) & self._mask
            keys[i] = key
            self._where[key] = i
            self._write(i, location, ref, key)
            self._put_header(f.H_PUBLISHED, len(self._where))
        else:
            self._write(i, location, ref, key)
        return True

    def location(self, key: bytes) -> int:
        """What the entry of ``key`` says now (``EMPTY`` if unpublished): the writer's view."""
        i = self._where.get(key)
        return f.EMPTY if i is None else self._words[i * f.ENTRY_WORDS] & 0xFF

    def remove(self, key: bytes) -> None:
        """Withdraw ``key`` (nothing if unpublished); the entries after it in its cluster move
        back so that no probe needs a tombstone."""
        i = self._where.pop(key, None)
        if i is None:
            return
        keys, mask, bits = self._keys, self._mask, self.bits
        j = i
        while True:
            j = (j + 1) & mask
            k = keys[j]
            if k is None:
                break
            h = f.home(k, bits)
            if ((j - h) & mask) >= ((j - i) & mask):    # k may live at i: move it back
                w = self._words[j * f.ENTRY_WORDS:(j + 1) * f.ENTRY_WORDS]
                self._write(i, w[0] & 0xFF, w[1], k)
                keys[i] = k
                self._where[k] = i
                i = j
        keys[i] = None
        self._write(i, f.EMPTY, 0, None)
        self._put_header(f.H_PUBLISHED, len(self._where))

    def close(self) -> None:
        """Mark the segment superseded and unlink it (readers drop their mapping when they see
        the mark)."""
        if self._buf.closed:
            return
        self._put_header(f.H_SUPERSEDED, 1)
        self._words.release()
        self._buf.close()
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

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
                 lowers: list["LowerTier"]) -> None:
        self.segment = segment
        self.namespaces = namespaces
        self.lowers = lowers
        self._tier_location = {id(t): (f.DISK if i == 0 else f.REMOTE)
                               for i, t in enumerate(lowers)}

    # -- the slot table's watcher --

    def committed(self, slots: list["Slot"]) -> None:
        put = self.segment.put
        pool = f.POOL
        for s in slots:
            put(s.key, pool, s.ref)

    def removed(self, slots: list["Slot"]) -> None:
        for s in slots:
            self._settle(s.key)

    # -- the lower tiers' observer --

    def tier_holds(self, tier: "LowerTier", keys: list[bytes]) -> None:
        """``tier`` can serve ``keys`` now: published there unless the pool (or an upper tier)
        has them."""
        here = self._tier_location[id(tier)]
        segment = self.segment
        for k in keys:
            now = segment.location(k)
            if now == f.EMPTY or now > here:
                segment.put(k, here)

    def tier_dropped(self, tier: "LowerTier", keys: list[bytes]) -> None:
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
