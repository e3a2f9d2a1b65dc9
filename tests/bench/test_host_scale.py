"""bench/host_scale.py at CI scale: two host-path engines through one real kvpoold for half a
second per phase, the limit, lookups and a P/D hand-off beside them, and the JSON the GPU runs
are read from holding every key of issue 28 with usable values. (Two cores show no scaling: this
checks the flow and the report, not the figures.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The keys for the largest N, at the top level of the JSON.
KEYS = ("engines", "aggregate_store_ratio", "aggregate_load_ratio", "aggregate_bidir_ratio",
        "gemm_slowdown_max", "lookup_p99_us", "daemon_cpu_s_per_GB",
        "daemon_busiest_thread_util", "daemon_busiest_thread_util_per_phase")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_two_host_engines_through_one_daemon_report_every_key(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.host_scale", "--host", "--engines", "2",
           "--quick", "--layouts", "block_outer", "--seconds", "0.5", "--lookups", "50",
           "--pd-reps", "1", "--blocks", "32", "--per-job", "8", "--out", str(out),
           "--tmp", str(tmp_path / "run")]
    # Bounded: engines and the daemon are child processes the script stops on every path.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = out.glob("host-scale-*.json")
    res = json.loads(path.read_text())
    assert set(KEYS) <= set(res), set(KEYS) - set(res)
    assert res["engines"] == 2 and res["mode"] == "host"
    for k in ("aggregate_store_ratio", "aggregate_load_ratio", "aggregate_bidir_ratio",
              "lookup_p99_us", "daemon_cpu_s_per_GB"):
        assert _positive(res[k]), (k, res[k])
    assert res["gemm_slowdown_max"] is None, "no GEMM without a GPU"
    run = res["runs"]["2"]
    for d in ("store", "load", "bidir"):
        assert _positive(run["limit"][f"{d}_GBps"]), run["limit"]
        phase = run["layouts"]["block_outer"][d]
        # every engine moved bytes: none of them was starved out of the run
        assert len(phase["per_engine_GBps"]) == 2 and all(x > 0 for x in phase["per_engine_GBps"])
        assert phase["daemon_cpu_s"] > 0
    assert run["lookup"]["clients"] == 2 and run["lookup"]["p50_us"] <= run["lookup"]["p99_us"]
    assert run["lookup"]["lookups_short_of_all_keys"] == 0 and run["lookup"]["during_offload"]
    # issue 36: timed on a pool already full (its stores evict), a share of it leased by the
    # blocks the loads read; per phase, the busiest daemon thread's share of a core
    pool = run["layouts"]["block_outer"]["pool"]
    assert pool["is_full"] and pool["evictions_while_filling"] > 0, pool
    assert 0 < pool["leased_share"] < 1 and res["pool_full_before_timing"]
    assert set(res["daemon_busiest_thread_util_per_phase"]) == {"store", "load", "bidir"}
    assert all(0 < u for u in res["daemon_busiest_thread_util_per_phase"].values())
    assert run["numa_placement"]["mode"] in ("off", "interleave", "local"), run["numa_placement"]
    assert run["loop_cpu"] == -1, "the daemon's loop pinned without loop_cpu set"
    assert _positive(run["pd"]["alone_GBps"])
    assert (out / f"{path.stem}.png").exists() or "png_note" in res
