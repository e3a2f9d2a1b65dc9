"""Pool keys for vLLM requests: the groups they belong to, and each request's block keys.

Owns the mapping from what vLLM knows about a request (its tokens, cache salt, LoRA and
multimodal inputs) to kvpool keys, per KV-cache group (``GroupInfo``; which groups a model has
and their namespaces: ``groups.py``). Both connector roles compute the same keys from the same
inputs, so the scheduler can look up what the workers store. Never talks to the daemon and never
uses vLLM's own block hashes: those are seeded per process unless ``PYTHONHASHSEED`` is fixed,
and a pool outlives processes.

Per group: a hybrid model (full attention, sliding window, recurrent state) has one namespace
per KV-cache group, because a group's blocks hold different layers. Keys of one request chain
over the same tokens in every group but start from the group's own seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvpool.shared.keys import chain_block_hashes, chain_seed

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group as the connector sees it."""

    index: int                 # vLLM's group index (position in kv_cache_groups)
    namespace: bytes
    identity: str              # what went into the namespace, for logs and Layout.description
    block_tokens: int
    layer_names: tuple[str, ...]
    sliding_window: int | None  # tokens; None for full attention
    # The group's KV heads across all TP ranks (1 for MLA: one latent copy for every rank); the
    # workers register head-split layouts with it, so engines of every TP size share blocks.
    # A state group: 1 when every rank holds the whole state, else 0 (rank-sharded).
    kv_heads: int = 0
    # A recurrent-state group (Mamba, gated delta net): block i holds the state after
    # (i + 1) * block_tokens tokens, where vLLM kept one (groups.py).
    state: bool = False

    @property
    def kind(self) -> str:
        """"full", "window" or "state": what a hit of h blocks needs of this group (the
        blocks [0, h), the window's blocks before h, or the state in block h - 1)."""
        if self.state:
            return "state"
        return "full" if self.sliding_window is None else "window"

    @property
    def window_blocks(self) -> int | None:
        """Blocks a load must bring back for this group to serve a hit, or None for all.

        A token attends to the ``sliding_window - 1`` tokens before it, so the block holding
        the hit's first recomputed token needs the blocks reaching that far back.
        """
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // self.block_tokens) + 1


def request_salt(request: "Request") -> bytes:
    """Everything about a request, other than its tokens, that changes its KV."""
    parts = []
    if request.cache_salt:
        parts.append(b"salt\0" + request.cache_salt.encode())
    lora = request.lora_request
    if lora is not None:
        parts.append(b"lora\0" + str(getattr(lora, "lora_name", "") or lora.lora_int_id).encode()
                     + b"\0" + str(getattr(lora, "lora_path", "") or "").encode())
    return b"\1".join(parts)


def is_cacheable(request: "Request") -> bool:
    """Prompt embeddings have no token ids to key on: such requests neither hit nor store."""
    return getattr(request, "prompt_embeds", None) is None


def _mm_block_extras(request: "Request", block_tokens: int, start: int, stop: int
                     ) -> list[bytes] | None:
    """Per block in [start, stop): the multimodal inputs whose placeholders overlap it.

    Placeholder tokens are the same for every image, so the image's own hash and the offset
    of the block inside it go into the key."""
    features = getattr(request, "mm_features", None)
    if not features:
        return None
    extras = [b""] * (stop - start)
    for f in features:
        pos = f.mm_position
        lo, hi = pos.offset, pos.offset + pos.length
        first, last = max(lo // block_tokens, start), min((hi - 1) // block_tokens, stop - 1)
        for b in range(first, last + 1):
            ident = (f.identifier or f.mm_hash or "").encode()
            extras[b - start] += ident + b"@" + str(b * block_tokens - lo).encode() + b";"
    return extras


class RequestKeys:
    """A request's block keys per group, extended as its tokens grow; hashing is incremental.

    Owned by the scheduler role; one per live request.
    """

    __slots__ = ("_groups", "_salt", "_keys", "cacheable")

    def __init__(self, request: "Request", groups: Sequence[GroupInfo]) -> None:
        self._groups = groups
        self._salt = request_salt(request)
        self._keys: list[list[bytes]] = [[] for _ in groups]
        self.cacheable = is_cacheable(request)

    def keys(self, request: "Request", slot: int, num_blocks: int) -> list[bytes]:
        """Keys of blocks ``[0, num_blocks)`` of group ``slot`` (an index into ``groups``);
        ``num_blocks`` must not exceed the request's full blocks."""
        have = self._keys[slot]
        if len(have) < num_blocks:
            self._extend(request, slot, num_blocks)
        return have[:num_blocks]

    def _extend(self, request: "Request", slot: int, num_blocks: int) -> None:
        have = self._keys[slot]
        g = self._groups[slot]
        bt = g.block_tokens
        parent = have[-1] if have else chain_seed(g.namespace, self._salt)
        tokens = request.all_token_ids[len(have) * bt:num_blocks * bt]
        extras = _mm_block_extras(request, bt, len(have), num_blocks)
        have.extend(chain_block_hashes(tokens, bt, parent, 0, extras))

    def range(self, request: "Request", slot: int, start: int, stop: int) -> list[bytes]:
        """Keys of blocks ``[start, stop)`` of group ``slot`` (hashing what is missing)."""
        have = self._keys[slot]
        if len(have) < stop:
            self._extend(request, slot, stop)
        return have[start:stop]


