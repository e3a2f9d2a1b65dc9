"""The disk tier's files: their format, finding what a previous daemon left, and batched I/O.

One directory per daemon (mode 0700, files 0600; an ``flock`` on ``DIR/LOCK`` keeps a second
daemon out). Per block size ``S`` (a layout's ``slot_bytes``, always a multiple of 4 KiB):

    DIR/blocks-S.dat    block i at byte i * S, read and written with O_DIRECT straight from
                        and into pool slots (no bounce buffer)
    DIR/blocks-S.idx    record i (64 bytes) says what block i holds

A record is (key: namespace + block hash, checksum: xxh3-64 of the block's bytes seeded with
its key, seq: write order, magic, S, check: a mix of the other 56 bytes). It is valid only if
magic, S and check all match, so a torn record is no record. Each write batch goes: zero the
records of blocks being overwritten → write the data → fdatasync → write the records →
fdatasync. So a valid record only ever describes bytes that reached the disk, after a kill -9
or a power loss alike; and since every read is verified against the record's checksum (which
also binds the key), a block that is torn or rotted anyway is caught and never loaded. The
two steps after the data are a group commit (``commit``): batches written while the previous
flush ran share the next one, so the device is not left idle behind a flush per batch.

Restart cost is reading the record files (64 bytes a block) and one vectorised validity check:
no journal to replay and no data to read (``scan``).

Everything here blocks and runs on the disk tier's I/O threads (``scan`` once, at start).
Policy (which blocks, which index, when) belongs to ``daemon/disk_tier.py``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.daemon.checksum import block_checksums
from kvpool.shared.errors import ConfigError, KvpoolError

log = logging.getLogger(__name__)

RECORD_DTYPE = np.dtype([("key", "V32"), ("checksum", "<u8"), ("seq", "<u8"),
                         ("magic", "<u4"), ("slot_bytes", "<u4"), ("check", "<u8")])
assert RECORD_DTYPE.itemsize == 64
MAGIC = 0x3144_564B          # "KVD1", little-endian
ALIGN = 4096                 # O_DIRECT alignment of offsets, lengths and buffers
# Largest single preadv/pwritev: the kernel takes at most IOV_MAX (1024) buffers per call.
IOV_MAX = 1024
_NAME = re.compile(r"^blocks-(\d+)\.idx$")
# Odd 64-bit constants: the record check is sum(word_i * MIX_i), computed for all records at
# once with numpy at start (a per-record hash call would cost ~1 us each, 0.1 s per 100k).
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                 0x27D4EB2F165667C5, 0x85EBCA77C2B2AE63, 0xFF51AFD7ED558CCD,
                 0xC4CEB9FE1A85EC53], dtype=np.uint64)

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _fallocate = _libc.fallocate
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
except (OSError, AttributeError):   # not glibc/Linux: freed space is reused, not returned
    _fallocate = None


class DiskBusy(KvpoolError):
    """Another live daemon uses this disk tier directory."""


def record_checks(records: np.ndarray) -> np.ndarray:
    """The check word each record should carry (vectorised over a record array)."""
    words = records.view(np.uint64).reshape(len(records), 8)
    return (words[:, :7] * _MIX).sum(axis=1, dtype=np.uint64)


@dataclass(frozen=True)
class Found:
    """What ``scan`` found for one block size: valid records and the data file's length."""

    slot_bytes: int
    indices: np.ndarray      # int64, block index of each valid record
    records: np.ndarray      # RECORD_DTYPE, the valid records
    file_blocks: int         # whole blocks the data file holds (valid or not)


class _Files:
    def __init__(self, data_fd: int, idx_fd: int, direct: bool) -> None:
        self.data_fd = data_fd
        self.idx_fd = idx_fd
        self.direct = direct


class DiskStore:
    """The files of one disk tier directory. Methods other than ``open``/``scan``/``close``
    may be called from several I/O threads at once, for disjoint block indices."""

    def __init__(self, path: Path, lock_fd: int, pool_buffer) -> None:
        self.path = path
        self._lock_fd = lock_fd
        self._pool = memoryview(pool_buffer)
        self._files: dict[int, _Files] = {}
        self._open_lock = threading.Lock()
        self._warned_buffered = False

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str, pool_buffer) -> "DiskStore":
        """Create or reuse the directory (private to this user) and lock it.

        Raises ``ConfigError`` if it cannot be made private to us, ``DiskBusy`` if another
        daemon holds it.
        """
        p = Path(path)
        try:
            p.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = p.stat()
            if st.st_uid != os.geteuid():
                raise ConfigError(f"disk_path {p} belongs to uid {st.st_uid}, but kvpoold runs "
                                  f"as uid {os.geteuid()}: the blocks must stay private to it")
            os.chmod(p, 0o700)
            lock_fd = os.open(p / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ConfigError(f"disk_path {p}: {e.strerror}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise DiskBusy(f"disk_path {p} is used by another running kvpoold") from None
        return cls(p, lock_fd, pool_buffer)

    def scan(self) -> list[Found]:
        """Every valid record in the directory, per block size (what a restart adopts)."""
        out = []
        for entry in sorted(os.listdir(self.path)):
            m = _NAME.match(entry)
            if not m:
                continue
            slot_bytes = int(m.group(1))
            if slot_bytes <= 0 or slot_bytes % ALIGN:
                continue
            raw = (self.path / entry).read_bytes()
            rec = np.frombuffer(raw[: len(raw) - len(raw) % 64], RECORD_DTYPE)
            data = self.path / f"blocks-{slot_bytes}.dat"
            file_blocks = data.stat().st_size // slot_bytes if data.exists() else 0
            idx = np.arange(len(rec), dtype=np.int64)
            ok = ((rec["magic"] == MAGIC) & (rec["slot_bytes"] == slot_bytes)
                  & (rec["check"] == record_checks(rec)) & (idx < file_blocks))
            out.append(Found(slot_bytes, idx[ok], rec[ok].copy(), file_blocks))
        return out

    def close(self) -> None:
        """Make everything written durable, close the files, drop the lock."""
        for f in self._files.values():
            for fd in (f.data_fd, f.idx_fd):
                try:
                    os.fdatasync(fd)
                except OSError as e:
                    log.warning("disk tier: fdatasync at close failed: %s", e)
                os.close(fd)
        self._files.clear()
        self._pool.release()
        os.close(self._lock_fd)

    def free_bytes(self) -> int:
        """Free space of the directory's filesystem for this user."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    # ---- I/O (I/O threads) -----------------------------------------------------------------

    def write(self, slot_bytes: int, indices: np.ndarray, offsets: np.ndarray,
              keys: list[bytes], seqs: np.ndarray, replaced: np.ndarray) -> np.ndarray:
        """``write_data`` then ``commit`` of one batch: written, durable and recorded when it
        returns; returns the checksums. Raises ``OSError`` (ENOSPC, EIO, ...); then no record
        of this batch is valid."""
        sums = self.write_data(slot_bytes, indices, offsets, keys, replaced)
        self.commit(slot_bytes, [(indices, keys, sums, seqs)])
        return sums

    def write_data(self, slot_bytes: int, indices: np.ndarray, offsets: np.ndarray,
                   keys: list[bytes], replaced: np.ndarray) -> np.ndarray:
        """Write pool bytes at ``offsets`` as blocks ``indices``; returns their checksums.
        ``replaced``: indices among ``indices`` whose old records must go first. Once it
        returns the pool bytes are no longer needed, but the blocks are neither durable nor
        recorded until a ``commit`` that starts after it. Raises ``OSError``."""
        f = self._open(slot_bytes)
        if len(replaced):
            self._put_records(f, np.asarray(replaced, np.int64),
                              np.zeros(len(replaced), RECORD_DTYPE))
        sums = block_checksums(self._pool, offsets.tolist(), keys, slot_bytes)
        for first, _, bufs in self._runs(indices, offsets, slot_bytes):
            _pwritev_all(f.data_fd, bufs, first * slot_bytes)
        return sums

    def commit(self, slot_bytes: int,
               batches: list[tuple[np.ndarray, list[bytes], np.ndarray, np.ndarray]]) -> None:
        """Make batches whose ``write_data`` returned durable, then record them: one
        fdatasync of the data, their records, one fdatasync of the records, however many
        batches (a group commit: a device flush costs about as much for one batch as for
        ten). Each batch is (indices, keys, checksums, seqs). Raises ``OSError``; then any of
        these records may or may not be valid (each one only ever describes landed bytes)."""
        f = self._open(slot_bytes)
        os.fdatasync(f.data_fd)
        indices = np.concatenate([b[0] for b in batches])
        rec = np.zeros(len(indices), RECORD_DTYPE)
        rec["key"] = np.frombuffer(b"".join(k for b in batches for k in b[1]), "V32")
        rec["checksum"] = np.concatenate([b[2] for b in batches])
        rec["seq"] = np.concatenate([b[3] for b in batches])
        rec["magic"] = MAGIC
        rec["slot_bytes"] = slot_bytes
        rec["check"] = record_checks(rec)
        self._put_records(f, indices, rec)
        os.fdatasync(f.idx_fd)

    def read(self, slot_bytes: int, indices: np.ndarray, offsets: np.ndarray,
             keys: list[bytes], checksums: np.ndarray) -> np.ndarray:
        """Read blocks ``indices`` into pool bytes at ``offsets`` and verify each; returns a
        bool per block (False: short or failed its checksum; its pool bytes are garbage).
        Raises ``OSError`` for an I/O fault."""
        f = self._open(slot_bytes)
        short: list[np.ndarray] = []    # block indices a short read (truncated file) missed
        for first, count, bufs in self._runs(indices, offsets, slot_bytes):
            got = _preadv_all(f.data_fd, bufs, first * slot_bytes) // slot_bytes
            if got < count:
                short.append(np.arange(first + got, first + count))
        complete = ~np.isin(indices, np.concatenate(short)) if short else True
        pool = self._pool
        ok = block_checksums(pool, offsets.tolist(), keys, slot_bytes)
        return complete & (ok == checksums.astype(np.uint64))

    def free(self, slot_bytes: int, indices: np.ndarray) -> None:
        """Forget blocks: zero their records, then give their space back to the filesystem
        (punch holes) where it supports that."""
        f = self._open(slot_bytes)
        indices = np.asarray(indices, np.int64)
        self._put_records(f, indices, np.zeros(len(indices), RECORD_DTYPE))
        if _fallocate is None:
            return
        for i in indices.tolist():
            if _fallocate(f.data_fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                          i * slot_bytes, slot_bytes) != 0:
                err = ctypes.get_errno()
                if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                    return
                raise OSError(err, f"punching a hole in blocks-{slot_bytes}.dat: "
                                   f"{os.strerror(err)}")

    # ---- internals -------------------------------------------------------------------------

    def _open(self, slot_bytes: int) -> _Files:
        f = self._files.get(slot_bytes)
        if f is not None:
            return f
        with self._open_lock:
            f = self._files.get(slot_bytes)
            if f is None:
                f = self._files[slot_bytes] = self._open_files(slot_bytes)
        return f

    def _open_files(self, slot_bytes: int) -> _Files:
        data = str(self.path / f"blocks-{slot_bytes}.dat")
        flags = os.O_RDWR | os.O_CREAT
        direct = True
        try:
            data_fd = os.open(data, flags | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # A filesystem without O_DIRECT: the page cache copies, correctness is the same.
            if not self._warned_buffered:
                log.warning("disk tier: %s does not support O_DIRECT; using buffered I/O",
                            self.path)
                self._warned_buffered = True
            data_fd = os.open(data, flags, 0o600)
            direct = False
        idx_fd = os.open(str(self.path / f"blocks-{slot_bytes}.idx"), flags, 0o600)
        for fd in (data_fd, idx_fd):
            os.fchmod(fd, 0o600)
        return _Files(data_fd, idx_fd, direct)

    def _runs(self, indices: np.ndarray, offsets: np.ndarray, slot_bytes: int):
        """(first block index, block count, pool buffers) per run of consecutive block
        indices, at most ``IOV_MAX`` blocks each: one system call per run, however the pool
        slots lie."""
        order = np.argsort(indices, kind="stable")
        idx, off = indices[order], offsets[order]
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        pool = self._pool
        for lo, hi in zip(np.r_[0, breaks].tolist(), np.r_[breaks, len(idx)].tolist()):
            for a in range(lo, hi, IOV_MAX):
                b = min(hi, a + IOV_MAX)
                yield (int(idx[a]), b - a,
                       [pool[o:o + slot_bytes] for o in off[a:b].tolist()])

    def _put_records(self, f: _Files, indices: np.ndarray, rec: np.ndarray) -> None:
        order = np.argsort(indices, kind="stable")
        idx, rec = indices[order], rec[order]
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        for lo, hi in zip(np.r_[0, breaks].tolist(), np.r_[breaks, len(idx)].tolist()):
            data = rec[lo:hi].tobytes()
            pos = int(idx[lo]) * 64
            while data:
                n = os.pwrite(f.idx_fd, data, pos)
                data, pos = data[n:], pos + n


def _pwritev_all(fd: int, bufs: list[memoryview], pos: int) -> None:
    """pwritev until every byte is written (a short write is retried; a full disk raises)."""
    total = sum(len(b) for b in bufs)
    done = os.pwritev(fd, bufs, pos)
    while done < total:
        rest = _skip(bufs, done)
        n = os.pwritev(fd, rest, pos + done)
        if n == 0:
            raise OSError(errno.ENOSPC, "short write to the disk tier")
        done += n


def _preadv_all(fd: int, bufs: list[memoryview], pos: int) -> int:
    """preadv until every buffer is filled or the file ends; returns bytes read."""
    total = sum(len(b) for b in bufs)
    done = os.preadv(fd, bufs, pos)
    while 0 < done < total:
        n = os.preadv(fd, _skip(bufs, done), pos + done)
        if n == 0:
            break
        done += n
    return done


def _skip(bufs: list[memoryview], nbytes: int) -> list[memoryview]:
    """The buffers after the first ``nbytes`` (O_DIRECT short transfers stay block-aligned)."""
    out = []
    for b in bufs:
        if nbytes >= len(b):
            nbytes -= len(b)
            continue
        out.append(b[nbytes:])
        nbytes = 0
    return out
