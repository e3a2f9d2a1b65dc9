"""A namespace's map of block hash -> slot (the slot table's), kept in 256 dicts.

Why not one dict: a dict grows, and sheds the holes its deletions leave, by rebuilding itself
whole, with the GIL held. A full pool's namespace churns its map with every store (an
eviction out, a commit in), so one dict of N blocks rebuilds every N or so stores, and each
rebuild held the event loop (this VM, 16-byte keys, one insert): 41 ms at 350K blocks, 73 ms at
700K, 180 ms at 1.4M while a fresh daemon fills, and 136 ms at a steady 700K. A TiB pool of
TP-sharded blocks holds millions. Split 256 ways, each rebuild moves about 1/256 of the map.

A key's dict is named by the top byte of its Python hash (``hash(key)``, cached in the bytes
object), because a dict's own probe starts from the low bits: those stay spread inside each
dict. The batch passes are C loops (``daemon/_key_table.c``) where the install built them, else
the Python ones below, which stay the reference; both pick the same dict for every key.
"""

from __future__ import annotations

import sys
from itertools import chain
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

try:
    from kvpool.daemon import _key_table
except ImportError:       # no C compiler at install: the Python passes
    _key_table = None

SHARD_BITS = 8
SHARDS = 1 << SHARD_BITS
_SHIFT = sys.hash_info.width - SHARD_BITS
_MASK = SHARDS - 1


def shard_index(key: bytes) -> int:
    """Which of a table's dicts holds ``key`` (the top byte of its hash, as C reads it)."""
    return hash(key) >> _SHIFT & _MASK


def _check(shards: tuple[dict, ...]) -> None:
    if type(shards) is not tuple or len(shards) != SHARDS:
        raise TypeError(f"the shards must be a tuple of {SHARDS} dicts")


def find(shards: tuple[dict, ...], keys: Iterable[bytes]) -> list[Any]:
    """Per key, the value the table maps it to, or None."""
    _check(shards)
    return [shards[hash(k) >> _SHIFT & _MASK].get(k) for k in keys]


def put(shards: tuple[dict, ...], keys: Iterable[bytes], values: Iterable[Any]) -> None:
    """Map each key to its value (as ``dict.update(zip(keys, values))``)."""
    _check(shards)
    for k, v in zip(keys, values):
        shards[hash(k) >> _SHIFT & _MASK][k] = v


def delete(shards: tuple[dict, ...], keys: Iterable[bytes]) -> None:
    """Unmap every key, in order; KeyError at the first not held (those before it are gone)."""
    _check(shards)
    for k in keys:
        del shards[hash(k) >> _SHIFT & _MASK][k]


def holds_any(shards: tuple[dict, ...], keys: Iterable[bytes]) -> bool:
    """Whether the table maps any of ``keys``."""
    _check(shards)
    return any(k in shards[hash(k) >> _SHIFT & _MASK] for k in keys)


_PASSES = ("find", "put", "delete", "holds_any")
PYTHON = SimpleNamespace(name="python", **{p: globals()[p] for p in _PASSES})
COMPILED = None if _key_table is None else SimpleNamespace(
    name="compiled", **{p: getattr(_key_table, p) for p in _PASSES})
PASSES = COMPILED or PYTHON


class KeyTable:
    """Block hash -> slot for one namespace: a dict's reads and writes one key at a time, and
    batch passes (``find``, ``put_many``, ``delete_many``, ``holds_any``) for a job's keys.
    Iteration runs dict by dict, not in insertion order. ``shards`` is the tuple of dicts, for
    the slot record's C walk of a lookup (``daemon/_slot_record.c``'s ``leading``)."""

    __slots__ = ("shards", "_passes")

    def __init__(self, passes: SimpleNamespace | None = None) -> None:
        self.shards: tuple[dict[bytes, Any], ...] = tuple({} for _ in range(SHARDS))
        self._passes = passes or PASSES

    def get(self, key: bytes, default: Any = None) -> Any:
        return self.shards[hash(key) >> _SHIFT & _MASK].get(key, default)

    def __getitem__(self, key: bytes) -> Any:
        return self.shards[hash(key) >> _SHIFT & _MASK][key]

    def __setitem__(self, key: bytes, value: Any) -> None:
        self.shards[hash(key) >> _SHIFT & _MASK][key] = value

    def __delitem__(self, key: bytes) -> None:
        del self.shards[hash(key) >> _SHIFT & _MASK][key]

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) >> _SHIFT & _MASK]

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __bool__(self) -> bool:
        return any(self.shards)

    def __iter__(self) -> Iterator[bytes]:
        return chain.from_iterable(self.shards)

    def keys(self) -> Iterator[bytes]:
        return chain.from_iterable(self.shards)

    def values(self) -> Iterator[Any]:
        return chain.from_iterable(d.values() for d in self.shards)

    def items(self) -> Iterator[tuple[bytes, Any]]:
        return chain.from_iterable(d.items() for d in self.shards)

    def find(self, keys: Iterable[bytes]) -> list[Any]:
        """Per key, its slot or None."""
        return self._passes.find(self.shards, keys)

    def put_many(self, keys: Iterable[bytes], values: Iterable[Any]) -> None:
        self._passes.put(self.shards, keys, values)

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Unmap keys the table holds (KeyError at the first it does not)."""
        self._passes.delete(self.shards, keys)

    def holds_any(self, keys: Iterable[bytes]) -> bool:
        return self._passes.holds_any(self.shards, keys)


# What a lookup of a namespace with no table reads (never written).
EMPTY = KeyTable()
