"""Which KV-cache groups of a model the pool holds, their namespaces, and the models it refuses
whole (``client/vllm/groups.py``), on vLLM's own spec classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec,  # noqa: E402
                                        FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)

from kvpool.client.vllm.groups import build_groups, pool_groups  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16


def config(specs, tp: int = 1, model: str = "m", heads: int = 8, **kv):
    mc = SimpleNamespace(model=model, revision=None, get_total_num_kv_heads=lambda: heads)
    cfg = SimpleNamespace(model_config=mc,
                          parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                          cache_config=SimpleNamespace(kv_cache_layout=None))
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"]) for i, s in
              enumerate(specs)]
    return cfg, SimpleNamespace(kv_cache_layout="LBNHC", kv_cache_groups=groups, **kv)


def full(heads: int = 4, bs: int = BS, head: int = 64):
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head,
                             dtype=torch.float16)


def window(w: int = 32):
    return SlidingWindowSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.float16,
                             sliding_window=w)


def state(mode: str = "align", bs: int = BS, **kw):
    return MambaSpec(block_size=bs, shapes=((3, 128), (4, 16, 16)),
                     dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode, **kw)


def test_attention_namespaces_are_those_pools_already_hold():
    # Computed by the connector before state groups existed (main 0768353): an engine upgraded
    # across this change keeps hitting what it stored.
    cfg, kv = config([full(), window()], tp=2)
    assert [g.namespace.hex() for g in build_groups(cfg, kv, {})] == [
        "52dcedd0cb7924b870ae5e91418d725f", "f406ef4784a7a847c65f2cf56b3fb524"]


def test_a_hybrid_model_pools_every_group_each_in_its_namespace():
    cfg, kv = config([full(), window(), state()])
    model = pool_groups(cfg, kv, {})
    assert model.refusal == "" and model.notes == ()
    assert [g.kind for g in model.groups] == ["full", "window", "state"]
    assert [g.index for g in model.groups] == [0, 1, 2]
    assert len({g.namespace for g in model.groups}) == 3
    s = model.groups[2]
    assert s.state and s.kv_heads == 0 and s.window_blocks is None
    assert "shapes=3x128;4x16x16" in s.identity and "dtypes=bfloat16,float32" in s.identity


def test_state_namespaces_follow_what_changes_the_bytes():
    def ns(spec, tp=1, model="m"):
        return pool_groups(*config([full(heads=max(1, 8 // tp)), spec], tp=tp, model=model),
                           {}).groups[1].namespace

    base = ns(state())
    assert ns(state(), model="other") != base
    other_shape = MambaSpec(block_size=BS, shapes=((3, 64), (4, 16, 16)),
                            dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align")
    assert ns(other_shape) != base
    other_dtype = MambaSpec(block_size=BS, shapes=((3, 128), (4, 16, 16)),
                            dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="align")
    assert ns(other_dtype) != base


def test_a_state_split_over_ranks_is_shared_at_one_tp_size_and_says_so():
    tp1 = pool_groups(*config([full(heads=8), state()], tp=1), {})
    tp2 = pool_groups(*config([full(heads=4), state()], tp=2), {})
    assert tp1.groups[0].namespace == tp2.groups[0].namespace      # attention: TP-agnostic
    assert tp1.groups[1].namespace != tp2.groups[1].namespace
    assert tp2.groups[1].kv_heads == 0 and tp1.notes == ()
    assert len(tp2.notes) == 1 and "tensor_parallel_size=2" in tp2.notes[0]


def test_a_state_every_rank_holds_whole_is_shared_at_every_tp_size():
    groups = [pool_groups(*config([full(heads=8 // tp), state(tp_replicated=True)], tp=tp),
                          {}) for tp in (1, 2, 4)]
    assert {m.groups[1].namespace for m in groups} == {groups[0].groups[1].namespace}
    assert all(m.groups[1].kv_heads == 1 and not m.notes for m in groups)


@pytest.mark.parametrize("specs, why", [
    ([full(), state(mode="none")], "mamba_cache_mode='none'"),
    ([full(), state(num_speculative_blocks=1)], "speculative"),
    ([full(), ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=4, head_size=64,
                                        dtype=torch.float16, attention_chunk_size=64)],
     "ChunkedLocalAttentionSpec"),
    ([full(), state(bs=32)], "different block sizes [16, 32]"),
])
def test_a_model_with_a_group_the_pool_cannot_resume_is_refused_whole(specs, why):
    model = pool_groups(*config(specs), {})
    assert model.groups == [] and why in model.refusal, model.refusal


def test_states_kept_below_a_block_or_hits_aligned_past_one_are_refused():
    model = pool_groups(*config([full(), state()], hash_block_size=8), {})
    assert model.groups == [] and "hash_block_size=8" in model.refusal
    model = pool_groups(*config([full(), state()], cache_hit_alignment_tokens=32), {})
    assert model.groups == [] and "aligns its prefix hits to 32" in model.refusal


def test_groups_vllm_leaves_out_of_hash_addressed_stores_are_left_out():
    cfg, kv = config([full(), state(mode="none")], prefix_cacheable_group_ids=(0,))
    model = pool_groups(cfg, kv, {})
    assert model.refusal == "" and [g.index for g in model.groups] == [0]


def test_tp_cross_namespace_leaves_tp_out_and_nothing_else():
    """TP 1, 2, 4 and 8 of one model are one namespace (their ranks share head-split slots);
    the model, the head size and the total KV heads still tell namespaces apart. With fewer
    KV heads than ranks (replicated) and for MLA the total is what the model has."""

    def groups(tp: int, model: str = "m", head: int = 64, heads: int = 8, mla: bool = False):
        if mla:
            spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                                    dtype=torch.float16)
        else:
            spec = full(heads=max(1, heads // tp), head=head)
        return build_groups(*config([spec], tp=tp, model=model, heads=heads), {})[0]

    one = groups(1)
    assert one.kv_heads == 8 and "tp=" not in one.identity
    assert {groups(tp).namespace for tp in (1, 2, 4, 8)} == {one.namespace}
    assert groups(1, model="other").namespace != one.namespace
    assert groups(2, head=128).namespace != one.namespace
    assert groups(2, heads=4).namespace != one.namespace
    gqa = [groups(tp, heads=2) for tp in (1, 2, 4, 8)]       # 2 KV heads, replicated past TP=2
    assert {g.kv_heads for g in gqa} == {2} and len({g.namespace for g in gqa}) == 1
    mla = [groups(tp, heads=128, mla=True) for tp in (1, 2, 8)]
    assert {g.kv_heads for g in mla} == {1} and len({g.namespace for g in mla}) == 1
