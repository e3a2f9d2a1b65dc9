"""``python -m bench.soak``: run the campaign and write bench/results/soak-DATE.json."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.soak import SCALES, check, run
from bench.soak.common import ROOT


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--parts", default="", help="comma-separated part names (default: all)")
    ap.add_argument("--out", default="", help="result file [bench/results/soak-DATE.json]")
    args = ap.parse_args()
    only = [x for x in args.parts.split(",") if x] or None
    day = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"soak-{day}.json"
    work = Path(tempfile.mkdtemp(prefix="kvpool-soak-"))
    t0 = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f} s] {line}", flush=True)
    try:
        result = run(work, args.scale, only, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets = check(result, args.scale)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    doc = {**result, "targets_met": targets,
           "environment": {"date": day, "scale": args.scale, "commit": commit,
                           "host": platform.node(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "kernel": platform.release(),
                           "nice": os.nice(0), "total_s": round(time.monotonic() - t0, 1)}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    missed = [k for k, ok in targets.items() if ok is False]
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_detail")}, indent=1))
    print(f"wrote {out}; targets missed: {missed or 'none'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
