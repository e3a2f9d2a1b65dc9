"""The shared-memory index the daemon publishes: where each committed key is, for schedulers.

Owns the segment (``shared/index_format.py`` gives its format): creates it with the socket's
owner, group and mode, writes entries with the seqlock protocol, retires a previous daemon's
segment of the same name (marking it superseded, so readers still mapping it stop believing it),
and unlinks it at shutdown. ``KeyLocations`` (below) decides what an entry says: it watches the
slot table (a block committed is in the pool; a block that leaves the pool is in the first lower
tier that holds it, or nowhere) and the lower tiers (a block written down or dropped there).

The daemon is the only writer. Its entries are written by the compiled writer
(``daemon/_index_writer.c``) where the install built it, else by ``daemon/index_entries.py``
(the reference); both mirror which entry holds which key rather than read the segment back.
Every call runs on the event loop thread and never blocks: a probe and a few 8-byte stores per
key (``put``), plus a short backward shift per removal (``remove``). The segment itself is made
on a thread while the loop runs (``server.publish_index``): reserving the largest table and
freeing a killed daemon's takes tens of milliseconds.
A table too full to take a key leaves it unpublished and counts it (``unpublished``): lookups
then miss it, which costs a recompute, never a wrong block.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading
from typing import TYPE_CHECKING, Callable, Sequence

import posix_ipc

from kvpool.daemon.index_entries import PythonEntries
from kvpool.daemon.pool import SHM_DIR
from kvpool.shared import index_format as f
from kvpool.shared.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.daemon.extents import Slot
    from kvpool.daemon.namespaces import Namespaces
    from kvpool.daemon.tier import LowerTier

try:    # built by the install where a C compiler is (setup.py); else the Python writer
    from kvpool.daemon import _index_writer
except ImportError:
    _index_writer = None

log = logging.getLogger("kvpoold")

# Keys published at most per entry of the table: past it a probe grows long and new keys wait.
MAX_LOAD = 0.75


def capacity_for(pool_bytes: int, disk_bytes: int, setting: int = 0) -> int:
    """Entries of the table: ``setting`` when given (a power of two is taken above it), else
    enough for twice the blocks of 16 KiB a pool of ``pool_bytes`` and a disk tier of
    ``disk_bytes`` can hold, between 4096 and 2**22 (192 MiB, all mapped at start)."""
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
        limit = int(MAX_LOAD * capacity)
        self._entries = (PythonEntries(self._buf, capacity, limit) if _index_writer is None
                         else _index_writer.Writer(self._buf, capacity, limit))
        # Every page of the table mapped now, on a thread of its own (the compiled writer's
        # ``prefault`` runs without the GIL; tens of ms for the largest table): keys land at
        # random places of a table sized for the smallest blocks, and a first touch of its page
        # on the loop cost 16 us a key on a 2-core VM (0.2 ms of a store's last commit on an
        # H200 host). The pages are the ones a long run touches anyway.
        self._prefault: threading.Thread | None = None
        if hasattr(self._entries, "prefault"):
            self._prefault = threading.Thread(target=self._entries.prefault,
                                              name="kvpool-index-prefault", daemon=True)
            self._prefault.start()
        self._put_header(f.H_MAGIC, f.MAGIC)
        self._put_header(f.H_VERSION, f.FORMAT_VERSION)
        self._put_header(f.H_CAPACITY, capacity)
        self._put_header(f.H_FLAGS, flags)
        self._put_header(f.H_DAEMON_ID, daemon_id.encode()[:32])

    def __len__(self) -> int:
        return self._entries.published

    @property
    def unpublished(self) -> int:
        """New keys the table was too full to take (lookups miss them)."""
        return self._entries.unpublished

    @property
    def is_compiled(self) -> bool:
        """Whether the compiled writer writes the entries (else the Python one)."""
        return not isinstance(self._entries, PythonEntries)

    def prefault_wait(self) -> None:
        """Until the table's pages are all mapped (tests, and before the segment closes)."""
        if self._prefault is not None:
            self._prefault.join()

    def put(self, key: bytes, location: int, ref: int = 0) -> bool:
        """Publish ``key`` (32 bytes) at ``location``; False (counted) when the table is too
        full to take a new key."""
        return self._entries.put_many([key], location, [ref]) == 1

    def put_many(self, keys: Sequence[bytes], location: int, refs: Sequence[int]) -> int:
        """Publish each of ``keys`` at ``location`` with its ref; returns how many were
        published (a key the table is too full to take is counted in ``unpublished``)."""
        return self._entries.put_many(keys, location, refs)

    def location(self, key: bytes) -> int:
        """What the entry of ``key`` says now (``EMPTY`` if unpublished): the writer's view."""
        return self._entries.location(key)

    def entry_of(self, key: bytes) -> int | None:
        """The entry that holds ``key`` (None: unpublished): the writer's view, for tests."""
        return self._entries.entry_of(key)

    def remove(self, key: bytes) -> None:
        self._entries.remove_many([key])

    def remove_many(self, keys: Sequence[bytes]) -> None:
        """Withdraw ``keys`` (those unpublished are skipped). A reader racing it may miss a
        key that moved back into a withdrawn one's place: a miss, never a wrong hit."""
        self._entries.remove_many(keys)

    def close(self) -> None:
        """Mark the segment superseded and unlink it (readers drop their mapping when they see
        the mark)."""
        if self._buf.closed:
            return
        self.prefault_wait()
        self._put_header(f.H_SUPERSEDED, 1)
        self._entries.close()       # (its views of the mapping pin it)
        self._buf.close()
        with contextlib.suppress(FileNotFoundError, posix_ipc.ExistentialError):
            _unlink(self.name)

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
        with contextlib.suppress(FileNotFoundError, posix_ipc.ExistentialError):
            _unlink(name)


def _unlink(name: str) -> None:
    """Unlink the segment ``name``. The last unlink of a killed daemon's table frees its pages
    (30-35 ms for the largest on a 2-core VM): through /dev/shm that lets the GIL go, and the
    loop runs while the next table is made off it; ``posix_ipc``'s unlink holds the GIL."""
    if os.path.isdir(SHM_DIR):
        os.unlink(SHM_DIR + name)
    else:
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
