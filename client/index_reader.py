"""``IndexReader``: the daemon's shared-memory index, mapped read-only in the scheduler's process.

A lookup here is a few numpy passes over the mapped table (``shared/index_format.py``), no round
trip and no daemon CPU: the scheduler learns a request's hits in the same call that asks
(issue 37). It takes no lock and pins nothing: a hit is a key the entry held, committed, while it
was read; by the time its load reaches the daemon the block may have gone, and that block's
load fails (vLLM recomputes it).

Never raises past ``open``: a segment that is superseded (the daemon restarted, or replaced its
table) answers ``None`` from ``find`` until the caller opens the new one. Called from one thread
at a time (the scheduler's).
"""

from __future__ import annotations

import mmap
import struct
from typing import Sequence

import numpy as np
import posix_ipc

from kvpool.shared import index_format as f

_W = f.ENTRY_WORDS


class IndexReader:
    """One mapped index segment."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self._buf = buf
        header = buf[:f.HEADER_BYTES]
        self.capacity = struct.unpack_from(f.H_CAPACITY[1], header, f.H_CAPACITY[0])[0]
        self.daemon_id = (struct.unpack_from(f.H_DAEMON_ID[1], header, f.H_DAEMON_ID[0])[0]
                          .rstrip(b"\0").decode(errors="replace"))
        flags = struct.unpack_from(f.H_FLAGS[1], header, f.H_FLAGS[0])[0]
        self.has_remote_tier = bool(flags & f.FLAG_REMOTE_TIER)
        self._bits = f.capacity_bits(self.capacity)
        self._shift = np.uint64(64 - self._bits)
        self._mask = np.int64(self.capacity - 1)
        self._words = np.frombuffer(buf, np.uint64, self.capacity * _W,
                                    f.HEADER_BYTES).reshape(self.capacity, _W)
        self._superseded_at = f.H_SUPERSEDED[0]

    @classmethod
    def open(cls, name: str) -> "IndexReader":
        """Map segment ``name`` read-only. Raises ``PermissionError`` where this user may not
        (the segment has the daemon socket's owner, group and mode), ``FileNotFoundError`` where
        there is none, ``ValueError`` for a segment of another format."""
        try:
            shm = posix_ipc.SharedMemory(name, 0, read_only=True)
        except posix_ipc.PermissionsError as e:
            raise PermissionError(f"index segment {name}: {e}") from None
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no index segment {name}") from None
        try:
            buf = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        if (len(buf) < f.HEADER_BYTES or buf[:8] != f.MAGIC
                or struct.unpack_from(f.H_VERSION[1], buf, f.H_VERSION[0])[0]
                != f.FORMAT_VERSION):
            buf.close()
            raise ValueError(f"index segment {name} is of another format")
        return cls(name, buf)

    @property
    def superseded(self) -> bool:
        return self._buf[self._superseded_at] != 0

    def find(self, ns: bytes, hashes: Sequence[bytes]
             ) -> tuple[np.ndarray, np.ndarray] | None:
        """Per block hash of namespace ``ns``: its location (``index_format.POOL``, ``DISK``,
        ``REMOTE``, or ``EMPTY`` for a miss) and, in the pool, its slot ref; None when the
        segment is superseded. A key torn by a concurrent write reads as a miss."""
        if self.superseded:
            return None
        n = len(hashes)
        loc = np.zeros(n, np.uint8)
        ref = np.zeros(n, np.uint64)
        if not n:
            return loc, ref
        nsw = np.frombuffer(ns, np.uint64, 2)
        hw = np.frombuffer(b"".join(hashes), np.uint64).reshape(n, 2)
        folded = hw[:, 0] ^ hw[:, 1] ^ (nsw[0] ^ nsw[1])
        with np.errstate(over="ignore"):
            bucket = ((folded * np.uint64(f.HASH_MULTIPLIER)) >> self._shift).astype(np.int64)
        todo = np.arange(n)
        words, mask = self._words, self._mask
        for _ in range(f.MAX_PROBE):
            b = bucket[todo]
            state = words[b, 0]                 # the seqlock: state, body, state again
            body = words[b, 1:]
            again = words[b, 0]
            stable = (state == again) & ((state & np.uint64(0x100)) == 0)
            where = (state & np.uint64(0xFF)).astype(np.uint8)
            match = (stable & (where != f.EMPTY) & (body[:, 1] == nsw[0]) & (body[:, 2] == nsw[1])
                     & (body[:, 3] == hw[todo, 0]) & (body[:, 4] == hw[todo, 1]))
            if match.any():
                hit = todo[match]
                loc[hit] = where[match]
                ref[hit] = body[match, 0]
            go_on = stable & ~match & (where != f.EMPTY)
            if not go_on.any():
                break
            todo = todo[go_on]
            bucket[todo] = (bucket[todo] + 1) & mask
        return loc, ref

    def leading(self, ns: bytes, hashes: Sequence[bytes]) -> tuple[int, np.ndarray,
                                                                   np.ndarray] | None:
        """The run of leading hits of ``hashes`` (in any tier), their locations and refs;
        None when superseded."""
        got = self.find(ns, hashes)
        if got is None:
            return None
        loc, ref = got
        misses = np.flatnonzero(loc == f.EMPTY)
        n = int(misses[0]) if misses.size else len(hashes)
        return n, loc[:n], ref[:n]

    def close(self) -> None:
        self._words = None              # type: ignore[assignment]
        try:
            self._buf.close()
        except BufferError:
            pass                        # a caller still holds a view; the mapping goes with it
