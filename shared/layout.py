"""What one KV block looks like, and where an engine keeps it.

``Layout`` is the engine-independent part: how many bytes one TP rank's shard of one block
holds and how those bytes are cut into segments. Two engines with equal layout fingerprints
(and the same model) write byte-identical shards, so they share pool slots.

``Placement`` is the engine-specific part, sent at registration: for every segment, which of the
worker's memory regions holds it, at what offset, and the stride from one block to the next.
vLLM FlashAttention per-layer caches ``[2, num_blocks, block_size, heads, head_dim]`` give two
segments per layer (K and V); a block-outermost cache gives one segment per block; MLA gives one
latent segment per layer.
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


class Layout(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One TP rank's view of one KV block of one KV-cache group.

    A slot in the pool holds ``tp_size`` shards, each ``shard_bytes`` long, each the
    concatenation of ``segment_bytes`` in order.
    """

    block_tokens: int
    tp_size: int
    dtype: str
    segment_bytes: tuple[int, ...]
    # What the segments are, for people and for the fingerprint (e.g. "llama L32 KV flash NHD").
    description: str = ""

    @property
    def shard_bytes(self) -> int:
        return sum(self.segment_bytes)

    @property
    def shard_stride_bytes(self) -> int:
        """Distance between two ranks' shards inside a slot (shard size, aligned)."""
        return -(-self.shard_bytes // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES

    @property
    def slot_bytes(self) -> int:
        return self.shard_stride_bytes * self.tp_size

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

    def fingerprint(self) -> bytes:
        """16 bytes naming this layout; stable across processes, hosts and versions."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=16,
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
