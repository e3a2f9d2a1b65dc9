"""One results JSON from a `tests/gpu/run.sh ab-tp` or `tp-trees` call: per run (in the order
they ran) and tree, each layout's and chunk count's hand-off GB/s for TP=1 -> TP=1, TP=2 -> TP=1
and TP=2 -> TP=2, and TP=2 -> TP=2 over TP=1 -> TP=1 (the same run's one-GPU hand-off: what
two GPUs buy, comparable across machines). Read from each run's ``[tp]`` lines, so a run cut
off by its time limit still gives what it printed.

    python -m bench.ab_tp_json tp-trees.tgz --device "2 x NVIDIA H200" --command "..." \\
        --out bench/results/pd-...-tp-trees.json
"""

from __future__ import annotations

import glob
import os
import re
import statistics
from pathlib import Path

from bench.ab_scale_json import read_runs, results_args, write_results

# "[tp] block_outer 8 chunk(s): TP=1->1 38.87 GB/s, TP=2->1 27.28 GB/s, TP=2->2 31.85 GB/s; ..."
LINE = re.compile(r"^\[tp\] (\w+) (\d+) chunk\(s\): TP=1->1 ([\d.]+) GB/s, TP=2->1 ([\d.]+) "
                  r"GB/s, TP=2->2 ([\d.]+) GB/s")


def _order_and_tree(name: str) -> tuple[int, str]:
    """ab-tp names a run TREE-SECONDS, tp-trees N-TREE."""
    a, b = name.split("-", 1)
    return (int(a), b) if a.isdigit() else (int(b), a)


def runs_of(root: str) -> list[dict]:
    """One row per run, layout and chunk count, in the order the runs ran."""
    dirs = sorted(glob.glob(f"{root}/*-*/"),
                  key=lambda d: _order_and_tree(os.path.basename(d.rstrip("/")))[0])
    out = []
    for k, d in enumerate(dirs, 1):
        _, tree = _order_and_tree(os.path.basename(d.rstrip("/")))
        log = Path(d, "output.log")
        for line in log.read_text().splitlines() if log.exists() else ():
            m = LINE.match(line)
            if m:
                one, two_one, two_two = map(float, m.group(3, 4, 5))
                out.append({"run": k, "tree": tree, "layout": m[1], "chunks": int(m[2]),
                            "tp1_to_tp1_GBps": one, "tp2_to_tp1_GBps": two_one,
                            "tp2_to_tp2_GBps": two_two,
                            "tp2_to_tp1_vs_tp1_to_tp1": round(two_one / one, 3),
                            "tp2_to_tp2_vs_tp1_to_tp1": round(two_two / one, 3)})
    return out


def medians(runs: list[dict]) -> dict:
    """tree -> "layout/chunks" -> the median of each figure over that tree's runs."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["tree"], f"{r['layout']}/{r['chunks']}"), []).append(r)
    figures = [k for k in runs[0] if k.endswith(("GBps", "tp1_to_tp1"))] if runs else []
    return {tree: {key: {f: round(statistics.median(r[f] for r in rows), 3) for f in figures}
                   for (t, key), rows in sorted(groups.items()) if t == tree}
            for tree in dict.fromkeys(r["tree"] for r in runs)}


def main() -> None:
    ap = results_args(__doc__.split("\n")[0],
                      "ab-tp.tgz or tp-trees.tgz, or the directory it unpacks to")
    ap.add_argument("--trees", default="", help="what each tree was (e.g. new=0e79986)")
    args = ap.parse_args()
    runs = read_runs(args.source, runs_of)
    if not runs:
        raise SystemExit(f"no [tp] lines under {args.source}")
    write_results(args, "pd_handoff --mode cross, by tree", runs, medians(runs),
                  trees=args.trees)
    for r in runs:
        print(r["run"], r["tree"], r["layout"], r["chunks"], r["tp1_to_tp1_GBps"],
              r["tp2_to_tp1_GBps"], r["tp2_to_tp2_GBps"], r["tp2_to_tp2_vs_tp1_to_tp1"])


if __name__ == "__main__":
    main()
