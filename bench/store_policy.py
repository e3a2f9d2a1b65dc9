"""Bytes the eager and lazy store policies move per engine step, on a GPU.

Two halves, because the GPU machine has no vLLM and the CPU machine has no GPU:

``--trace``  (CPU, the dev venv with vLLM 0.33): vLLM's real scheduler with fake workers
             (``bench/vllm_scheduler.py``) runs each workload under ``store_policy`` eager and
             lazy against a real kvpoold; every step's store and load block ids are recorded
             from the connector's metadata, with whether the step computed anything. Writes
             ``bench/store_policy_trace.json`` (committed, so the GPU half needs nothing else).
``--replay`` (GPU): a real kvpoold and a worker process owning Llama-3.1-8B-shaped KV on the
             GPU (2 MiB blocks, per-layer layout) replay each trace step by step: the step's
             store and load jobs are submitted together and timed to their completions. Beside
             them, the contiguous pinned memcpy limit of the same run, so each step's copy time
             reads against what the link can do.

Workloads (16-token blocks, the harness's scheduler settings):
- ``no_repeat``: 48 distinct 8-block prompts, 8 at a time, in a 512-block GPU cache that holds
  all of them (the case where lazy should move next to nothing while the engine computes);
- ``multi_turn``: 8 conversations x 4 turns, each turn its conversation so far plus 3 new
  blocks (96 blocks in all), queued at once in turn order, in a 64-block cache running 4 at a
  time: later turns evict earlier ones, so lazy stores before evictions and both policies load
  prefixes back, with no idle step in between.
Lazy's idle flush (every block the GPU still holds, stored when the engine has nothing to
compute) lands in steps that computed nothing; the figures keep busy and idle steps apart.

Run: ``.venv/bin/python -m bench.store_policy --trace`` (CPU, ~1 min), then on a GPU
``bash tests/gpu/run.sh policy`` (writes ``store-policy-<device>-<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRACE = ROOT / "bench" / "store_policy_trace.json"
POLICIES = ("eager", "lazy")
CONVERSATIONS = 12
BLOCK_BYTES = 2 << 20      # a 16-token block of Llama-3.1-8B, bf16, all 32 layers


def _workloads(BS: int) -> dict:
    def prompt(blocks: int, start: int) -> list[int]:
        return list(range(start, start + blocks * BS + 1))

    no_repeat = [[(f"n{i}", prompt(8, 1000 * (i + 1)), 16)] for i in range(48)]
    # Turn t of conversation c: its first 3*(t+1) blocks (what it said so far) + 1 token. All
    # turns queue at once, in turn order, so the engine never idles between them.
    turns = [(f"c{c}t{t}", prompt(6 * (t + 1), 100_000 * (c + 1)), 8)
             for t in range(4) for c in range(CONVERSATIONS)]
    return {
        "no_repeat": dict(num_blocks=512, max_num_seqs=8, waves=[sum(no_repeat, [])]),
        "multi_turn": dict(num_blocks=64, max_num_seqs=2, waves=[turns]),
    }


def trace() -> dict:
    from bench.kvtest import DaemonProcess
    from bench.vllm_scheduler import BS, Engine
    from kvpool.client.scheduler import SchedulerClient

    out: dict = {"block_tokens": BS, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, w in _workloads(BS).items():
            for policy in POLICIES:
                d = DaemonProcess(root / f"{name}-{policy}", "256MiB")
                (root / f"{name}-{policy}").mkdir()
                d.start()
                observer = SchedulerClient(d.client_config(), name="trace observer")
                e = Engine(root, d.socket, async_scheduling=False, num_blocks=w["num_blocks"],
                           max_num_batched_tokens=256, max_num_seqs=w["max_num_seqs"],
                           extra={"store_policy": policy})
                steps: list[dict] = []
                execute = e._execute

                def recorded(so, execute=execute, steps=steps):
                    meta = so.kv_connector_metadata
                    steps.append({
                        "tokens": so.total_num_scheduled_tokens,
                        "store": [b for s in meta.stores for b in s.block_ids],
                        "load": [b for s in meta.loads if s.slots for b in s.block_ids]})
                    return execute(so)
                e._execute = recorded
                try:
                    for wave in w["waves"]:
                        for rid, p, n in wave:
                            e.add(rid, p, max_tokens=n)
                        e.run(timeout_s=300)
                    # Idle steps until every store has landed (lazy's flush comes here).
                    role = e.connector.scheduler
                    deadline = time.monotonic() + 60
                    while (role.lazy is not None and (role.lazy.num_pending or
                                                      role.lazy.num_in_flight)
                           or role.batches.by_id):
                        assert time.monotonic() < deadline, "stores did not settle"
                        e.step()
                    info = observer.info()
                    out["workloads"].setdefault(name, {})[policy] = {
                        "num_blocks": w["num_blocks"], "steps": steps,
                        "daemon_stored_blocks": info.stored_blocks,
                        "daemon_loaded_blocks": info.loaded_blocks,
                        "verified_loaded_blocks": e.workers[0].verified_blocks,
                        "lost_blocks": role.losses.total,
                        "lazy_dropped": dict(role.lazy.dropped) if role.lazy else {}}
                    print(f"{name} {policy}: {len(steps)} steps, stored {info.stored_blocks}, "
                          f"loaded {info.loaded_blocks}", flush=True)
                finally:
                    e.close()
                    observer.close()
                    d.cleanup()
    return out


def summarize(steps: list[dict], step_s: list[float] | None = None) -> dict:
    busy = [s for s in steps if s["tokens"]]
    idle = [s for s in steps if not s["tokens"]]
    busy_bytes = [(len(s["store"]) + len(s["load"])) * BLOCK_BYTES for s in busy]
    res = {
        "busy_steps": len(busy), "idle_steps": len(idle),
        "stored_blocks_busy": sum(len(s["store"]) for s in busy),
        "stored_blocks_idle": sum(len(s["store"]) for s in idle),
        "loaded_blocks": sum(len(s["load"]) for s in steps),
        "bytes_per_busy_step_mean": statistics.fmean(busy_bytes) if busy else 0.0,
        "bytes_per_busy_step_max": max(busy_bytes, default=0),
        "store_bytes_per_busy_step_mean": (statistics.fmean(len(s["store"]) * BLOCK_BYTES
                                                            for s in busy) if busy else 0.0),
    }
    if step_s is not None:
        moving = [(t, (len(s["store"]) + len(s["load"])) * BLOCK_BYTES)
                  for s, t in zip(steps, step_s) if s["store"] or s["load"]]
        busy_moving = [t for s, t in zip(steps, step_s) if s["tokens"] and (s["store"] or s["load"])]
        res["copy_ms_per_busy_step_mean"] = (1e3 * sum(busy_moving) / len(busy) if busy else 0.0)
        res["copy_ms_busy_steps_that_move_p50"] = (1e3 * statistics.median(busy_moving)
                                                   if busy_moving else 0.0)
        res["GBps_over_moving_steps"] = (sum(b for _, b in moving) / sum(t for t, _ in moving) / 1e9
                                         if moving else 0.0)
    return res


def replay(out_dir: Path) -> dict:
    import torch

    from bench.gpu_transfer import device_name, memcpy_limits, start_daemon
    from bench.gpu_worker import Worker

    data = json.loads(TRACE.read_text())
    res: dict = {"device": device_name(), "date": dt.date.today().isoformat(),
                 "command": "bash tests/gpu/run.sh policy", "block_bytes": BLOCK_BYTES,
                 "trace": str(TRACE.relative_to(ROOT)), "workloads": {}}
    res["memcpy_limit_GBps"] = memcpy_limits(256 * BLOCK_BYTES, reps=5)
    with tempfile.TemporaryDirectory() as tmp:
        for name, per_policy in data["workloads"].items():
            for policy, tr in per_policy.items():
                steps = tr["steps"]
                stored = sum(len(s["store"]) for s in steps)
                pool = f"{max(1, (stored + 64) * BLOCK_BYTES >> 30) + 1}GiB"
                daemon, sock = start_daemon(Path(tmp), pool, tag=f"{name}-{policy}")
                worker = Worker(0, "per_layer", tr["num_blocks"])
                try:
                    worker.call("fill", 1)
                    worker.call("connect", sock, f"policy-{name}"[:16].encode().ljust(16, b"-"),
                                0, 1)
                    # The pool written through once first (its pages' first touch, and the copy
                    # kernel's first launch, would be charged to the trace's first steps): the
                    # replay's own stores then evict these blocks, as a warm cache would.
                    gib = int(pool[:-3])
                    n = min(64, tr["num_blocks"])    # (the bench pins its last batch)
                    t0 = time.perf_counter()
                    for _ in range(-(-(gib << 30) // (n * BLOCK_BYTES))):
                        worker.call("bench", "store", list(range(n)))
                    first_touch_GBps = (gib << 30) / (time.perf_counter() - t0) / 1e9
                    worker.call("bench", "load", list(range(8)))
                    step_s = worker.call("bench", "replay",
                                         [(s["store"], s["load"]) for s in steps], timeout_s=600)
                finally:
                    worker.close()
                    daemon.terminate()
                    daemon.wait(30)
                summary = summarize(steps, step_s)
                summary["pool_first_touch_GBps"] = first_touch_GBps
                summary.update({k: tr[k] for k in ("daemon_stored_blocks", "verified_loaded_blocks",
                                                  "lost_blocks", "lazy_dropped") if k in tr})
                res["workloads"].setdefault(name, {})[policy] = summary
                print(name, policy, json.dumps(summary), flush=True)
        torch.cuda.synchronize()
    for name, pol in res["workloads"].items():
        e, lz = pol["eager"], pol["lazy"]
        res[f"{name}_lazy_over_eager_busy_bytes"] = (
            lz["bytes_per_busy_step_mean"] / e["bytes_per_busy_step_mean"]
            if e["bytes_per_busy_step_mean"] else None)
    path = out_dir / f"store-policy-{res['device'].replace(' ', '_')}-{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="store_true", help="record the traces (CPU, needs vLLM)")
    ap.add_argument("--replay", action="store_true", help="replay them on a GPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.trace:
        t = trace()
        TRACE.write_text(json.dumps(t, separators=(",", ":")))
        for name, pol in t["workloads"].items():
            for policy, tr in pol.items():
                print(name, policy, json.dumps(summarize(tr["steps"])))
    if args.replay:
        replay(Path(args.out))
    if not (args.trace or args.replay):
        ap.error("--trace and/or --replay")


if __name__ == "__main__":
    main()
