"""The shared-memory index's format: what the daemon writes and schedulers read, byte for byte.

The daemon publishes where each committed key is (a pool slot ref with its generation, or a
lower tier) in a POSIX shared-memory segment of its own (``daemon/index_segment.py`` writes it;
``client/index_reader.py`` reads it, mapped read-only, in the scheduler's process). It holds no
KV bytes. Layout, little-endian::

    [header: 4096 bytes][entry 0][entry 1]...[entry capacity-1]

An entry is six 64-bit words: ``[state][ref][ns lo][ns hi][hash lo][hash hi]``. ``state`` packs a
sequence number and a location: ``seq << 8 | location``. The writer makes ``seq`` odd, writes the
other five words, then makes it even with the new location, each word one aligned 8-byte store;
a reader reads the state word, the other five, and the state word again, and believes the entry
only if both reads are equal and even (a seqlock per entry, lock-free for readers). So a torn
read is a miss, never a hit: a hit always names a key that the entry held, committed, while it
was read. The ordering relies on x86-64's total store order (stores are seen in program order,
loads are not reordered with older loads); on other CPUs ``reader_supported`` says no and
schedulers ask the daemon instead.

Keys are found by linear probing from ``home(key)``; an ``EMPTY`` entry ends a probe. Deletion
shifts the entries behind it back (no tombstones), so a reader racing a deletion may miss a key
that is still there (a miss, never a wrong hit). A probe gives up after ``MAX_PROBE`` entries.

Imports only the standard library: both sides agree on these numbers and this hash.
"""

from __future__ import annotations

import platform

MAGIC = b"KVPIDX\x00\x01"
FORMAT_VERSION = 2   # 2: homes fold all four key words
HEADER_BYTES = 4096
ENTRY_WORDS = 6
ENTRY_BYTES = ENTRY_WORDS * 8

# Header fields: (byte offset, struct format).
H_MAGIC = (0, "8s")
H_VERSION = (8, "<I")
H_CAPACITY = (12, "<I")          # entries, a power of two
H_SUPERSEDED = (16, "<I")        # 1: a newer daemon (or a bigger table) replaced this segment
H_FLAGS = (20, "<I")
H_DAEMON_ID = (32, "32s")        # the daemon life that writes it (ASCII, NUL-padded)
H_PUBLISHED = (64, "<Q")         # keys published now (for `kvpool info` and tests)

# H_FLAGS bits.
FLAG_REMOTE_TIER = 1             # a tier the index cannot know fully (ask the daemon to probe)

# Entry locations (the low byte of the state word).
EMPTY = 0
POOL = 1                         # ``ref`` is the slot ref (generation << 32 | slot id)
DISK = 2                         # a lower tier holds it: the load names the key
REMOTE = 3
LOCATION_NAMES = {POOL: "pool", DISK: "disk", REMOTE: "remote"}

MAX_PROBE = 64

HASH_MULTIPLIER = 0x9E3779B97F4A7C15   # 2**64 / golden ratio: Fibonacci hashing spreads any key
_MUL = HASH_MULTIPLIER
_MASK64 = (1 << 64) - 1


def capacity_bits(capacity: int) -> int:
    return capacity.bit_length() - 1


def home(key: bytes, bits: int) -> int:
    """The first entry to probe for a 32-byte ``key`` (namespace + block hash) in a table of
    ``2**bits`` entries: the key's four words folded, the high half folded into the low,
    multiplied, top ``bits`` bits. Every word counts, so keys that are not uniform hashes
    (a client's own keys, counters: 1024 keys alike in their first word once made one
    cluster, and the daemon's event loop spent 5 s evicting them) spread as well as BLAKE2b
    ones. The reader computes the same with numpy (``client/index_reader.py``)."""
    w = (int.from_bytes(key[0:8], "little") ^ int.from_bytes(key[8:16], "little")
         ^ int.from_bytes(key[16:24], "little") ^ int.from_bytes(key[24:32], "little"))
    w ^= w >> 32
    return ((w * _MUL) & _MASK64) >> (64 - bits)


def segment_name(pool_name: str) -> str:
    """The index segment of the pool called ``pool_name`` (POSIX shm names start with /)."""
    return "/" + pool_name.lstrip("/") + "-index"


def reader_supported() -> bool:
    """Whether this CPU keeps the stores and loads the seqlock relies on in order (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")
