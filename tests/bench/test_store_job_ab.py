"""bench/investigations/store_job_ab.py times one store job under two trees, a worker each,
job by job: both workers run on a full pool and answer every job, a setting for the new one
reaches it alone, and a tree that cannot run says so."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CMD = [sys.executable, "-m", "bench.investigations.store_job_ab"]


def test_both_trees_time_every_job_on_a_full_pool(tmp_path):
    out = subprocess.run(CMD + [str(ROOT), str(ROOT), "--jobs", "6", "--slots", "16",
                                "--pool-slots", "512", "--flush-mib", "1", "--out", str(tmp_path),
                                "--new-env", "PYTHONMALLOC=malloc"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    (written,) = tmp_path.glob("store-job-ab-*.json")
    result = json.loads(written.read_text())
    for tree in ("old", "new"):
        assert result["setup"][tree]["evictions"] > 0, result["setup"]
        assert all(result["median_us"][tree][k] > 0 for k in ("open", "end", "job")), result
    assert set(result["new_over_old"]) == {"open", "end", "job"}
    # --new-env reaches the new tree's worker only
    assert (result["setup"]["old"]["allocator"], result["setup"]["new"]["allocator"]) == (
        "pymalloc", "malloc")


def test_a_tree_whose_worker_cannot_start_is_named(tmp_path):
    broken = tmp_path / "broken"
    (broken / "kvpool").mkdir(parents=True)
    (broken / "kvpool" / "__init__.py").write_text("raise ImportError('a broken tree')\n")
    for d in ("shared", "daemon", "client"):
        (broken / d).mkdir()
    out = subprocess.run(CMD + [str(ROOT), str(broken), "--jobs", "2", "--pool-slots", "512"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert "the new tree's worker ended" in out.stderr, out.stderr
