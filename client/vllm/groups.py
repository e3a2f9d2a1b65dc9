"""Which of a vLLM model's KV-cache groups the pool holds, their namespaces, and the refusal of
models it cannot serve whole.

Owns one decision per model, made the same way in both connector roles from what vLLM hands
them (the model config and the resolved ``KVCacheConfig``): the ``GroupInfo`` of every group
the pool holds, or a refusal. Never talks to the daemon.

A group is one of three kinds (``GroupInfo.kind``):

- **full** attention: a hit of ``h`` blocks needs the group's blocks ``[0, h)``;
- **window** (sliding-window attention): only the blocks the window reaches before ``h``;
- **state** (a Mamba / gated-delta-net group, ``MambaSpec``, in ``mamba_cache_mode="align"``):
  vLLM keeps, in the group's block ``i``, the recurrent state after ``(i + 1) * block_size``
  tokens, at the boundaries it chooses to keep (chunk ends, the prompt's last full block, each
  block a decode fills) and null blocks elsewhere. A hit of ``h`` blocks needs the state in
  block ``h - 1``; that block's key is the same token chain as an attention block ``h - 1``, in
  the group's own namespace.

A model is pooled whole or not at all: a group of any other kind (chunked-local or cross
attention, a state group in cache mode "none", speculative state blocks, states kept at
sub-block positions) would make a hit resume without something vLLM needs, so such a model gets
no stores and no hits (``ModelGroups.refusal``, logged once by the scheduler role). Groups vLLM
itself leaves out of hash-addressed stores (``prefix_cacheable_group_ids``) are left out here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.client.vllm.keys import GroupInfo
from kvpool.shared.keys import make_namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class ModelGroups:
    """The pool's view of one model: the groups it holds, or why it holds none."""

    groups: list[GroupInfo]
    refusal: str = ""            # non-empty: no stores and no hits for this model
    # Facts an operator should read once (e.g. a state layout shared only at one TP size).
    notes: tuple[str, ...] = field(default=())


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


def group_kind(spec: Any, hash_block_size: int | None = None) -> tuple[str, str]:
    """(kind, "") for a spec the pool can serve (kind: "full", "window" or "state"), or
    ("", why not). ``hash_block_size``: the tokens per prefix-cache hash vLLM resolved (None:
    the block size)."""
    from vllm.v1.kv_cache_interface import (AttentionSpec, ChunkedLocalAttentionSpec,
                                            CircularBufferSpec, CrossAttentionSpec,
                                            EncoderOnlyAttentionSpec, MambaSpec, RSWASpec,
                                            SlidingWindowSpec, UniformTypeKVCacheSpecs)

    name = type(spec).__name__
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {group_kind(s, hash_block_size) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else ("", f"{name} mixing {sorted(kinds)}")
    if isinstance(spec, MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            return "", (f"{name} in mamba_cache_mode={mode!r}: vLLM keeps no recurrent state at "
                        f"block boundaries, so no prefix can resume (prefix caching makes it "
                        f"'align')")
        if getattr(spec, "num_speculative_blocks", 0):
            return "", (f"{name} with {spec.num_speculative_blocks} speculative state blocks "
                        f"(speculative decoding): vLLM relocates them inside the table")
        if hash_block_size not in (None, spec.block_size):
            return "", (f"{name} with hash_block_size={hash_block_size} below its block size "
                        f"{spec.block_size}: vLLM keeps states at sub-block positions")
        return "state", ""
    if isinstance(spec, (ChunkedLocalAttentionSpec, CrossAttentionSpec,
                         EncoderOnlyAttentionSpec, CircularBufferSpec, RSWASpec)):
        return "", f"{name}: a kind of attention kvpool does not resume"
    if isinstance(spec, SlidingWindowSpec):
        return "window", ""
    if isinstance(spec, AttentionSpec):
        return "full", ""
    return "", f"{name}: a KV-cache spec kvpool does not know"


def state_identity(spec: Any, tp: int, layers: list[str]) -> tuple[str, int, str]:
    """(identity, kv_heads, note) of a state group.

    Every rank holds the whole state when ``tp_replicated``: the slot is one copy for every TP
    size (``kv_heads`` 1, TP left out of the identity). Otherwise each rank holds a slice of
    the model's channels and heads, cut per tensor (a conv state's channels concatenate the
    rank's q, k and v parts), which no single row-of-heads layout describes: such states are
    rank-sharded (``kv_heads`` 0, TP in the identity), shared only with engines of the same
    tensor-parallel size; ``note`` says so when TP > 1.
    """
    replicated = bool(getattr(spec, "tp_replicated", False))
    shapes = ";".join("x".join(map(str, s)) for s in spec.shapes)
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    mamba_type = getattr(getattr(spec, "mamba_type", None), "name", "") or "mamba"
    identity = (f"vllm-state v1|{type(spec).__name__}|{mamba_type}|bs={spec.block_size}"
                f"|shapes={shapes}|dtypes={dtypes}|conv={_conv_layout()}"
                f"|bytes={spec.state_content_size_bytes}"
                f"|tp={'all' if replicated else tp}|layers={','.join(layers)}")
    note = ""
    if not replicated and tp > 1:
        note = (f"the recurrent state of layers {layers[0]}.. is split over the "
                f"{tp} TP ranks by channel and head: it is shared only with engines of "
                f"tensor_parallel_size={tp}")
    return identity, (1 if replicated else 0), note


def _conv_layout() -> str:
    """vLLM's conv-state orientation ("SD" or "DS"): it changes a state's bytes, not its
    shape when the two dimensions are equal."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
        return str(get_conv_state_layout())
    except (ImportError, AttributeError):
        return "?"


def attention_identity(spec: Any, heads: int, window: int | None, layout: str,
                       layers: list[str]) -> str:
    return (f"vllm-kv v2|{type(spec).__name__}|bs={spec.block_size}"
            f"|kv_heads={heads}|head={spec.head_size}/{spec.head_size_v}"
            f"|dtype={spec.dtype}|quant={getattr(spec, 'kv_quant_mode', '')}"
            f"|window={window}|layout={layout}|layers={','.join(layers)}")


def pool_groups(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                extra: dict[str, Any]) -> ModelGroups:
    """The groups the pool holds for this model, or a refusal (see the module docstring).

    The identity names everything that changes the bytes of a block: model, group layers and
    spec (KV heads of the whole model, head size, dtype, window; a state's shapes and dtypes),
    block size and the resolved KV-cache layout. Not the TP size for attention: workers of
    every TP size store and load their own heads of one slot (``kvpool.shared.layout``). The
    worker's registered ``Layout`` is checked against the namespace by the daemon, so a
    disagreement is refused instead of sharing wrong bytes.
    """
    model = model_identity(vllm_config, extra)
    tp = vllm_config.parallel_config.tensor_parallel_size
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout \
        or "default"
    pooled = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    out: list[GroupInfo] = []
    notes: list[str] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        if pooled is not None and i not in pooled:
            continue        # vLLM rebuilds it after a load, or never caches it by hash
        spec = group.kv_cache_spec
        layers = list(group.layer_names)
        kind, why = group_kind(spec, hash_block_size)
        if not kind:
            return ModelGroups([], f"KV-cache group {i} ({why})")
        if kind == "state":
            identity, heads, note = state_identity(spec, tp, layers)
            window = None
            if note:
                notes.append(note)
        else:
            from vllm.v1.kv_cache_interface import SlidingWindowSpec

            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            heads = total_kv_heads(vllm_config, spec, tp)
            identity = attention_identity(spec, heads, window, layout, layers)
        fp = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        out.append(GroupInfo(index=i, namespace=make_namespace(model, fp), identity=identity,
                             block_tokens=spec.block_size, layer_names=tuple(layers),
                             sliding_window=window, kv_heads=heads, state=kind == "state"))
    sizes = sorted({g.block_tokens for g in out})
    if len(sizes) > 1:
        return ModelGroups([], f"its KV-cache groups have different block sizes {sizes}")
    align = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    if sizes and align not in (None, sizes[0]):
        return ModelGroups([], f"vLLM aligns its prefix hits to {align} tokens, not to one "
                               f"{sizes[0]}-token block")
    return ModelGroups(out, "", tuple(notes))


def build_groups(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 extra: dict[str, Any]) -> list[GroupInfo]:
    """The groups the pool holds for this model (empty when it is refused)."""
    return pool_groups(vllm_config, kv_cache_config, extra).groups
