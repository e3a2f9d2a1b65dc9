"""Block keys: a namespace plus a chained hash over token ids.

A key names one block of KV for one model, layout and token prefix. Keys must be equal in every
process and after restarts, so nothing here uses Python's ``hash`` (seeded per process unless
``PYTHONHASHSEED`` is fixed): everything is BLAKE2b over explicit little-endian bytes.

- ``Namespace`` (16 bytes) binds the model identity and the layout fingerprint. Engines with
  equal namespaces share blocks; different ones never see each other's.
- ``BlockHash`` (16 bytes) chains: hash(block i) covers hash(block i-1) and block i's tokens,
  so a prefix is a run of leading keys. ``extra`` (cache salt, LoRA name, multimodal hashes)
  seeds the chain, so it changes every key of the request.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import NewType, Sequence

Namespace = NewType("Namespace", bytes)
BlockHash = NewType("BlockHash", bytes)

KEY_BYTES = 16


def make_namespace(model_id: str, layout_fingerprint: bytes) -> Namespace:
    """The namespace of a model served with one layout (see ``Layout.fingerprint``)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvpool-ns")
    h.update(model_id.encode())
    h.update(b"\0")
    h.update(layout_fingerprint)
    return Namespace(h.digest())


def chain_seed(namespace: bytes, extra: bytes = b"") -> BlockHash:
    """The parent hash of a request's first block. ``extra`` isolates tenants (cache salt)."""
    return BlockHash(hashlib.blake2b(namespace + b"\0" + extra, digest_size=KEY_BYTES,
                                     person=b"kvpool-seed").digest())


def chain_block_hashes(token_ids: Sequence[int], block_tokens: int, parent: bytes,
                       start_block: int = 0, block_extras: Sequence[bytes] | None = None
                       ) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (or ``chain_seed(...)`` for block 0),
    which lets a caller extend a request's chain step by step without rehashing its prefix.
    ``block_extras[i]``, when given, is mixed into block ``start_block + i`` (multimodal input
    hashes that fall in that block). Only full blocks get a hash.
    """
    n_full = len(token_ids) // block_tokens
    if n_full <= start_block:
        return []
    # The run's tokens packed once at C speed (array, then slices), and each block hashed by a
    # copy of a prepared hasher fed parent, tokens (, marker and extras): the same digest as
    # one-shot hashing of the concatenation, without re-parsing blake2b's keyword arguments or
    # packing per block (~20% of the cost of keying a decode run of 8 blocks).
    packed = array("q", token_ids[start_block * block_tokens:n_full * block_tokens])
    if _SWAP:
        packed.byteswap()
    tokens = packed.tobytes()
    width = block_tokens * 8
    new = _BLOCK_HASHER.copy
    out: list[BlockHash] = []
    append = out.append
    for off in range(0, len(tokens), width):
        h = new()
        h.update(parent)
        h.update(tokens[off:off + width])
        if block_extras is not None:
            i = off // width
            if i < len(block_extras) and block_extras[i]:
                h.update(b"\1")
                h.update(block_extras[i])
        parent = h.digest()
        append(parent)     # (a BlockHash: NewType is the identity at run time)
    return out


_BLOCK_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvpool-block")
# Keys are little-endian int64 tokens on every host.
_SWAP = sys.byteorder != "little"
assert array("q").itemsize == 8


def request_block_hashes(namespace: bytes, token_ids: Sequence[int], block_tokens: int,
                         extra: bytes = b"") -> list[BlockHash]:
    """Every full block's hash for a request, from its first token."""
    return chain_block_hashes(token_ids, block_tokens, chain_seed(namespace, extra))
