"""The POSIX shared-memory pool: create or adopt the segment, map it, address its slots.

Layout of the segment (all little-endian, offsets from byte 0):

    [header 4 KiB][extent table][layout table][record table][extent 0][extent 1]...

The data area is cut into equal *extents*. An extent is handed to one slot size at a time
(``assign_extent``) and holds only slots, packed, so an extent of a power-of-two size wastes
nothing on the usual power-of-two block sizes; a slot holds one whole block: every KV head
(head-split layouts, any TP size) or every TP rank's shard (``kvpool.shared.layout``).
The record table keeps a fixed number of records per extent, enough for slots of 16 KiB; smaller
slots fill only part of an extent. The records (key, state, generation) and the layout table live in the
segment itself, so a daemon started after a crash or an upgrade re-reads them and adopts every
committed block (``Index.adopt``). Writes are ordered data-then-record, so a record that says
COMMITTED always describes bytes that landed; anything else is dropped on adoption.

Ownership: the daemon holds an exclusive ``flock`` on the segment for its whole life. The kernel
drops it when the process dies however it dies, so a second daemon on the same pool name fails
to start instead of silently sharing, and a stale segment whose owner is dead is adopted (or
replaced when its format or size differ). This module holds no policy: which slot to use is the
index's business.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Callable

import msgspec
import numpy as np
import posix_ipc

from kvpool.shared.config import DaemonConfig, parse_size
from kvpool.shared.errors import ConfigError, KvpoolError
from kvpool.shared.layout import Layout

log = logging.getLogger(__name__)

MAGIC = b"KVPOOL\x00\x01"
# 2: layouts may be head-split (a slot holds every KV head, whatever the TP size of the engine
# that wrote it; ``kvpool.shared.layout``). A format-1 pool holds only rank-sharded layouts,
# whose slots format 2 keeps byte for byte, so it is migrated in place (``Pool.open``). Daemons
# before format 2 replace a format-2 pool rather than misread its layout table.
FORMAT_VERSION = 2
MIGRATES_FROM = (1,)
HEADER_BYTES = 4096
LAYOUT_TABLE_BYTES = 1 << 20
PAGE = 4096

MIN_PACKED_SLOT_BYTES = 16 << 10

# Record states. FREE must be 0: a fresh (zero-filled) extent is all free.
FREE, WRITING, COMMITTED = 0, 1, 2

HEADER_DTYPE = np.dtype([
    ("magic", "V8"), ("format_version", "<u4"), ("num_extents", "<u4"),
    ("pool_bytes", "<u8"), ("extent_bytes", "<u8"), ("data_offset", "<u8"),
    ("layout_table_offset", "<u8"), ("layout_blob_bytes", "<u8"),
    ("record_table_offset", "<u8"), ("records_per_extent", "<u8"),
])
EXTENT_DTYPE = np.dtype([("slot_bytes", "<u8"), ("num_slots", "<u4"), ("records_bytes", "<u4")])
# records_bytes is always 0 in format 1 (records live in the record table); kept for layout.
RECORD_DTYPE = np.dtype([("key", "V32"), ("generation", "<u4"), ("state", "u1"),
                         ("pad", "V11")])
assert RECORD_DTYPE.itemsize == 48


try:    # built by the install where a C compiler is (setup.py); else numpy writes the records
    from kvpool.daemon import _pool_records
except ImportError:
    _pool_records = None
if _pool_records is not None:
    assert (_pool_records.RECORD_BYTES, _pool_records.KEY_BYTES,
            _pool_records.GENERATION_OFFSET, _pool_records.STATE_OFFSET) == (
        RECORD_DTYPE.itemsize, RECORD_DTYPE["key"].itemsize,
        RECORD_DTYPE.fields["generation"][1], RECORD_DTYPE.fields["state"][1])

GENERATION_MASK = 0x7FFF_FFFF   # slot ref generations: 31 bits, so refs stay positive int64
SHM_DIR = "/dev/shm"


class PoolBusy(KvpoolError):
    """Another live daemon owns this pool name."""


def _reserve(fd: int, nbytes: int, name: str) -> None:
    """Back every byte of the segment with /dev/shm pages now.

    A tmpfs file is sparse: its pages are taken on first touch, and a touch that finds tmpfs
    full is a SIGBUS that kills the daemon. Reserving at start turns a full /dev/shm into a
    clear start-up error instead. Costs one pass over the pool once (a pool adopted whole,
    as the previous daemon reserved it, is not touched again).
    """
    st = os.fstat(fd)
    if st.st_blocks * 512 >= nbytes:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        free = os.statvfs(SHM_DIR)
        raise ConfigError(f"cannot reserve {nbytes} bytes in /dev/shm for pool {name}: "
                          f"{e.strerror} ({free.f_bavail * free.f_frsize} bytes free); lower "
                          f"pool_size or make room") from None


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def resolve_sizes(config: DaemonConfig) -> tuple[int, int]:
    """(pool_bytes, extent_bytes) from the settings, with "auto" resolved.

    auto pool: a quarter of available memory, and at most half of what /dev/shm can still take,
    so the default never starves the engines or fills the tmpfs.
    """
    if config.pool_size == "auto":
        shm = os.statvfs(SHM_DIR)
        pool = min(available_memory_bytes() // 4, shm.f_bavail * shm.f_frsize // 2)
    else:
        pool = parse_size(config.pool_size)
    if config.extent_size == "auto":
        # Many extents let several models share the pool finely; a power of two keeps the
        # usual power-of-two block sizes packed without waste.
        extent = min(256 << 20, max(4 << 20, pool // 128))
        extent = 1 << (extent.bit_length() - 1)
    else:
        extent = parse_size(config.extent_size)
    extent = _align(extent, PAGE)
    if Geometry.plan(pool, extent).num_extents < 2:
        raise ConfigError(f"pool_size {pool} bytes is too small for extent_size {extent}: the "
                          f"pool needs room for its tables and at least two extents")
    return pool, extent


def check_room(config: DaemonConfig) -> None:
    """``ConfigError`` unless /dev/shm can hold the pool ``config`` asks for: its free space,
    plus what the pool's own segment holds already (adopted or replaced, it is reused)."""
    pool_bytes, extent_bytes = resolve_sizes(config)
    want = Geometry.plan(pool_bytes, extent_bytes).pool_bytes
    shm = os.statvfs(SHM_DIR)
    free = shm.f_bavail * shm.f_frsize
    try:
        free += os.stat(os.path.join(SHM_DIR, config.pool)).st_blocks * 512
    except OSError:
        pass
    if want > free:
        raise ConfigError(f"pool_size: the pool needs {_gib(want)} of {SHM_DIR} but only "
                          f"{_gib(free)} is free there: lower pool_size (auto takes a quarter of "
                          f"available memory) or make {SHM_DIR} larger")


def _owner(name: str) -> str:
    try:
        uid = os.stat(SHM_DIR + name).st_uid
    except OSError:
        return "not this one"
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class Geometry:
    pool_bytes: int
    extent_bytes: int
    num_extents: int
    data_offset: int
    layout_table_offset: int
    record_table_offset: int
    records_per_extent: int

    @classmethod
    def plan(cls, pool_bytes: int, extent_bytes: int) -> "Geometry":
        per_extent = max(64, extent_bytes // MIN_PACKED_SLOT_BYTES)
        # The tables are sized for the most extents that could fit, then the data area takes
        # whole extents of what is left.
        n = pool_bytes // extent_bytes
        layout_off = HEADER_BYTES + _align(n * EXTENT_DTYPE.itemsize, PAGE)
        record_off = _align(layout_off + LAYOUT_TABLE_BYTES, PAGE)
        data_off = _align(record_off + n * per_extent * RECORD_DTYPE.itemsize, PAGE)
        n = max(0, (pool_bytes - data_off) // extent_bytes)
        return cls(data_off + n * extent_bytes, extent_bytes, n, data_off, layout_off,
                   record_off, per_extent)


class Pool:
    """The mapped segment. Created or adopted by ``Pool.open``; one per daemon."""

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, fd: int, buffer: mmap.mmap,
                 geometry: Geometry, adopted: bool) -> None:
        self.name = name
        self._shm = shm
        self._fd = fd
        self.buffer = buffer
        self.geometry = geometry
        self.adopted = adopted
        self.nbytes = geometry.pool_bytes
        self._u8 = np.frombuffer(buffer, dtype=np.uint8)
        self.base_address = self._u8.ctypes.data
        g = geometry
        self.header = np.ndarray(1, HEADER_DTYPE, buffer, 0)
        self.extents = np.ndarray(g.num_extents, EXTENT_DTYPE, buffer, HEADER_BYTES)
        self._records: dict[int, np.ndarray] = {}
        # Slot ids are extent * records_per_extent + index: dense, so they fit the 32 bits of
        # a slot ref for any pool of fewer than 2**32 records (1 PiB of 256 MiB extents).
        self.slot_id_stride = g.records_per_extent
        self.slot_ids = g.num_extents * g.records_per_extent     # ids are below this
        # A slot id is also its record's position in the record table, so the index's writes
        # address one array by id: no per-extent lookup, and a batch is one fancy-index write
        # per field. Field views made once (making one costs about a microsecond).
        table = np.ndarray(g.num_extents * g.records_per_extent, RECORD_DTYPE, buffer,
                           g.record_table_offset)
        self._rec_key, self._rec_generation, self._rec_state = (
            table["key"], table["generation"], table["state"])
        # the same table as bytes, for the compiled writes
        self._rec_bytes = table.view(np.uint8)

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def open(cls, config: DaemonConfig,
             place: Callable[[int, Geometry], None] | None = None) -> "Pool":
        """Create the segment, or adopt the one a dead daemon left behind.

        ``place(base_address, geometry)`` runs on the mapping before its pages are reserved
        (a NUMA policy set then decides where they are allocated, ``daemon/numa.py``).
        Raises ``PoolBusy`` if a live daemon holds it, ``ConfigError`` for impossible sizes.
        """
        pool_bytes, extent_bytes = resolve_sizes(config)
        want = Geometry.plan(pool_bytes, extent_bytes)
        name = "/" + config.pool
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=want.pool_bytes)
            created = True
        except posix_ipc.ExistentialError:
            try:
                shm = posix_ipc.SharedMemory(name, 0)
            except posix_ipc.PermissionsError:
                raise PoolBusy(f"pool {config.pool!r} in {SHM_DIR} belongs to another user "
                               f"({_owner(name)}): choose another pool_name") from None
            created = False
        except posix_ipc.PermissionsError as e:
            raise PoolBusy(f"cannot create pool {config.pool!r} in {SHM_DIR}: {e}") from None
        fd = shm.fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PoolBusy(f"pool {config.pool!r} is owned by another running kvpoold; "
                           f"stop it or choose another pool_name") from None
        try:
            if not created:
                old, version = cls._read_geometry(fd, shm.size)
                if old is not None and config.pool_size == config.extent_size == "auto":
                    # Sized from this host once: an auto size computed again would count the
                    # pool's own pages as taken and differ, dropping the cache at each restart.
                    want = old
                if old == want:
                    log.info("adopting pool %s left by an earlier daemon (%d bytes)", name,
                             shm.size)
                    pool = cls._map(name, shm, fd, want, adopted=True)
                    pool._reserve(place)
                    if version != FORMAT_VERSION:
                        pool._migrate(version)
                    return pool
                if old is None:
                    reason = "unreadable header" if version is None else (
                        f"pool format {version}, this kvpoold reads formats "
                        f"{', '.join(map(str, MIGRATES_FROM + (FORMAT_VERSION,)))}")
                else:
                    reason = (f"size/extent changed ({old.pool_bytes}/{old.extent_bytes} -> "
                              f"{want.pool_bytes}/{want.extent_bytes})")
                log.warning("replacing stale pool %s (%s): its cached blocks are dropped", name,
                            reason)
                os.ftruncate(fd, 0)   # drop the old pages before growing to the new size
                os.ftruncate(fd, want.pool_bytes)
            pool = cls._map(name, shm, fd, want, adopted=False)
            pool._reserve(place)
        except BaseException:
            os.close(fd)
            if created:
                shm.unlink()
            raise
        pool._format()
        return pool

    def _reserve(self, place: Callable[[int, Geometry], None] | None) -> None:
        """Place (``open``'s ``place``), then reserve every page; unmaps if that fails (the
        caller closes the descriptor)."""
        try:
            if place is not None:
                place(self.base_address, self.geometry)
            _reserve(self._fd, self.geometry.pool_bytes, self.name)
        except BaseException:
            self._unmap()
            raise

    @staticmethod
    def _read_geometry(fd: int, size: int) -> tuple[Geometry | None, int | None]:
        """The geometry of a pool this daemon can adopt (its format is current or migrates),
        else None; and the header's format version (None: no kvpool header at all)."""
        if size < HEADER_BYTES:
            return None, None
        raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
        h = np.frombuffer(raw, HEADER_DTYPE)[0]
        if bytes(h["magic"]) != MAGIC:
            return None, None
        version = int(h["format_version"])
        if version != FORMAT_VERSION and version not in MIGRATES_FROM:
            return None, version
        return Geometry(int(h["pool_bytes"]), int(h["extent_bytes"]), int(h["num_extents"]),
                        int(h["data_offset"]), int(h["layout_table_offset"]),
                        int(h["record_table_offset"]), int(h["records_per_extent"])), version

    def _migrate(self, version: int) -> None:
        """Bring an adopted pool of an older format to this one, in place, before the index
        reads it. Format 1 -> 2: nothing moves (its layouts are all rank-sharded, a format 2
        slot kind), only the version changes, so a daemon before format 2 no longer adopts it."""
        layouts = self.load_layouts()
        self.header[0]["format_version"] = FORMAT_VERSION
        log.warning("pool %s was format %d: migrated in place to format %d, keeping its %d "
                    "layouts (all rank-sharded) and their committed blocks. vLLM engines now "
                    "name their blocks independently of TP, so blocks they stored before this "
                    "upgrade are not looked up again and age out of the LRU", self.name,
                    version, FORMAT_VERSION, len(layouts))

    @classmethod
    def _map(cls, name, shm, fd, geometry, adopted) -> "Pool":
        os.fchmod(fd, 0o600)
        buffer = mmap.mmap(fd, geometry.pool_bytes)
        return cls(name, shm, fd, buffer, geometry, adopted)

    def _format(self) -> None:
        g = self.geometry
        self.extents[:] = np.zeros(1, EXTENT_DTYPE)
        h = self.header[0]
        h["format_version"] = FORMAT_VERSION
        h["num_extents"] = g.num_extents
        h["pool_bytes"] = g.pool_bytes
        h["extent_bytes"] = g.extent_bytes
        h["data_offset"] = g.data_offset
        h["layout_table_offset"] = g.layout_table_offset
        h["layout_blob_bytes"] = 0
        h["record_table_offset"] = g.record_table_offset
        h["records_per_extent"] = g.records_per_extent
        # Slot refs carry a slot's generation. Those of a replaced pool's daemon may still be
        # held by clients, so a new pool's generations start at a random point rather than 0.
        table = np.ndarray(g.num_extents * g.records_per_extent, RECORD_DTYPE, self.buffer,
                           g.record_table_offset)
        table["generation"] = int.from_bytes(os.urandom(4), "little") & GENERATION_MASK
        del table
        # Magic last: a crash mid-format leaves a header that the next start replaces.
        h["magic"] = np.void(MAGIC)

    def _unmap(self) -> None:
        self._records.clear()
        del self.header, self.extents, self._u8
        del self._rec_key, self._rec_generation, self._rec_state, self._rec_bytes
        try:
            self.buffer.close()
        except BufferError:
            log.debug("pool buffer still referenced at close; the mapping goes with the process")

    def close(self, unlink: bool) -> None:
        """Unmap; unlink the segment unless the operator keeps it for the next daemon."""
        self._unmap()
        if unlink:
            try:
                self._shm.unlink()
            except posix_ipc.ExistentialError:
                pass
        os.close(self._fd)   # drops the flock

    # ---- extents and slots ----------------------------------------------------------------

    def extent_offset(self, extent: int) -> int:
        return self.geometry.data_offset + extent * self.geometry.extent_bytes

    def slots_per_extent(self, slot_bytes: int) -> int:
        return min(self.geometry.extent_bytes // slot_bytes, self.geometry.records_per_extent)

    def assign_extent(self, extent: int, slot_bytes: int) -> int:
        """Dedicate a free extent to ``slot_bytes`` slots; returns how many it holds.

        Crash order: ``slot_bytes`` is written last, so until then the extent reads as free to
        a daemon that adopts the pool; never as slots of one size counted with another's."""
        n = self.slots_per_extent(slot_bytes)
        e = self.extents[extent]
        e["slot_bytes"] = 0
        self._records.pop(extent, None)
        self.records(extent, n)["state"] = FREE
        e["num_slots"], e["records_bytes"] = n, 0
        e["slot_bytes"] = slot_bytes
        return n

    def release_extent(self, extent: int) -> None:
        self.extents[extent]["slot_bytes"] = 0
        self._records.pop(extent, None)

    def extent_is_sane(self, extent: int) -> bool:
        """Whether an adopted extent's entry describes slots that fit it (a torn or foreign
        entry could otherwise lay slots over the next extent)."""
        e = self.extents[extent]
        slot_bytes, n = int(e["slot_bytes"]), int(e["num_slots"])
        return (slot_bytes > 0 and 0 < n <= self.geometry.records_per_extent
                and n * slot_bytes <= self.geometry.extent_bytes)

    def records(self, extent: int, n: int | None = None) -> np.ndarray:
        """The record array of an assigned extent (a live view into the segment)."""
        rec = self._records.get(extent)
        if rec is None:
            if n is None:
                n = int(self.extents[extent]["num_slots"])
            g = self.geometry
            off = g.record_table_offset + extent * g.records_per_extent * RECORD_DTYPE.itemsize
            rec = np.ndarray(n, RECORD_DTYPE, self.buffer, off)
            self._records[extent] = rec
        return rec

    def slot_offset(self, extent: int, index: int) -> int:
        return self.extent_offset(extent) + index * int(self.extents[extent]["slot_bytes"])

    def write_state(self, slot_id: int, state: int, generation: int | None = None) -> None:
        """Mark one slot FREE or WRITING (COMMITTED goes through ``commit_records``). A slot
        handed out for writing records its new ``generation`` first, so a daemon that adopts
        the pool never hands out a generation (and so a slot ref) it handed out before."""
        if generation is not None:
            self._rec_generation[slot_id] = generation
        self._rec_state[slot_id] = state

    def write_states(self, slot_ids: list[int], state: int,
                     generations: list[int] | None = None) -> None:
        """``write_state`` for many slots at once, in the same crash order: every generation
        lands before any state byte. Ids must be distinct."""
        if not slot_ids:
            return
        if _pool_records is not None:
            _pool_records.write_states(self._rec_bytes, slot_ids, state, generations)
            return
        idx = np.fromiter(slot_ids, np.int64, len(slot_ids))
        if generations is not None:
            self._rec_generation[idx] = np.fromiter(generations, np.uint32, len(generations))
        self._rec_state[idx] = state

    def generations(self, extent: int, n: int) -> np.ndarray:
        """The recorded generation of the first ``n`` slots of ``extent``."""
        first = extent * self.slot_id_stride
        return self._rec_generation[first:first + n].copy()

    def commit_records(self, slot_ids: list[int], keys: list[bytes],
                       generations: list[int]) -> None:
        """Mark many slots COMMITTED, slot ``slot_ids[i]`` holding ``keys[i]`` (32 bytes) at
        ``generations[i]``. Keys and generations land before any state byte, so a crash in
        between leaves those records uncommitted. Ids must be distinct."""
        n = len(slot_ids)
        if not n:
            return
        if _pool_records is not None:
            _pool_records.commit(self._rec_bytes, slot_ids, keys, generations, COMMITTED)
            return
        if n <= 4:
            # Element by element: the arrays below cost ~2.5 us even for one slot.
            for i, k, g in zip(slot_ids, keys, generations):
                self._rec_key[i] = k
                self._rec_generation[i] = g
            for i in slot_ids:
                self._rec_state[i] = COMMITTED
            return
        idx = np.fromiter(slot_ids, np.int64, n)
        self._rec_key[idx] = np.frombuffer(b"".join(keys), dtype="V32")
        self._rec_generation[idx] = np.fromiter(generations, np.uint32, n)
        self._rec_state[idx] = COMMITTED

    # ---- layout table ----------------------------------------------------------------------

    def save_layouts(self, layouts: dict[bytes, Layout]) -> None:
        blob = msgspec.msgpack.encode(layouts)
        if len(blob) > LAYOUT_TABLE_BYTES:
            raise ConfigError("too many distinct layouts for the pool's layout table")
        off = self.geometry.layout_table_offset
        self.buffer[off:off + len(blob)] = blob
        self.header[0]["layout_blob_bytes"] = len(blob)

    def load_layouts(self) -> dict[bytes, Layout]:
        n = int(self.header[0]["layout_blob_bytes"])
        if not n:
            return {}
        off = self.geometry.layout_table_offset
        return msgspec.msgpack.decode(bytes(self.buffer[off:off + n]), type=dict[bytes, Layout])

    def view(self) -> np.ndarray:
        """The whole segment as uint8 (for copy engines)."""
        return self._u8
