"""Pool keys for vLLM requests: namespaces per KV-cache group, and each request's block keys.

Owns the mapping from what vLLM knows (the model, the KV-cache config, a ``Request``'s tokens,
cache salt, LoRA and multimodal inputs) to kvpool keys. Both connector roles compute the same
namespaces from the same inputs, so the scheduler can look up what the workers store. Never
talks to the daemon and never uses vLLM's own block hashes: those are seeded per process unless
``PYTHONHASHSEED`` is fixed, and a pool outlives processes.

Per group: a hybrid model (full attention + sliding window) has one namespace per KV-cache
group, because a group's blocks hold different layers. Keys of one request chain over the same
tokens in every group but start from the group's own seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from kvpool.shared.keys import chain_block_hashes, chain_seed, make_namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
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
    kv_heads: int = 0

    @property
    def window_blocks(self) -> int | None:
        """Blocks a load must bring back for this group to serve a hit, or None for all.

        A token attends to the ``sliding_window - 1`` tokens before it, so the block holding
        the hit's first recomputed token needs the blocks reaching that far back.
        """
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // self.block_tokens) + 1


def model_identity(vllm_config: "VllmConfig", extra: dict[str, Any]) -> str:
    """The model part of every namespace. ``model_id`` in the extra config overrides it, so
    engines serving one checkpoint from different paths can share a pool."""
    if extra.get("model_id"):
        return str(extra["model_id"])
    mc = vllm_config.model_config
    revision = getattr(mc, "revision", None) or ""
    return f"{mc.model}@{revision}"


def total_kv_heads(vllm_config: "VllmConfig", spec: Any, tp: int) -> int:
    """KV heads of a group across all TP ranks: 1 where every rank holds the same single copy
    (MLA, ``max_tp_shards=1``), else the model's KV heads when they agree with the spec's
    per-rank count (vLLM replicates heads when there are fewer than ranks), else the per-rank
    count times TP (a layer group sized otherwise than the model as a whole)."""
    if getattr(spec, "max_tp_shards", None) == 1 or "MLA" in type(spec).__name__:
        return 1
    local = int(spec.num_kv_heads)
    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        total = 0
    if total > 0 and max(1, total // tp) == local:
        return total
    return local * tp


def build_groups(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 extra: dict[str, Any]) -> list[GroupInfo]:
    """Namespaces for every group the pool can hold (attention groups; not Mamba/recurrent).

    The identity names everything that changes the bytes of a block: model, group layers and
    spec (KV heads of the whole model, head size, dtype, window), block size and the resolved
    KV-cache layout. Not the TP size: workers of every TP size store and load their own heads
    of one slot (``kvpool.shared.layout``), so engines at TP 1, 2, 4, 8 share blocks. The
    worker's registered ``Layout`` is checked against the namespace by the daemon, so a
    disagreement is refused instead of sharing wrong bytes.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec

    model = model_identity(vllm_config, extra)
    tp = vllm_config.parallel_config.tensor_parallel_size
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout or "default"
    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        heads = total_kv_heads(vllm_config, spec, tp)
        identity = (f"vllm-kv v2|{type(spec).__name__}|bs={spec.block_size}"
                    f"|kv_heads={heads}|head={spec.head_size}/{spec.head_size_v}"
                    f"|dtype={spec.dtype}|quant={getattr(spec, 'kv_quant_mode', '')}"
                    f"|window={window}|layout={layout}"
                    f"|layers={','.join(group.layer_names)}")
        fp = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        out.append(GroupInfo(index=i, namespace=make_namespace(model, fp), identity=identity,
                             block_tokens=spec.block_size, layer_names=tuple(group.layer_names),
                             sliding_window=window, kv_heads=heads))
    return out


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


