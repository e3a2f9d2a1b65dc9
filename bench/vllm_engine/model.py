"""A tiny Llama for the real-engine tests and the benchmark: ``config.json`` and, optionally,
seeded random weights.

    python -m bench.vllm_engine.model DIR [--weights] [--hidden H --layers L ...]

vLLM's ``load_format="dummy"`` fills weights with uniform(-1e-3, 1e-3): every logit is ~1e-5
and the KV cache moves a logprob by less than float32 can show, so a test that compares outputs
would pass with garbage in the KV cache. With ``--weights`` the model gets well-scaled random
weights (normal with std 1/sqrt(fan_in), unit norms; a few MB as safetensors) whose outputs
depend on every cached key and value. Writes into a temporary folder and renames it, so engines
started side by side never see half a model. Needs torch and safetensors (the engine venv).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Callable


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int,
                 intermediate: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": intermediate,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers, "head_dim": hidden // heads, "vocab_size": vocab,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
            "tie_word_embeddings": False}


def random_weights(cfg: dict, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, ff = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, \
        cfg["intermediate_size"]

    def lin(out_f: int, in_f: int):
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    w = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g),
         "model.norm.weight": torch.ones(h), "lm_head.weight": lin(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": lin(q, h), p + "self_attn.k_proj.weight": lin(kv, h),
                  p + "self_attn.v_proj.weight": lin(kv, h), p + "self_attn.o_proj.weight": lin(h, q),
                  p + "mlp.gate_proj.weight": lin(ff, h), p + "mlp.up_proj.weight": lin(ff, h),
                  p + "mlp.down_proj.weight": lin(h, ff),
                  p + "input_layernorm.weight": torch.ones(h),
                  p + "post_attention_layernorm.weight": torch.ones(h)})
    return w


def write_model(path: str, cfg: dict, weights: bool | Callable[[dict], dict],
                seed: int = 0) -> str:
    """Create the model folder at ``path`` unless it exists; returns ``path``. ``weights``:
    True for ``random_weights`` (a Llama), or a function of the config giving the tensors."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".model-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    if weights:
        from safetensors.torch import save_file

        tensors = weights(cfg) if callable(weights) else random_weights(cfg, seed)
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
    try:
        os.rename(tmp, path)
    except OSError:   # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--weights", action="store_true")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = llama_config(a.hidden, a.layers, a.heads, a.kv_heads, a.vocab, a.intermediate)
    print(write_model(a.path, cfg, a.weights, a.seed))


if __name__ == "__main__":
    main()
