"""``IndexReader``: the daemon's shared-memory index, mapped read-only in the scheduler's process.

A lookup here is one pass over the mapped table (``shared/index_format.py``) in the compiled
probe (``_index_probe.c``), or a few numpy passes where it was not built; no round trip and no
daemon CPU: the scheduler learns a request's hits in the same call that asks
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
import threading
from typing import Sequence

import numpy as np
import posix_ipc

from kvpool.shared import index_format as f

try:
    from kvpool.client import _index_probe
except ImportError:             # not built (no C compiler at install): numpy does the same
    _index_probe = None

_W = f.ENTRY_WORDS
_ZERO = np.uint64(0)
_HALF = np.uint64(32)
_ODD = np.uint64(0x100)         # the sequence number's low bit: odd while being written
_LOCATION = np.uint64(0xFF)
_BOTH = np.uint16(0x0101)     # two True bools read as one little-endian 16-bit word


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
        self._ns_folds: dict[bytes, np.uint64] = {}
        # The compiled probe where it was built (one pass, ~10x less CPU than numpy's ~30
        # array operations); tests turn it off to check the numpy path against the same cases.
        self.compiled = _index_probe is not None
        # Every page of the table read once, on a thread (numpy's pass lets the GIL go), so
        # that a lookup takes no page faults: keys sit at random places of a table sized for
        # the smallest blocks, and a 256-key lookup on a fresh mapping of 2**21 entries took
        # 0.25-0.8 ms on a 2-core VM, 70-230 of its probes faulting. Not joined on ``close``:
        # its view keeps the mapping until it ends.
        self._prefault = threading.Thread(target=_touch_pages, args=(self._words,),
                                          name="kvpool-index-prefault", daemon=True)
        self._prefault.start()

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

    def prefault_wait(self) -> None:
        """Until every page of the table has been read once (tests)."""
        self._prefault.join()

    @property
    def superseded(self) -> bool:
        return self._buf[self._superseded_at] != 0

    def find(self, ns: bytes, hashes: Sequence[bytes]
             ) -> tuple[np.ndarray, np.ndarray] | None:
        """Per block hash of namespace ``ns``: its location (``index_format.POOL``, ``DISK``,
        ``REMOTE``, or ``EMPTY`` for a miss) and, in the pool, its slot ref (0 elsewhere); None
        when the segment is superseded. A key torn by a concurrent write reads as a miss."""
        if self._buf[self._superseded_at]:
            return None
        if self.compiled:
            _, loc, ref = self._probe_arrays(ns, hashes, leading=False)
            return loc, ref
        return self._find_numpy(ns, hashes)

    def leading(self, ns: bytes, hashes: Sequence[bytes]
                ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """The run of leading hits of ``hashes`` (in any tier), their locations and refs;
        None when superseded. Keys past the first miss are not read (a prefix ends there)."""
        if self._buf[self._superseded_at]:
            return None
        if self.compiled:
            end, loc, ref = self._probe_arrays(ns, hashes, leading=True)
            return end, loc[:end], ref[:end]
        return self._leading_numpy(ns, hashes)

    def leading_lists(self, ns: bytes, hashes: Sequence[bytes]
                      ) -> tuple[int, list[int], list[int]] | None:
        """``leading`` as Python lists: (how many, their refs, their locations), what a
        scheduler hands on; the compiled probe builds them itself (numpy's ``tolist`` of two
        arrays costs more than the probe). None when superseded."""
        if self._buf[self._superseded_at]:
            return None
        if self.compiled:
            return _index_probe.probe(self._buf, self.capacity, f.MAX_PROBE, ns,
                                      _listed(hashes), True)
        n, loc, ref = self._leading_numpy(ns, hashes)
        return n, ref.tolist(), loc.tolist()

    def _probe_arrays(self, ns: bytes, hashes: Sequence[bytes], leading: bool
                      ) -> tuple[int, np.ndarray, np.ndarray]:
        """The compiled probe into two new arrays: (keys read, locations, refs)."""
        loc, ref = np.empty(len(hashes), np.uint64), np.empty(len(hashes), np.uint64)
        n = _index_probe.probe(self._buf, self.capacity, f.MAX_PROBE, ns, _listed(hashes),
                               leading, loc, ref)
        return n, loc, ref

    # ---- numpy: the reference, and the path where the probe was not built ----------------

    def _find_numpy(self, ns: bytes, hashes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """``find`` in numpy. Every key's home entry is read in one vectorised pass (about 20
        numpy calls whatever the count: they, not the keys, are the cost); the few keys
        displaced by a collision are followed one by one in Python (a table at most 3/4 full
        displaces about one key in 200 by more than a step or two)."""
        hit, where, refs, home = self._home_pass(ns, hashes)
        loc, ref = where * hit, refs * hit
        for i in np.flatnonzero(~hit & (where != _ZERO)).tolist():
            self._follow(i, ns, hashes[i], int(home[i]), loc, ref)
        return loc, ref

    def _leading_numpy(self, ns: bytes, hashes: Sequence[bytes]
                       ) -> tuple[int, np.ndarray, np.ndarray]:
        hit, where, refs, home = self._home_pass(ns, hashes)
        end = len(hit)
        if not hit.all():
            where, refs = where.copy(), refs.copy()
            for i in np.flatnonzero(~hit).tolist():
                # an entry that is neither EMPTY nor torn holds another key: ours may be on
                if not (where[i] and self._follow(i, ns, hashes[i], int(home[i]), where, refs)):
                    end = i
                    break
        return end, where[:end], refs[:end]

    def _home_pass(self, ns: bytes, hashes: Sequence[bytes]):
        """Every key's home entry, read under its seqlock: (which keys were found there, the
        entries' locations and refs, the homes). A location is nonzero where no key was found
        only if the entry was stable and held another key (ours may sit further on in the
        cluster)."""
        n = len(hashes)
        if not n:
            empty = np.zeros(0, np.uint64)
            return np.zeros(0, bool), empty, empty, empty
        raw = b"".join(hashes)
        hw = np.frombuffer(raw, np.uint64).reshape(n, 2)
        home = hw[:, 0] ^ hw[:, 1]
        home ^= self._ns_fold(ns)
        home ^= home >> _HALF
        home *= self._mul
        home >>= self._shift
        # The seqlock: state and body, then the state again. ``take`` of whole rows, not
        # fancy indexing (a third of the time).
        rows = self._words.take(home, axis=0)
        again = self._state[home]
        state = rows[:, 0]
        # stable: read twice alike, and even ((s | ODD) == (a ^ ODD) is s == a with s even)
        stable = (state | _ODD) == (again ^ _ODD)
        where = state & _LOCATION
        where *= stable
        # A prefix's keys are mostly all at home: two byte compares say so. Else per key,
        # each key's two words compared and read as one 16-bit word of two bools.
        if rows[:, 4:].tobytes() == raw and rows[:, 2:4].tobytes() == ns * n:
            hit = where != _ZERO
        else:
            hit = (rows[:, 4:] == hw).view(np.uint16).ravel() == _BOTH
            hit &= (rows[:, 2:4] == np.frombuffer(ns, np.uint64)).view(np.uint16).ravel() == _BOTH
            hit &= where != _ZERO
        return hit, where, rows[:, 1], home

    def _ns_fold(self, ns: bytes) -> np.uint64:
        fold = self._ns_folds.get(ns)
        if fold is None:
            lo, hi = struct.unpack("<QQ", ns)
            fold = self._ns_folds[ns] = np.uint64(lo ^ hi)
        return fold

    def _follow(self, i: int, ns: bytes, key_hash: bytes, home: int, loc: np.ndarray,
                ref: np.ndarray) -> bool:
        """Probe on past its home entry for key ``i`` of a lookup; set its location and ref
        and say True where found."""
        words, mask = self._flat, self.capacity - 1
        key = list(struct.unpack("<QQQQ", ns + key_hash))
        j = home
        for _ in range(f.MAX_PROBE - 1):
            j = (j + 1) & mask
            base = j * _W
            state = words[base]
            body = words[base + 1:base + _W].tolist()
            if words[base] != state or state & 0x100 or not state & 0xFF:
                return False            # torn (a miss), or EMPTY: the key is not there
            if body[1:] == key:
                loc[i] = state & 0xFF
                ref[i] = body[0]
                return True
        return False

    def close(self) -> None:
        self._words = self._state = None    # type: ignore[assignment]
        self._flat.release()
        try:
            self._buf.close()
        except BufferError:
            pass                        # a caller still holds a view; the mapping goes with it


def _touch_pages(words: np.ndarray) -> None:
    flat = words.reshape(-1).view(np.uint8)
    int(flat[::mmap.PAGESIZE].sum())


def _listed(hashes: Sequence[bytes]) -> list[bytes] | tuple[bytes, ...] | bytes:
    """What the compiled probe takes: a list or tuple of hashes as they are, else joined."""
    return hashes if isinstance(hashes, (list, tuple)) else b"".join(hashes)
