"""bench/ab_tp_json.py: one results JSON from an ab-tp or tp-trees call's runs, read from the
``[tp]`` lines each run printed (a run cut off by its limit gives what it printed)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.ab_tp_json import medians, runs_of

ROOT = Path(__file__).resolve().parents[2]


def _line(layout: str, chunks: int, one: float, two_one: float, two_two: float) -> str:
    """A [tp] line as bench/pd_handoff.py prints it."""
    return (f"[tp] {layout} {chunks} chunk(s): TP=1->1 {one:.2f} GB/s, TP=2->1 {two_one:.2f} "
            f"GB/s, TP=2->2 {two_two:.2f} GB/s; TP=2->1 / TP=1->1 = {two_one / one:.3f}, / "
            f"TP=2->2 = {two_one / two_two:.3f}\n")


def _write(root: Path, runs: dict[str, str]) -> None:
    for name, text in runs.items():
        (root / name).mkdir()
        (root / name / "output.log").write_text(text)


def test_ab_tp_runs_keep_their_order_and_each_tree_its_median(tmp_path):
    _write(tmp_path, {
        "old-2": "[daemon] noise\n" + _line("block_outer", 8, 40.0, 36.0, 52.0),
        "new-85": _line("block_outer", 8, 40.0, 22.0, 20.0),
        "old-168": _line("block_outer", 8, 38.0, 38.0, 50.0),
        "new-253": _line("block_outer", 8, 38.0, 24.0, 24.0)})
    runs = runs_of(str(tmp_path))
    assert [(r["run"], r["tree"]) for r in runs] == [(1, "old"), (2, "new"), (3, "old"),
                                                     (4, "new")]
    assert runs[1]["tp2_to_tp2_vs_tp1_to_tp1"] == 0.5
    m = medians(runs)
    assert m["old"]["block_outer/8"]["tp2_to_tp2_GBps"] == 51.0
    assert m["new"]["block_outer/8"]["tp2_to_tp1_vs_tp1_to_tp1"] == round(
        (22 / 40 + 24 / 38) / 2, 3)


def test_tp_trees_runs_cut_off_give_what_they_printed(tmp_path):
    runs = tmp_path / "tp-trees"
    runs.mkdir()
    _write(runs, {"1-5b4b62a": "[limit] one-way 1 GiB\n",       # cut off before a line
                  "2-9525444": _line("block_outer", 1, 22.0, 24.0, 29.0)
                  + _line("block_outer", 8, 30.0, 26.0, 29.0),
                  "3-main": _line("block_outer", 1, 22.0, 19.0, 22.0)})
    (runs / "4-x").mkdir()                                       # wrote nothing at all
    tgz = tmp_path / "tp-trees.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(runs, arcname=".")
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, "-m", "bench.ab_tp_json", str(tgz), "--device", "test",
                        "--command", "run.sh tp-trees", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["order"] == "9525444 main"
    assert [(x["run"], x["tree"], x["chunks"]) for x in doc["runs"]] == [
        (2, "9525444", 1), (2, "9525444", 8), (3, "main", 1)]
    assert doc["medians"]["main"]["block_outer/1"]["tp2_to_tp2_vs_tp1_to_tp1"] == 1.0


def test_an_archive_with_no_tp_line_is_an_error(tmp_path):
    _write(tmp_path, {"1-a": "Traceback: no GPUs\n"})
    r = subprocess.run([sys.executable, "-m", "bench.ab_tp_json", str(tmp_path), "--device",
                        "test", "--command", "x", "--out", str(tmp_path / "o.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no [tp] lines" in r.stderr
