"""The shared-memory index's entries, written in Python: the reference for the compiled writer
(``daemon/_index_writer.c``) and the fallback where it was not built (no C compiler).

Both keep which entry holds which key in a mirror of their own (the daemon never reads keys
back from the segment) and write entries under ``shared/index_format.py``'s seqlock. Same
interface: ``put_many``, ``remove_many``, ``entry_of``, ``location``, ``published``,
``unpublished``, ``close``. Callers: ``daemon/index_segment.py`` only, on the event loop.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from kvpool.shared import index_format as f

_SEQ_SHIFT = np.uint64(8)
_LOCATION = np.uint64(0xFF)
_ONE, _TWO = np.uint64(1), np.uint64(2)
# Up to this many entries are written one by one (a few 8-byte stores each beat numpy's setup)
_SCALAR_WRITES = 4


class PythonEntries:
    """The entries of one mapped segment (``buf``: header, then ``capacity`` entries), at most
    ``limit`` keys published."""

    def __init__(self, buf, capacity: int, limit: int) -> None:
        if not 0 <= limit < capacity:
            raise ValueError(f"limit {limit}: must be below the capacity {capacity}")
        self._buf = buf
        self.bits = f.capacity_bits(capacity)
        self._mask = capacity - 1
        self._limit = limit
        self._words = memoryview(buf)[f.HEADER_BYTES:].cast("Q")
        self._table = np.frombuffer(buf, np.uint64, capacity * f.ENTRY_WORDS,
                                    f.HEADER_BYTES).reshape(capacity, f.ENTRY_WORDS)
        self._where: dict[bytes, int] = {}             # key -> its entry
        self._keys: list[bytes | None] = [None] * capacity   # entry -> its key
        self._homes: list[int] = [0] * capacity        # entry -> its key's home (a removal's
        #                                                shift reads it for every entry after)
        self.unpublished = 0

    @property
    def published(self) -> int:
        return len(self._where)

    def entry_of(self, key: bytes) -> int | None:
        return self._where.get(key)

    def location(self, key: bytes) -> int:
        i = self._where.get(key)
        return f.EMPTY if i is None else self._words[i * f.ENTRY_WORDS] & 0xFF

    def put_many(self, keys: Sequence[bytes], location: int,
                 refs: Sequence[int] | None = None) -> int:
        """Each of ``keys`` at ``location`` with its ref; returns how many were published. The
        entries are written together: every state odd, then the bodies, then every state even
        (each entry's seqlock still brackets its body), a few numpy calls for any count."""
        if any(len(k) != 32 for k in keys):
            raise ValueError("keys: each must be 32 bytes (namespace + block hash)")
        where, keys_at, homes, mask = self._where, self._keys, self._homes, self._mask
        if refs is None:
            refs = [0] * len(keys)
        new = [k for k in keys if k not in where]
        new_homes = dict(zip(new, _homes(new, self.bits))) if new else {}
        entries: dict[int, tuple[int, int, bytes]] = {}
        published = 0
        grew = False
        for key, ref in zip(keys, refs):
            i = where.get(key)
            if i is None:
                if len(where) >= self._limit:
                    self.unpublished += 1
                    continue
                i = h = new_homes[key]
                while keys_at[i] is not None:
                    i = (i + 1) & mask
                keys_at[i] = key
                homes[i] = h
                where[key] = i
                grew = True
            entries[i] = (location, ref, key)
            published += 1
        if entries:
            self._write_many(entries)
        if grew:
            self._put_published()
        return published

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
        self._put_published()

    def close(self) -> None:
        self._table = None      # type: ignore[assignment]  (its export pins the mapping)
        self._words.release()

    def _put_published(self) -> None:
        offset, fmt = f.H_PUBLISHED
        struct.pack_into(fmt, self._buf, offset, len(self._where))

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
