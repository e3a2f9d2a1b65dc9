"""Headline benchmark: vLLM's real CPU engine with and without kvpool, side by side in one run.

    .venv/bin/python -m bench.engine_e2e [--out bench/results] [--quick] [--runs 3]
    .venv/bin/python -m bench.engine_e2e --lazy-check     # eager vs lazy bytes only, ~9 min a run

Needs ``.venv-engine`` (``bash .ci/install.sh``) and, for the chart, matplotlib
(``pip install -e '.[bench]'``). Runs every workload in four arms: engines with no KV connector
(``without_kvpool``), engines with the connector but no daemon behind it (``no_daemon``: what
the connector itself costs or changes in vLLM, with nothing to hit), engines on one kvpoold
(``with_kvpool``), and engines on a second kvpoold with the connector's lazy store policy
(``with_kvpool_lazy``, ``KVPOOL_STORE_POLICY=lazy``). The arms take turns within each phase,
and the whole comparison runs ``--runs`` times (3: on a 2-core machine one run moves by
~30%); every figure is the median over the runs, and each run's own figures are kept in
``per_run``. Writes ``engine-cpu-DATE.json`` and ``engine-cpu-DATE.png`` into ``--out``. The
model is a dummy-weight Llama big enough that prefill dominates (hidden 1024, 8 layers); the
first engine's own KV cache is kept small, as on a busy server (multi-turn histories are
evicted), while the second and third hold all they compute (``kv_cache_bytes_held``). Every
arm's engines compute on the same cores (``SAME_CORES``: vLLM gives an engine with any KV
connector one core more than a plain one on this machine, which made the connector arms ~1.9x
faster before).

Workloads (each with its own prompts, so none feeds another through the pool):
- multiturn: 6 conversations x 6 turns, each turn appending 256 user tokens to the history
  (and the 16 tokens the engine answered); the engine's KV holds far less than 6 histories, so
  old turns are evicted. ``multiturn_ttft_speedup`` = mean TTFT without / with kvpool.
- restart: 4 prompts of 2048 tokens, then the engine is restarted and gets them again.
  ``restart_ttft_speedup`` = mean TTFT of the second engine without / with.
- shared: a second engine, started beside the first on the same daemon, gets the prompts the
  first just ran. ``shared_ttft_speedup``.
- no repeat: 4 batches of 4 prompts of 1024 tokens never seen before, on an engine whose KV
  holds them all (nothing is preempted or evicted): kvpool can only cost here.
  ``no_repeat_throughput_ratio`` = tokens/s with / without; ``no_daemon_throughput_ratio`` =
  tokens/s of the connector with no daemon / without; ``no_repeat_vs_connector_only_ratio`` =
  tokens/s with kvpool / the connector with no daemon (what the daemon's work costs).
With kvpool, every call vLLM's scheduler makes into the connector is timed
(``KVPOOL_CONNECTOR_TIMING``): ``connector_methods`` has p50/p99 microseconds per method.
Eager against lazy: each workload of the two kvpool arms records the bytes its daemon stored
and loaded and the blocks it hit meanwhile (``stored_bytes``, ``loaded_bytes``,
``hit_blocks``), and, from the connectors' step logs, the bytes planned in steps that computed
tokens and in steps that computed nothing (``busy_stored_bytes``, ``idle_stored_bytes``).
Every measured workload also records the CPU seconds of the engine doing it (``cpu_s``), of
the engines alive beside it with nothing to do (``idle_engines_cpu_s``) and of the daemon
(``daemon_cpu_s``): an arm slower than its compute explains shows where its time went.
Lazy stores whatever is still on the GPU when the engine goes idle (its promise that the cache
survives a restart), and an offline ``LLM.generate`` leaves the engine idle after each batch,
so its total bytes in the no-repeat workload approach eager's by design; what it saves is PCIe
traffic while the engine works. ``lazy_no_repeat_bytes_ratio`` = busy bytes of lazy / eager in
the no-repeat workload (``lazy_no_repeat_all_bytes_ratio``: all bytes the daemons stored),
``lazy_multiturn_ttft_ratio`` and ``lazy_restart_ttft_ratio`` = lazy / eager mean TTFT.
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

from kvpool.client.call_timing import percentile  # noqa: E402
from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.shared.config import ClientConfig  # noqa: E402
from bench.vllm_engine.model import llama_config, write_model  # noqa: E402
from bench.vllm_engine.runner import ENGINE_PYTHON, Engine, process_cpu_s  # noqa: E402

VOCAB = 8192
TURN_TOKENS = 256
ANSWER_TOKENS = 16


def rand_prompts(n: int, tokens: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(tokens)] for _ in range(n)]


ARMS = ("without_kvpool", "no_daemon", "with_kvpool", "with_kvpool_lazy")
# vLLM's CPU workers bind their OpenMP threads to the cores it does not reserve for the
# scheduler process: one core with no KV connector, one more with any connector (meant for
# NIXL's threads; vllm/utils/ompmultiprocessing.py). On a 2-core machine that gives a plain
# engine one compute core and an engine with a connector both (nothing left to reserve), so the
# arms would compare thread counts, not kvpool: every arm gets vLLM's plain-engine default.
SAME_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
POOL_ARMS = ("with_kvpool", "with_kvpool_lazy")


class Absent:
    """The connector configured with a socket nobody listens on: zero hits by design."""

    def __init__(self, workdir: Path) -> None:
        self.socket = str(workdir / "no-kvpoold-here.sock")


class Daemon:
    def __init__(self, workdir: Path, pool_size: str, name: str = "kvpoold",
                 extra: list[str] | tuple[str, ...] = ()) -> None:
        self.socket = str(workdir / f"{name}.sock")
        self.log = open(workdir / f"{name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.daemon", "--socket", self.socket, "--pool-name",
             f"kvpool-bench-{os.getpid()}-{name}", "--pool-size", pool_size, "--cuda", "off",
             "--metrics-port", "0", "--peer-timeout-ms", "5000", *extra], stdout=self.log,
            stderr=self.log)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvpoold did not start: see {self.log.name}")
            time.sleep(0.05)
        self.client = SchedulerClient(ClientConfig(socket=self.socket, timeout_ms=10000),
                                      name="bench observer")

    def info(self) -> dict:
        i = self.client.info()
        return {"stored_blocks": i.stored_blocks, "loaded_blocks": i.loaded_blocks,
                "hit_blocks": i.hit_blocks, "evictions": i.evictions,
                "stored_bytes": i.stored_bytes, "loaded_bytes": i.loaded_bytes}

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def snapshot(daemon: "Daemon | Absent | None") -> dict | None:
    return {**daemon.info(), "t": time.time()} if isinstance(daemon, Daemon) else None


def moved(daemon: "Daemon | Absent | None", before: dict | None) -> dict:
    """What the daemon stored, loaded and hit since ``before`` (nothing without a daemon), and
    the wall-clock window (``window_s``) that ``busy_stores`` later reads the engines' logs in."""
    if before is None:
        return {}
    now = daemon.info()
    return {**{k: now[k] - before[k] for k in ("stored_bytes", "loaded_bytes", "hit_blocks")},
            "window_s": [before["t"], time.time()]}


def busy_stores(prefix: str, arm: dict, block_bytes: int) -> None:
    """Split each workload's stores into those planned in steps that computed tokens
    (``busy_stored_bytes``: what competes with the engine's work for PCIe on a GPU) and in
    steps that computed nothing (``idle_stored_bytes``: lazy's flush when the engine goes
    idle), from the connectors' step logs (``PREFIX.<pid>.store_steps.jsonl``). A step
    belongs to the workload whose window holds it; windows of one arm never overlap, and
    only one engine computes at a time."""
    steps = []
    for f in Path(prefix).parent.glob(Path(prefix).name + ".*.store_steps.jsonl"):
        steps += [json.loads(line) for line in f.read_text().splitlines() if line]
    for figures in arm.values():
        window = figures.get("window_s") if isinstance(figures, dict) else None
        if window is None:
            continue
        t0, t1 = window
        inside = [(tokens, blocks) for t, tokens, blocks in steps if t0 <= t <= t1]
        figures["busy_stored_bytes"] = block_bytes * sum(b for n, b in inside if n)
        figures["idle_stored_bytes"] = block_bytes * sum(b for n, b in inside if not n)


def cpu_snapshot(busy: Engine, idle: list[Engine], daemon: "Daemon | Absent | None") -> tuple:
    return (busy.cpu_s(), sum(e.cpu_s() for e in idle),
            process_cpu_s(daemon.proc.pid) if isinstance(daemon, Daemon) else 0.0)


def cpu_used(before: tuple, busy: Engine, idle: list[Engine],
             daemon: "Daemon | Absent | None") -> dict:
    """CPU seconds used since ``before`` by the engine doing the workload (``cpu_s``), by the
    engines alive beside it with nothing to do (``idle_engines_cpu_s``) and by the daemon
    (``daemon_cpu_s``): where an arm's wall time goes that its compute does not explain."""
    now = cpu_snapshot(busy, idle, daemon)
    return {"cpu_s": now[0] - before[0], "idle_engines_cpu_s": now[1] - before[1],
            "daemon_cpu_s": now[2] - before[2]}


def mean_ttft(step: dict) -> float:
    return statistics.fmean(t for t in step["first_token_s"] if t is not None)


def engine_settings(model: str, daemon: "Daemon | Absent | None", plan: dict,
                    kv_cache_bytes: int | None = None) -> dict:
    return {"model": model, "load_format": "dummy", "socket": daemon.socket if daemon else None,
            "kv_cache_bytes": kv_cache_bytes or plan["kv_cache_bytes"],
            "max_model_len": plan["max_model_len"],
            "max_num_batched_tokens": 2048, "max_num_seqs": 16}


def chat_phase(daemon: "Daemon | Absent | None", model: str, work: Path, plan: dict, env: dict,
               tag: str) -> dict:
    """Engine 1: the multi-turn chat, then the first pass of the restart workload."""
    warm = {"op": "generate", "prompts": plan["warmup"], "max_tokens": 2}
    turns = plan["turn_texts"]
    steps = [warm]
    for _ in turns:   # each turn depends on the last answer: the prompts come with the "go"
        steps += [{"op": "wait", "name": "turn"},
                  {"op": "generate", "prompts": [], "max_tokens": ANSWER_TOKENS}]
    steps += [{"op": "generate", "prompts": plan["restart"], "max_tokens": 1}]
    e1 = Engine(str(ENGINE_PYTHON), {**engine_settings(model, daemon, plan), "steps": steps},
                work, f"{tag}-e1", env=env)
    try:
        out = {"startup_s": e1.wait_ready()["startup_s"]}
        e1.next()                                       # warm-up
        before, cpu = snapshot(daemon), cpu_snapshot(e1, [], daemon)
        convs: list[list[int]] = [[] for _ in turns[0]]
        ttfts, walls = [], []
        for new in turns:
            prompts = [c + new[i] for i, c in enumerate(convs)]
            assert e1.next()["waiting"] == "turn"
            e1.go(prompts=prompts)
            r = e1.next()
            ttfts.extend(x for x in r["first_token_s"] if x is not None)
            walls.append(r["wall_s"])
            convs = [p + ans for p, ans in zip(prompts, r["tokens"])]
        out["multiturn"] = {"mean_ttft_s": statistics.fmean(ttfts), "turn_wall_s": walls,
                            "requests": len(ttfts), **moved(daemon, before),
                            **cpu_used(cpu, e1, [], daemon)}
        before = snapshot(daemon)
        e1.next()                                       # restart workload, first pass
        e1.finish()
        # (lazy stores what the engine still held when it went idle and shut down)
        out["restart_first_pass"] = moved(daemon, before)
    finally:
        e1.close()
    return out


def restart_phase(daemon: "Daemon | Absent | None", model: str, work: Path, plan: dict,
                  env: dict, tag: str) -> dict:
    """Engines 2 and 3, alive together: 2 is the restarted engine (the restart prompts again,
    then prompts nobody saw, then the shared prompts), 3 then gets what 2 ran last."""
    warm = {"op": "generate", "prompts": plan["warmup"], "max_tokens": 2}
    # Engines 2 and 3 hold what they compute (the restart prompts and every no-repeat batch):
    # the no-repeat workload is the one where the engine's cache holds the working set, so
    # kvpool's stores are pure cost there and the lazy policy has nothing to store while busy.
    common = engine_settings(model, daemon, plan, plan["kv_cache_bytes_held"])
    # e2 waits before each measured workload, so its window opens before its first step.
    e2 = Engine(str(ENGINE_PYTHON), {**common, "steps": [
        warm, {"op": "wait", "name": "restart"},
        {"op": "generate", "prompts": plan["restart"], "max_tokens": 1},
        {"op": "wait", "name": "no_repeat"},
        *({"op": "generate", "prompts": batch, "max_tokens": ANSWER_TOKENS}
          for batch in plan["no_repeat"]),
        {"op": "generate", "prompts": plan["shared"], "max_tokens": 1},
        {"op": "wait", "name": "end"}]},      # alive, idle, while engine 3 runs
        work, f"{tag}-e2", env=env)
    e3 = Engine(str(ENGINE_PYTHON), {**common, "steps": [
        warm, {"op": "wait", "name": "shared"},
        {"op": "generate", "prompts": plan["shared"], "max_tokens": 1}]},
        work, f"{tag}-e3", env=env)
    out: dict = {}
    try:
        e2.wait_ready()
        e3.wait_ready()
        e2.next()
        e3.next()
        assert e2.next()["waiting"] == "restart"
        before, cpu = snapshot(daemon), cpu_snapshot(e2, [e3], daemon)
        e2.go()
        r = e2.next()
        out["restart"] = {"mean_ttft_s": mean_ttft(r), "wall_s": r["wall_s"],
                          **moved(daemon, before), **cpu_used(cpu, e2, [e3], daemon)}
        assert e2.next()["waiting"] == "no_repeat"
        before, cpu = snapshot(daemon), cpu_snapshot(e2, [e3], daemon)
        e2.go()
        tokens = wall = preemptions = 0
        walls, ttfts = [], []
        for _ in plan["no_repeat"]:
            r = e2.next()
            tokens += r["prompt_tokens"] + sum(len(t) for t in r["tokens"])
            wall += r["wall_s"]
            walls.append(r["wall_s"])
            ttfts.append(mean_ttft(r))
            preemptions += r["preemptions"]
        out["no_repeat"] = {"tokens_per_s": tokens / wall, "wall_s": wall,
                            "preemptions": preemptions, "batch_wall_s": walls,
                            "batch_mean_ttft_s": ttfts, **moved(daemon, before),
                            **cpu_used(cpu, e2, [e3], daemon)}
        e2.next()                                       # the shared prompts, first engine
        assert e3.next()["waiting"] == "shared"
        before, cpu = snapshot(daemon), cpu_snapshot(e3, [e2], daemon)
        e3.go()
        r = e3.next()
        out["shared"] = {"mean_ttft_s": mean_ttft(r), "wall_s": r["wall_s"],
                         **moved(daemon, before), **cpu_used(cpu, e3, [e2], daemon)}
        assert e2.next()["waiting"] == "end"
        e2.go()
        e2.finish()
        e3.finish()
    finally:
        e2.close()
        e3.close()
    return out


def connector_timing(prefix: str) -> dict:
    samples: dict[str, list[float]] = {}
    for f in Path(prefix).parent.glob(Path(prefix).name + ".*.json"):
        for name, values in json.loads(f.read_text())["samples_us"].items():
            samples.setdefault(name, []).extend(values)
    out = {}
    for name, values in sorted(samples.items()):
        if not values:
            continue   # a method this vLLM never called (request_finished_all_groups)
        s = sorted(values)
        out[name] = {"calls": len(s), "p50_us": round(percentile(s, 0.5), 1),
                     "p99_us": round(percentile(s, 0.99), 1), "max_us": round(s[-1], 1)}
    return out


def chart(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["multi-turn chat", "warm restart", "second engine"]
    keys = ["multiturn", "restart", "shared"]
    plain = [res["without_kvpool"][k]["mean_ttft_s"] for k in keys]
    pool = [res["with_kvpool"][k]["mean_ttft_s"] for k in keys]
    absent = [res["no_daemon"][k]["mean_ttft_s"] for k in keys]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = range(len(names))
    ax.bar([i - 0.27 for i in x], plain, 0.27, label="vLLM alone")
    ax.bar(list(x), absent, 0.27, label="connector, no daemon")
    ax.bar([i + 0.27 for i in x], pool, 0.27, label="vLLM + kvpool")
    for i in x:
        ax.text(i + 0.27, pool[i], f"{plain[i] / pool[i]:.1f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("mean time to first token (s)")
    ax.legend()
    ax.set_title(f"vLLM CPU engine, Llama h1024 x 8 layers, medians of {res['runs']} runs")
    tp = [res[arm]["no_repeat"]["tokens_per_s"] for arm in ARMS]
    ax2.bar(["alone", "no daemon", "+ kvpool", "lazy"], tp, color=["C0", "C1", "C2", "C3"])
    ax2.set_title(f"no repeated prefix: {tp[2] / tp[0]:.2f}x")
    ax2.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def one_run(plan: dict, cfg: dict, run: int, arms: tuple[str, ...] = ARMS,
            phases: tuple = ()) -> dict:
    """Every phase (default: chat, then restart) in every arm once; the arms take turns within
    each phase, so a machine whose load drifts during the run drifts them alike, and which arm
    goes first turns from run to run."""
    with tempfile.TemporaryDirectory(prefix="kvpool-e2e-") as tmp:
        work = Path(tmp)
        model = write_model(str(work / "model"), cfg, weights=False)
        timing = {arm: str(work / f"timing-{arm}") for arm in POOL_ARMS}
        daemon = Daemon(work, plan["pool_size"])
        lazy = Daemon(work, plan["pool_size"], "kvpoold-lazy")
        backends = {"without_kvpool": None, "no_daemon": Absent(work), "with_kvpool": daemon,
                    "with_kvpool_lazy": lazy}
        envs = {"with_kvpool": {"KVPOOL_CONNECTOR_TIMING": timing["with_kvpool"]},
                "with_kvpool_lazy": {"KVPOOL_CONNECTOR_TIMING": timing["with_kvpool_lazy"],
                                     "KVPOOL_STORE_POLICY": "lazy"}}
        envs = {arm: {**SAME_CORES, **envs.get(arm, {})} for arm in arms}
        out: dict = {arm: {} for arm in arms}
        try:
            for phase in phases or (chat_phase, restart_phase):
                # Every arm runs the CPU backend's one KV layout (LBHNC): vllm-cpu 0.32 refuses
                # VLLM_KV_CACHE_LAYOUT=BLHNC, and keeps LBHNC when the connector asks for it.
                # The arms' order turns with the run, so no arm always runs first. (The
                # no-daemon arm once ran no-repeat 1.6-1.9x faster than plain: not its place
                # but its cores, see SAME_CORES.)
                turn = run % len(arms)
                for arm in arms[turn:] + arms[:turn]:
                    out[arm].update(phase(backends[arm], model, work, plan, envs[arm],
                                          f"{arm}-{run}"))
            for arm in POOL_ARMS:
                out[arm]["daemon"] = backends[arm].info()
        finally:
            daemon.stop()
            lazy.stop()
        for arm in POOL_ARMS:
            busy_stores(timing[arm], out[arm], plan["block_bytes"])
        # The method latencies are the eager arm's (the headline's configuration).
        out["connector_methods"] = methods = connector_timing(timing["with_kvpool"])
        out["connector_method_p99_us"] = max((m["p99_us"] for m in methods.values()),
                                             default=0.0)
    return out


def headline(arms: dict) -> dict:
    """The ratios of one run's (or the medians') figures."""
    plain, pool, absent = arms["without_kvpool"], arms["with_kvpool"], arms["no_daemon"]
    lazy = arms["with_kvpool_lazy"]
    return {
        "multiturn_ttft_speedup": plain["multiturn"]["mean_ttft_s"]
        / pool["multiturn"]["mean_ttft_s"],
        "restart_ttft_speedup": plain["restart"]["mean_ttft_s"] / pool["restart"]["mean_ttft_s"],
        "shared_ttft_speedup": plain["shared"]["mean_ttft_s"] / pool["shared"]["mean_ttft_s"],
        "no_repeat_throughput_ratio": pool["no_repeat"]["tokens_per_s"]
        / plain["no_repeat"]["tokens_per_s"],
        "no_daemon_throughput_ratio": absent["no_repeat"]["tokens_per_s"]
        / plain["no_repeat"]["tokens_per_s"],
        "no_repeat_vs_connector_only_ratio": pool["no_repeat"]["tokens_per_s"]
        / absent["no_repeat"]["tokens_per_s"],
        "no_daemon_multiturn_ttft_ratio": absent["multiturn"]["mean_ttft_s"]
        / plain["multiturn"]["mean_ttft_s"],
        "lazy_no_repeat_bytes_ratio": lazy["no_repeat"]["busy_stored_bytes"]
        / max(1, pool["no_repeat"]["busy_stored_bytes"]),
        "lazy_no_repeat_all_bytes_ratio": lazy["no_repeat"]["stored_bytes"]
        / max(1, pool["no_repeat"]["stored_bytes"]),
        "lazy_multiturn_ttft_ratio": lazy["multiturn"]["mean_ttft_s"]
        / pool["multiturn"]["mean_ttft_s"],
        "lazy_restart_ttft_ratio": lazy["restart"]["mean_ttft_s"]
        / pool["restart"]["mean_ttft_s"],
    }


def median_of(runs: list[dict], arm: str) -> dict:
    """Per workload, the median of each scalar figure of ``arm`` over the runs."""
    out: dict = {}
    for workload in ("multiturn", "restart_first_pass", "restart", "shared", "no_repeat"):
        figures = [r[arm][workload] for r in runs]
        out[workload] = {k: statistics.median(f[k] for f in figures)
                         for k, v in figures[0].items() if isinstance(v, (int, float))}
    if arm in POOL_ARMS:
        out["daemon"] = [r[arm]["daemon"] for r in runs]
    return out


def summarize(runs: list[dict], plan: dict, cfg: dict, quick: bool, planned_runs: int,
              elapsed_s: float) -> dict:
    """The result file: medians over the runs done so far, and each run's own figures."""
    arms = {arm: median_of(runs, arm) for arm in ARMS}
    return {
        "benchmark": "engine_e2e", "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor()},
        "engine": "vllm-cpu 0.32.0", "model": {k: cfg[k] for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")},
        "engine_kv_cache_bytes": plan["kv_cache_bytes"],
        "engine_kv_cache_bytes_held": plan["kv_cache_bytes_held"], "quick": quick,
        "runs": len(runs), "runs_planned": planned_runs,
        **headline(arms),
        "connector_method_p99_us": statistics.median(r["connector_method_p99_us"]
                                                     for r in runs),
        **arms,
        "per_run": [{**headline(r), "connector_method_p99_us": r["connector_method_p99_us"],
                     "connector_methods": r["connector_methods"]} for r in runs],
        "elapsed_s": elapsed_s,
    }


def lazy_check(plan: dict, cfg: dict, path: Path, t0: float, runs: int) -> None:
    """``--lazy-check``: the no-repeat workload's stores, eager against lazy, on engines that
    hold it (the restart phase of the two kvpool arms, without the chat phase before it),
    ``runs`` times; the ratios are medians over the runs."""
    per_run: list[dict] = []
    for run in range(runs):
        r = one_run(plan, cfg, run, arms=POOL_ARMS, phases=(restart_phase,))
        eager, lazy = r["with_kvpool"]["no_repeat"], r["with_kvpool_lazy"]["no_repeat"]
        per_run.append({
            "lazy_no_repeat_bytes_ratio": lazy["busy_stored_bytes"]
            / max(1, eager["busy_stored_bytes"]),
            "lazy_no_repeat_all_bytes_ratio": lazy["stored_bytes"]
            / max(1, eager["stored_bytes"]),
            "with_kvpool": r["with_kvpool"], "with_kvpool_lazy": r["with_kvpool_lazy"]})
        ratios = {k: statistics.median(x[k] for x in per_run)
                  for k in ("lazy_no_repeat_bytes_ratio", "lazy_no_repeat_all_bytes_ratio")}
        res = {"benchmark": "engine_e2e --lazy-check",
               "date": datetime.date.today().isoformat(),
               "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "engine": "vllm-cpu 0.32.0",
               "engine_kv_cache_bytes_held": plan["kv_cache_bytes_held"],
               "runs": len(per_run), "runs_planned": runs, **ratios, "per_run": per_run,
               "elapsed_s": time.time() - t0}
        # Written after every run, as the campaign's JSON is.
        path.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({"run": run + 1, **{k: v for k, v in per_run[-1].items()
                                              if k.endswith("ratio")}}), flush=True)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true",
                    help="a small model and few prompts: checks the script, measures nothing")
    ap.add_argument("--runs", type=int, default=3,
                    help="times the whole comparison runs; figures are medians over them")
    ap.add_argument("--shared-vs-split", action="store_true",
                    help="only the shared-vs-split workload (bench/engine_shared_split.py): two "
                         "engines on one pool of M against two pools of M/2, --runs times")
    ap.add_argument("--lazy-check", action="store_true",
                    help="only engines 2 and 3 of the two kvpool arms, --runs times (no chat "
                         "phase, so the restart loads nothing): lazy_no_repeat_bytes_ratio in "
                         "about 9 minutes a run")
    args = ap.parse_args()
    if not ENGINE_PYTHON.exists():
        raise SystemExit(f"{ENGINE_PYTHON} missing: run `bash .ci/install.sh` first")
    quick = args.quick
    if args.shared_vs_split:
        from bench.engine_shared_split import campaign
        stem = f"engine-cpu-{datetime.date.today().isoformat()}-shared-split"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = campaign(out / f"{stem}{'-quick' if quick else ''}.json", args.runs, quick,
                       Daemon, SAME_CORES, VOCAB)
        print(json.dumps({k: v for k, v in res.items() if k.endswith(("ratio", "speedup"))}))
        return
    rng = random.Random(0)
    # Sized so that a run (four arms, every one on one core) takes about half an hour on a
    # 2-core machine and three fit beside the rest of a working session (8 conversations, 8
    # restart prompts and 6 no-repeat batches took 45-50 minutes a run).
    n_conv, n_turns = (2, 2) if quick else (6, 6)
    restart_len, n_restart = (256, 2) if quick else (2048, 4)
    plan = {
        "pool_size": "4GiB",
        "max_model_len": 4096,
        "warmup": rand_prompts(2, 64, rng),
        "turn_texts": [rand_prompts(n_conv, TURN_TOKENS, rng) for _ in range(n_turns)],
        "restart": rand_prompts(n_restart, restart_len, rng),
        "shared": rand_prompts(n_restart, restart_len, rng),
        # Batches that fit the engine's KV (no preemption, which kvpool would make cheaper):
        # this workload measures only what kvpool costs.
        "no_repeat": [rand_prompts(4, 256 if quick else 1024, rng)
                      for _ in range(2 if quick else 4)],
    }
    hidden, layers = (256, 2) if quick else (1024, 8)
    heads = hidden // 64     # head_dim 64: one the CPU attention kernels take
    cfg = llama_config(hidden, layers, heads=heads, kv_heads=heads // 2, vocab=VOCAB,
                       intermediate=hidden * 11 // 4)
    kv_per_block = 2 * layers * (heads // 2) * 64 * 4 * 128   # K and V, fp32, 128 tokens
    # The engine's own KV: 40 blocks (5120 tokens), a fraction of the 6 x ~1.7k-token histories.
    plan["kv_cache_bytes"] = 40 * kv_per_block
    # Engines 2 and 3: the restart prompts and all the no-repeat batches, with room to spare.
    held_tokens = sum(len(p) + ANSWER_TOKENS for p in plan["restart"]) \
        + sum(len(p) + ANSWER_TOKENS for batch in plan["no_repeat"] for p in batch)
    # (+48: past the reach of a step, within which lazy stores what the next one may evict)
    plan["kv_cache_bytes_held"] = (held_tokens // 128 + 48) * kv_per_block
    plan["block_bytes"] = kv_per_block
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"engine-cpu-{datetime.date.today().isoformat()}" + ("-quick" if quick else "")
    runs: list[dict] = []
    t0 = time.time()
    if args.lazy_check:
        lazy_check(plan, cfg, out / f"{stem}-lazy-check.json", t0, args.runs)
        return
    for run in range(args.runs):
        runs.append(one_run(plan, cfg, run))
        print(json.dumps({"run": run + 1, **headline(runs[-1])}), flush=True)
        # Written after every run: a long campaign cut short keeps what it measured.
        res = summarize(runs, plan, cfg, quick, args.runs, time.time() - t0)
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"medians": {k: v for k, v in res.items()
                                  if k.endswith(("speedup", "ratio"))}}))
    try:
        chart(res, out / f"{stem}.png")
    except ImportError:
        print("matplotlib missing: no chart (pip install -e '.[bench]')")
    print(f"wrote {out / stem}.json")


if __name__ == "__main__":
    main()
