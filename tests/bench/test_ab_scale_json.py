"""bench/ab_scale_json.py: one results JSON from an ab-scale call's runs, in the order they
ran, with each tree's medians and the loop's CPU per GB."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.ab_scale_json import medians, runs_of

ROOT = Path(__file__).resolve().parents[2]


def _result(store_gbps: float, loop: float, loop_cpu: int) -> dict:
    """A host_scale result of one engine count and layout, as host_scale writes it."""
    phase = {"GBps": store_gbps, "daemon_loop_util": loop, "daemon_busiest_thread_util": loop}
    return {"runs": {"2": {"loop_cpu": loop_cpu, "layouts": {"block_outer": {
        "store": phase, "load": phase, "bidir": phase,
        "store_ratio": 0.97, "load_ratio": 0.98, "bidir_ratio": 0.96}}}}}


def _write_runs(root: Path) -> None:
    # (directory, store GB/s, loop util): new, old, new, old as run.sh names them; the new
    # runs with the loop on CPU 1 (AB_NEW_ENV=KVPOOL_LOOP_CPU=1)
    for name, gbps, loop in [("new-5", 100.0, 0.5), ("old-70", 100.0, 0.6),
                             ("new-133", 100.0, 0.4), ("old-201", 50.0, 0.4)]:
        (root / name).mkdir()
        (root / name / "host-scale-x.json").write_text(
            json.dumps(_result(gbps, loop, 1 if name.startswith("new") else -1)))
    (root / "new-260").mkdir()          # a run that wrote nothing: left out


def test_runs_keep_their_order_and_the_loop_cpu_per_gb(tmp_path):
    _write_runs(tmp_path)
    runs = runs_of(tmp_path)
    assert [(r["run"], r["tree"]) for r in runs] == [(1, "new"), (2, "old"), (3, "new"),
                                                     (4, "old")]
    assert [r["store"]["loop_ms_per_GB"] for r in runs] == [5.0, 6.0, 4.0, 8.0]
    assert runs[0]["store"]["ratio"] == 0.97
    assert [r["loop_cpu"] for r in runs] == [1, -1, 1, -1]
    m = medians(runs)
    assert m["new"]["2/block_outer"]["store"]["loop_ms_per_GB"] == 4.5
    assert m["old"]["2/block_outer"]["store"]["loop_ms_per_GB"] == 7.0


def test_the_tool_reads_the_calls_archive_and_writes_one_json(tmp_path):
    runs = tmp_path / "ab-scale"
    runs.mkdir()
    _write_runs(runs)
    tgz = tmp_path / "ab-scale.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(runs, arcname=".")
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, "-m", "bench.ab_scale_json", str(tgz), "--new", "a1",
                        "--old", "b2", "--device", "test", "--command", "run.sh ab-scale",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert (doc["new"], doc["old"], doc["order"]) == ("a1", "b2", "new old new old")
    assert len(doc["runs"]) == 4 and set(doc["medians"]) == {"new", "old"}


def test_an_archive_with_no_results_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "bench.ab_scale_json", str(empty), "--new", "a",
                        "--old", "b", "--device", "d", "--command", "c", "--out",
                        str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "no host_scale results" in r.stderr
