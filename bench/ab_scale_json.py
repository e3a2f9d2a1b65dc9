"""One results JSON from a `tests/gpu/run.sh ab-scale` call: every run's figures in the order
they ran, and per tree the median of each, the event loop's CPU per GB beside each phase's
ratio (what an A/B of the daemon is for).

    python -m bench.ab_scale_json ab-scale.tgz --new NEW --old OLD --device "2 x NVIDIA H200" \\
        --command "..." --out bench/results/host-scale-...-ab-NEW-OLD.json
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

PHASES = ("store", "load", "bidir")


def read_runs(source: str, reader: Callable[[str], list[dict]]) -> list[dict]:
    """``reader``'s rows from a call's archive (a ``.tgz``), or the directory it unpacks to."""
    if not os.path.isfile(source):
        return reader(source)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(source) as t:
            t.extractall(tmp, filter="data")
        return reader(tmp)


def runs_of(root: str | Path) -> list[dict]:
    """Per run directory (``new-SECONDS`` or ``old-SECONDS``, in the order they ran), per
    engine count and layout: the run's number, its tree, the CPU its daemon's loop ran alone
    on (``loop_cpu``, where host_scale recorded it) and each phase's figures."""
    dirs = sorted(glob.glob(f"{root}/*-*"), key=lambda d: int(d.rsplit("-", 1)[1]))
    out = []
    for k, d in enumerate(dirs, 1):
        tree = os.path.basename(d).split("-")[0]
        found = glob.glob(f"{d}/*.json")
        if not found:
            continue                    # a run that wrote nothing (its log says why)
        result = json.loads(Path(found[0]).read_text())
        for n, per_n in result["runs"].items():
            for layout, figures in per_n["layouts"].items():
                row: dict = {"run": k, "tree": tree, "engines": int(n), "layout": layout,
                             "loop_cpu": per_n.get("loop_cpu")}   # None: not recorded
                for p in PHASES:
                    x = figures[p]
                    row[p] = {"GBps": round(x["GBps"], 2),
                              "ratio": round(figures[f"{p}_ratio"], 3),
                              "loop_util": round(x["daemon_loop_util"], 3),
                              "loop_ms_per_GB": round(x["daemon_loop_util"] / x["GBps"] * 1e3,
                                                      2),
                              "busiest_thread_util": round(x["daemon_busiest_thread_util"], 3)}
                out.append(row)
    return out


def medians(runs: list[dict]) -> dict:
    """tree -> "engines/layout" -> phase -> the median of each figure over that tree's runs."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["tree"], f"{r['engines']}/{r['layout']}"), []).append(r)
    out: dict = {}
    for (tree, key), rows in sorted(groups.items()):
        out.setdefault(tree, {})[key] = {
            p: {m: round(statistics.median(r[p][m] for r in rows), 3) for m in rows[0][p]}
            for p in PHASES}
    return out


def results_args(description: str, source_help: str) -> argparse.ArgumentParser:
    """The arguments of a tool that turns a device call's runs into one results JSON: the
    call's archive, where it ran, the run.sh call that made it, the date and the output."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("source", help=source_help)
    ap.add_argument("--device", required=True)
    ap.add_argument("--command", required=True, help="the run.sh call that made them")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--out", required=True)
    return ap


def write_results(args: argparse.Namespace, benchmark: str, runs: list[dict], per_tree: dict,
                  **what: str) -> None:
    """One results JSON at ``args.out``: where and how the runs were made, ``what`` the trees
    were, the trees in the order they ran, each tree's medians and every run."""
    doc = {"benchmark": benchmark, "device": args.device, "date": args.date,
           "command": args.command, **what,
           "order": " ".join(dict((r["run"], r["tree"]) for r in runs).values()),
           "medians": per_tree, "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


def main() -> None:
    ap = results_args(__doc__.split("\n")[0], "ab-scale.tgz, or the directory it unpacks to")
    ap.add_argument("--new", required=True, help="what the new runs were (a commit, a setting)")
    ap.add_argument("--old", required=True)
    args = ap.parse_args()
    runs = read_runs(args.source, runs_of)
    if not runs:
        raise SystemExit(f"no host_scale results under {args.source}")
    write_results(args, "host_scale A/B", runs, medians(runs), new=args.new, old=args.old)
    for r in runs:
        print(r["run"], r["tree"], r["engines"], r["layout"],
              {p: (r[p]["ratio"], r[p]["loop_util"], r[p]["loop_ms_per_GB"]) for p in PHASES})


if __name__ == "__main__":
    main()
