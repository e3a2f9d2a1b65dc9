"""Block checksums, the one definition every tier under the pool uses.

A block's checksum is xxh3-64 of its bytes seeded with a hash of its 32-byte pool key
(namespace + block hash): a copy of another key's bytes, or bytes left behind under a reused
name, fails verification as surely as a flipped bit. xxh3 runs at tens of GB/s a core (zlib's
crc32 at ~2 GB/s would be slower than the disk or network it guards).

Pure functions over pool memory; they block for the time of the hashing and run on the tiers'
own threads, never on the event loop.
"""

from __future__ import annotations

import numpy as np
import xxhash


def block_seed(key: bytes) -> int:
    """The checksum seed of the block named ``key``."""
    return xxhash.xxh3_64_intdigest(key)


def block_checksums(pool: memoryview, offsets: list[int], keys: list[bytes],
                    slot_bytes: int) -> np.ndarray:
    """uint64 checksum of each block of ``slot_bytes`` at pool byte offset ``offsets[i]``."""
    return np.fromiter((xxhash.xxh3_64_intdigest(pool[o:o + slot_bytes], block_seed(k))
                        for o, k in zip(offsets, keys)), np.uint64, len(keys))
