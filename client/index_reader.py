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
_ZERO = np.uint64(0)
_HALF = np.uint64(32)
_ODD = np.uint64(0x100)         # the sequence number's low bit: odd while being written
_LOCATION = np.uint64(0xFF)


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
        self._mul = np.uint64(f.HASH_MULTIPLIER)
        self._words = np.frombuffer(buf, np.uint64, self.capacity * _W,
                                    f.HEADER_BYTES).reshape(self.capacity, _W)
        self._state = self._words[:, 0]
        self._flat = memoryview(buf)[f.HEADER_BYTES:].cast("Q")
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
        ``REMOTE``, or ``EMPTY`` for a miss) and, in the pool, its slot ref (0 elsewhere); None
        when the segment is superseded. A key torn by a concurrent write reads as a miss.

        Every key's home entry is read in one vectorised pass (about 20 numpy calls whatever
        the count: they, not the keys, are the cost); the few keys displaced by a collision are
        followed one by one in Python (a table at most 3/4 full displaces about one key in 200
        by more than a step or two)."""
        got = self._home_pass(ns, hashes)
        if got is None:
            return None
        loc, ref, displaced, home, want = got
        if displaced.any():
            self._follow(np.flatnonzero(displaced).tolist(), home, want, loc, ref)
        return loc, ref

    def leading(self, ns: bytes, hashes: Sequence[bytes]
                ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """The run of leading hits of ``hashes`` (in any tier), their locations and refs;
        None when superseded. Keys past the first miss are not followed (a prefix ends there)."""
        got = self._home_pass(ns, hashes)
        if got is None:
            return None
        loc, ref, displaced, home, want = got
        missed = (loc == _ZERO) & ~displaced          # a definite miss: EMPTY, or torn
        first = np.flatnonzero(missed)
        end = int(first[0]) if first.size else len(loc)
        for i in np.flatnonzero(displaced[:end]).tolist():
            self._follow([i], home, want, loc, ref)
            if not loc[i]:
                end = i
                break
        return end, loc[:end], ref[:end]

    def _home_pass(self, ns: bytes, hashes: Sequence[bytes]):
        """Every key's home entry, read under its seqlock: (locations and refs of the keys
        found there, which keys sit elsewhere in the cluster, homes, key words); None when
        superseded."""
        if self._buf[self._superseded_at]:
            return None
        n = len(hashes)
        if not n:
            empty = np.zeros(0, np.uint64)
            return empty, empty, np.zeros(0, bool), empty, np.zeros((0, 4), np.uint64)
        raw = b"".join(hashes)
        hw = np.frombuffer(raw, np.uint64).reshape(n, 2)
        nsw = np.frombuffer(ns, np.uint64)
        want = np.empty((n, 4), np.uint64)           # the key words an entry must hold
        want[:, :2] = nsw
        want[:, 2:] = hw
        folded = hw[:, 0] ^ hw[:, 1] ^ (nsw[0] ^ nsw[1])
        folded ^= folded >> _HALF
        home = (folded * self._mul) >> self._shift
        rows = self._words[home]                     # the seqlock: state and body, then the
        again = self._state[home]                    # state again
        state = rows[:, 0]
        stable = (state == again) & ((state & _ODD) == _ZERO)
        match = stable & (rows[:, 2:] == want).all(1)
        where = state & _LOCATION
        displaced = stable & (where != _ZERO) & ~match
        return where * match, rows[:, 1] * match, displaced, home, want

    def _follow(self, todo: list[int], home: np.ndarray, want: np.ndarray, loc: np.ndarray,
                ref: np.ndarray) -> None:
        """Probe on past their home entry for the keys ``todo`` (positions in the lookup)."""
        words, mask = self._flat, self.capacity - 1
        for i in todo:
            key = want[i].tolist()
            j = int(home[i])
            for _ in range(f.MAX_PROBE - 1):
                j = (j + 1) & mask
                base = j * _W
                state = words[base]
                body = words[base + 1:base + _W].tolist()
                if words[base] != state or state & 0x100 or not state & 0xFF:
                    break                   # torn (a miss), or EMPTY: the key is not there
                if body[1:] == key:
                    loc[i] = state & 0xFF
                    ref[i] = body[0]
                    break

    def close(self) -> None:
        self._words = self._state = None    # type: ignore[assignment]
        self._flat.release()
        try:
            self._buf.close()
        except BufferError:
            pass                        # a caller still holds a view; the mapping goes with it
