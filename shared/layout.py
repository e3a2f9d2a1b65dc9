"""What one KV block looks like, and where an engine keeps it.

``Layout`` is the engine-independent part: how many bytes one TP rank's part of one block holds,
how those bytes are cut into segments, and (for layouts that declare their KV heads) which heads
they are. ``Placement`` is the engine-specific part, sent at registration: for every segment,
which of the worker's memory regions holds it, at what offset, and the stride from one block to
the next. vLLM per-layer caches give one or two segments per layer, a block-outermost cache one
segment per block, MLA one latent segment per layer.

The slot (one block in the pool) comes in two formats:

- **Head-split** (``kv_heads`` > 0), independent of TP. A rank's part of a block, its segments
  concatenated, is ``rows x local_heads x head_bytes``: a row (a token of one layer's K and V, or
  a whole layer in head-major layouts) holds one cell of ``head_bytes`` per local head. The slot
  holds the same rows with *every* head: row ``k`` at ``k * kv_heads * head_bytes``, head ``h``
  at ``h * head_bytes`` inside it (what one rank holding all heads would store). A rank at any
  TP size reads and writes exactly its head range ``[h0, h1)`` of every row: one strided run,
  ``rows`` rows of ``local_heads * head_bytes`` bytes, ``kv_heads * head_bytes`` apart. So
  engines of one model at TP 1, 2, 4, 8 share slots and namespaces (``canonical`` and
  ``fingerprint`` leave TP out). With fewer KV heads than ranks, vLLM replicates heads: ranks
  holding the same head store it once (the first of them, ``is_primary``) and all of them load
  it; MLA is the case ``kv_heads == 1`` (one latent copy for every rank).
- **Rank-sharded** (``kv_heads`` == 0, heads not declared): the slot holds ``tp_size`` opaque
  shards, rank ``r``'s at ``r * shard_stride_bytes``; only engines of one TP size share it.

A slot commits when every *unit* has landed: every head of a head-split layout, every rank of a
rank-sharded one (``full_mask``, ``rank_mask``).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvpool.shared.errors import LayoutMismatch, OutOfRange

# Shards are laid out at this alignment inside a slot, and slots inside the pool, so every copy
# unit starts on a page boundary (the host path copies in units of the gcd of all offsets).
SHARD_ALIGN_BYTES = 4096
# Bounds a layout must keep. Well above any real engine, and low enough that nothing the daemon
# derives from a layout (a bit per TP rank, a slot size, a loop over segments) can be made
# enormous by a hostile or corrupt registration.
MAX_TP_SIZE = 256
MAX_BLOCK_TOKENS = 1 << 20
MAX_SEGMENTS = 1 << 16
MAX_SEGMENT_BYTES = 1 << 40
# Head-split layouts: a bit per KV head in a slot's commit mask; a rank's part of a block is cut
# into at most this many rows (plus its segments) by every copy engine.
MAX_KV_HEADS = 1 << 12
MAX_ROWS = 1 << 20


class Layout(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One TP rank's view of one KV block of one KV-cache group (see the module docstring for
    the slot formats)."""

    block_tokens: int
    tp_size: int
    dtype: str
    segment_bytes: tuple[int, ...]
    # What the segments are, for people and for the fingerprint (e.g. "llama L32 KV flash NHD").
    description: str = ""
    # Appended last (array_like positional): layouts and pools from before still decode.
    # The model's KV heads across all ranks (0: not declared, the slot is rank-sharded).
    kv_heads: int = 0
    # Bytes of one head's cell in a row of this rank's part (head-split layouts only).
    head_bytes: int = 0

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's part of a block (what its segments hold)."""
        return sum(self.segment_bytes)

    @property
    def shard_stride_bytes(self) -> int:
        """Rank-sharded layouts: distance between two ranks' shards inside a slot."""
        return -(-self.shard_bytes // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES

    @property
    def slot_bytes(self) -> int:
        """Bytes of one pool slot (every head, or every rank's shard), 4 KiB aligned."""
        if self.kv_heads:
            total = self.rows * self.kv_heads * self.head_bytes
            return -(-total // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES
        return self.shard_stride_bytes * self.tp_size

    # ---- heads (head-split layouts) --------------------------------------------------------

    @property
    def local_heads(self) -> int:
        """KV heads each rank holds: ``kv_heads / tp_size``, or 1 where heads are replicated."""
        return max(1, self.kv_heads // self.tp_size) if self.kv_heads else 0

    @property
    def rows(self) -> int:
        """Rows of a block (head-split layouts): ``shard_bytes / (local_heads * head_bytes)``."""
        return self.shard_bytes // (self.local_heads * self.head_bytes)

    def head_range(self, tp_rank: int) -> tuple[int, int]:
        """The heads ``[h0, h1)`` rank ``tp_rank`` holds (vLLM's split: contiguous ranges; with
        fewer heads than ranks, ``tp_size / kv_heads`` consecutive ranks share one head)."""
        if self.tp_size <= self.kv_heads:
            n = self.kv_heads // self.tp_size
            return tp_rank * n, (tp_rank + 1) * n
        h = tp_rank * self.kv_heads // self.tp_size
        return h, h + 1

    def is_primary(self, tp_rank: int) -> bool:
        """Whether this rank stores its heads: the first rank of each replica group (every rank
        when heads are not replicated). Other replicas only load."""
        if not self.kv_heads or self.tp_size <= self.kv_heads:
            return True
        return tp_rank % (self.tp_size // self.kv_heads) == 0

    # ---- commit units ----------------------------------------------------------------------

    @property
    def full_mask(self) -> int:
        """Bit set of the units a committed slot holds: one bit per head (head-split) or per
        rank (rank-sharded)."""
        return (1 << (self.kv_heads or self.tp_size)) - 1

    def rank_mask(self, tp_rank: int) -> int:
        """The units a store by ``tp_rank`` lands (0 for a replica that does not store)."""
        if not self.kv_heads:
            return 1 << tp_rank
        if not self.is_primary(tp_rank):
            return 0
        h0, h1 = self.head_range(tp_rank)
        return ((1 << h1) - 1) ^ ((1 << h0) - 1)

    def canonical(self) -> "Layout":
        """The layout a namespace is bound to: for head-split layouts the same block as held by
        one rank with every head (TP left out: equal for every TP size of one model); a
        rank-sharded layout is its own."""
        if not self.kv_heads:
            return self
        return Layout(self.block_tokens, 1, self.dtype,
                      (self.rows * self.kv_heads * self.head_bytes,), self.description,
                      self.kv_heads, self.head_bytes)

    def check(self) -> None:
        """Raise ``LayoutMismatch`` for a layout no slot can hold."""
        if not 0 < self.block_tokens <= MAX_BLOCK_TOKENS or not 0 < self.tp_size <= MAX_TP_SIZE:
            raise LayoutMismatch(f"layout needs block_tokens in [1, {MAX_BLOCK_TOKENS}] and "
                                 f"tp_size in [1, {MAX_TP_SIZE}]; got {self.block_tokens} and "
                                 f"{self.tp_size}")
        if not 0 < len(self.segment_bytes) <= MAX_SEGMENTS or any(
                not 0 < n <= MAX_SEGMENT_BYTES for n in self.segment_bytes):
            raise LayoutMismatch(f"layout needs 1 to {MAX_SEGMENTS} segments, each of 1 to "
                                 f"{MAX_SEGMENT_BYTES} bytes")
        if not 0 <= self.kv_heads <= MAX_KV_HEADS or not 0 <= self.head_bytes <= MAX_SEGMENT_BYTES:
            raise LayoutMismatch(f"kv_heads must be in [0, {MAX_KV_HEADS}] and head_bytes in "
                                 f"[0, {MAX_SEGMENT_BYTES}]")
        if not self.kv_heads:
            return
        if self.head_bytes <= 0:
            raise LayoutMismatch(f"a layout with kv_heads={self.kv_heads} needs head_bytes > 0")
        t, h = self.tp_size, self.kv_heads
        if (h % t if t <= h else t % h):
            raise LayoutMismatch(f"{h} KV heads cannot be split over tp_size={t}: the heads "
                                 f"must divide by the TP size, or the TP size by the heads")
        row = self.local_heads * self.head_bytes
        if self.shard_bytes % row:
            raise LayoutMismatch(f"this rank's {self.shard_bytes} bytes per block are not whole "
                                 f"rows of {self.local_heads} heads x {self.head_bytes} bytes")
        if self.local_heads < h and self.rows > MAX_ROWS:
            raise LayoutMismatch(f"a block of {self.rows} rows of heads is more than the "
                                 f"{MAX_ROWS} a rank's part may be cut into")

    def fingerprint(self) -> bytes:
        """16 bytes naming this layout; stable across processes, hosts and versions. Equal for
        every TP size of a head-split layout (it names the canonical form)."""
        c = self.canonical()
        fields: list = [c.block_tokens, c.tp_size, c.dtype, c.segment_bytes, c.description]
        if c.kv_heads:
            fields += [c.kv_heads, c.head_bytes]
        # Layouts without heads hash their five original fields only, as before heads existed.
        return hashlib.blake2b(msgspec.msgpack.encode(fields), digest_size=16,
                               person=b"kvpool-layout").digest()


class SegmentPlacement(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Where segment ``i`` of block ``b`` lives: ``region``'s base + offset + b * stride."""

    region: int
    offset_bytes: int
    block_stride_bytes: int


def check_placement(layout: Layout, placement: list[SegmentPlacement] | tuple[SegmentPlacement, ...],
                    region_bytes: list[int], num_blocks: int) -> None:
    """Raise ``LayoutMismatch``/``OutOfRange`` unless every segment of every block fits its region.

    Called by the daemon before it maps anything, so a wrong registration never leads to a copy
    outside the worker's memory.
    """
    if len(placement) != len(layout.segment_bytes):
        raise LayoutMismatch(f"placement has {len(placement)} segments, layout has "
                             f"{len(layout.segment_bytes)}")
    if num_blocks <= 0:
        raise OutOfRange(f"num_blocks must be > 0, got {num_blocks}")
    for i, (seg, nbytes) in enumerate(zip(placement, layout.segment_bytes)):
        if not 0 <= seg.region < len(region_bytes):
            raise OutOfRange(f"segment {i} names region {seg.region}; "
                             f"{len(region_bytes)} regions registered")
        if seg.offset_bytes < 0 or seg.block_stride_bytes < 0:
            raise OutOfRange(f"segment {i} has a negative offset or stride")
        end = seg.offset_bytes + (num_blocks - 1) * seg.block_stride_bytes + nbytes
        if end > region_bytes[seg.region]:
            raise OutOfRange(f"segment {i} of block {num_blocks - 1} ends at byte {end}, past "
                             f"region {seg.region} ({region_bytes[seg.region]} bytes)")
