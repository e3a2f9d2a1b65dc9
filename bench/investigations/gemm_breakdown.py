"""Which part of a kvpool offload slows a GEMM that runs in a process of its own.

``bench/gpu_transfer.py`` measures a bf16 8192^3 GEMM beside a full-speed offload through
kvpoold with the GEMM in a third process (``gemm_slowdown``) and in the offloading worker's
own process (``gemm_slowdown_same_process``). This script repeats the third-process case with
one ingredient of the offload at a time, so the variant where the slowdown appears names it:

- ``both``: stores and loads, two jobs in flight each way (what gpu_transfer.py runs);
- ``stores`` / ``loads``: four jobs of one direction in flight;
- ``stores_side_stream``: the worker records its events on a stream of its own rather than
  its current (here the legacy default) stream;
- ``stores_no_event``: stores sent without the worker's interprocess event (the daemon then
  has nothing to poll; the worker records nothing on its GPU).

Every variant runs under each ``--store-waits`` value of ``KVPOOL_CUDA_STORE_WAIT`` (``host``:
the daemon polls the worker's event before copying; ``gpu``: its stream waits on the event).
Each variant: the GEMM alone, beside the offload, alone again (the mean of the two alone
runs is the reference). Writes ``gemm-breakdown-<gpu>-<date>.json`` into ``--out``.
Run on a CUDA machine through ``tests/gpu/run.sh breakdown``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from bench.gpu_transfer import BLOCK_BYTES, GB, gemm_alone_and_with, start_daemon  # noqa: E402
from bench.gpu_worker import Worker  # noqa: E402

VARIANTS = {"both": ("both", True), "stores": ("stores", True), "loads": ("loads", True),
            "stores_side_stream": ("stores", "side"),
            "stores_no_event": ("stores", False)}


def _variant(args, gemm: Worker, w: Worker, blocks: list[int], name: str) -> dict:
    kinds, events = VARIANTS[name]
    slow, rates = [], []
    for _ in range(args.reps):
        t_alone, (t_with, rate) = gemm_alone_and_with(
            gemm, w, args.gemm_iters,
            lambda secs: ("bench", "offload_for", secs, 128, blocks, blocks, kinds, events))
        slow.append(t_with / t_alone)
        rates.append(rate * BLOCK_BYTES / GB)
    return {"gemm_slowdown": statistics.median(slow), "offload_GBps": statistics.median(rates),
            "reps": [round(s, 3) for s in slow]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default="/tmp/kvpool-gemm-breakdown")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--gemm-iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--store-waits", default="host,gpu",
                    help="KVPOOL_CUDA_STORE_WAIT values to run every variant under")
    args = ap.parse_args()
    import torch
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "command": " ".join(sys.argv), "gemm_iters": args.gemm_iters,
                 "variants": {}}
    gemm = Worker(0, "block_outer", 4)
    try:
        for wait in args.store_waits.split(","):
            proc, sock = start_daemon(tmp, "12GiB", {"KVPOOL_CUDA_STORE_WAIT": wait},
                                      tag=wait)
            w = Worker(0, "block_outer", args.blocks)
            try:
                w.call("connect", sock, b"gemm-breakdown".ljust(16, b"\0"), 0, 1)
                w.call("fill", 1)
                blocks = list(range(args.blocks))
                w.call("bench", "store", blocks, timeout_s=300)   # slots for the loads
                for name in args.variants.split(","):
                    r = res["variants"][f"{wait}/{name}"] = _variant(args, gemm, w, blocks,
                                                                     name)
                    print(f"store wait {wait:4s} {name:16s} GEMM x{r['gemm_slowdown']:.3f}  "
                          f"offload {r['offload_GBps']:6.2f} GB/s  reps {r['reps']}",
                          flush=True)
            finally:
                w.close()
                proc.terminate()
                proc.wait(30)
    finally:
        gemm.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = res["device"].replace(" ", "_")
    path = out / f"gemm-breakdown-{name}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
