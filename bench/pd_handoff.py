"""P/D hand-off through the pool on two GPUs (issue 5, item 6): how long a prefill worker on
GPU 0 takes to hand an 8K-token Llama-3.1-8B prompt (512 blocks of 2 MiB = 1 GiB) to a decode
worker on GPU 1 through one kvpoold, from the start of the store to the decode side's KV being
usable, next to one one-way pinned memcpy of the same bytes measured in the same run.

The hand-off is run sequentially (one store job, then one load job) and pipelined: the store is
cut into chunks (as a chunked prefill stores each chunk when it is computed) and the decode side
loads what has landed while the rest is still being stored, so GPU 0's device->host and GPU 1's
host->device transfers (two PCIe links) overlap. Two decode sides:

- ``notified``: the decode side is told when each chunk's store has landed, then looks it up;
- ``polled``: the decode side knows nothing of the prefill and polls, as the connector's decode
  scheduler does each step: look up the blocks it still waits for (pinned), load the hits,
  repeat. This is what a vLLM decode instance behind the kvpool connector does.

Across TP sizes (``--mode cross``, issue 16): the prefill runs at TP=2 (a rank on each GPU,
each storing its half of the KV heads into slots that hold every head) and the decode at TP=1 on
GPU 1 (loading every head); against it, in the same run and with the same head-split slots, the
same-TP hand-offs TP=1 (GPU 0) -> TP=1 (GPU 1) and TP=2 -> TP=2 (both GPUs). GB/s is the prompt's
bytes over the hand-off time; target: TP=2 -> TP=1 >= 0.9 x TP=1 -> TP=1.

Run: ``python -m bench.pd_handoff --out bench/results`` (needs two GPUs;
``--mode same`` the original hand-off only, ``--mode cross`` the TP comparison only). On one
GPU ``--mode cross`` runs with every worker on it: the modes then share one link, so their
ratios mean little, but a tree's hand-offs still compare with another tree's (an A/B of the
copy path's operations where only one GPU is lent).
Target: hand-off <= 2.2 x the one-way memcpy time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench.gpu_worker import LAYOUTS, ShmPool, Worker, start_workers  # noqa: E402

from kvpool.daemon import cuda  # noqa: E402

BLOCK_BYTES = 2 << 20


def one_way_s(device: int, nbytes: int, to_host: bool, reps: int) -> float:
    """Median seconds of one contiguous pinned memcpy of ``nbytes`` on ``device``."""
    cuda.use_device(device)
    host = ShmPool(nbytes, name=f"kvpool-pd-limit-{os.getpid()}-{device}")
    cuda.host_register(host.base_address, host.nbytes)
    dev = cuda.mem_alloc(nbytes)
    stream = cuda.stream_create()
    try:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            if to_host:
                cuda.memcpy_async(host.base_address, dev, nbytes, stream)
            else:
                cuda.memcpy_async(dev, host.base_address, nbytes, stream)
            cuda.stream_synchronize(stream)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        cuda.stream_destroy(stream)
        cuda.mem_free(dev)
        cuda.host_unregister(host.base_address)
        host.close()


def _prepare(sched, ns: bytes, blocks: int, chunks: int, tag: str):
    """The prompt's keys, and its store cut into ``chunks`` (block ids, tickets, keys, grant)
    parts: tickets reserved ahead, as a connector's stock is, bound to their keys by the
    stores (every rank's store of a chunk names the same tickets and keys)."""
    keys = [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()
            for i in range(blocks)]
    reply = sched.reserve(ns, blocks)
    if len(reply.slots) < blocks:
        raise RuntimeError(f"reserve granted {len(reply.slots)} of {blocks} tickets")
    slots = list(reply.slots)
    per = -(-blocks // chunks)
    parts = [(list(range(i, min(i + per, blocks))), slots[i:i + per], keys[i:i + per],
              reply.daemon_id) for i in range(0, blocks, per)]
    return keys, parts, per


def handoff(prefill: Worker, decode: Worker, sched, ns: bytes, blocks: int, chunks: int,
            tag: str) -> float:
    """Seconds from the prefill's store request to the decode side's KV being usable, the
    decode side told of each landed chunk."""
    keys, parts, per = _prepare(sched, ns, blocks, chunks, tag)
    leases, load_ids = [], []
    t0 = time.monotonic_ns()
    prefill.conn.send(("pd_store", parts))
    while True:
        msg = prefill.conn.recv()
        if msg[0] == "end":
            break
        _, k, ok, why, _t = msg
        if not ok:
            raise RuntimeError(f"store failed: {why}")
        reply = sched.lookup(ns, [keys[k * per:(k + 1) * per]], pin=True)
        leases += reply.leases
        got = list(reply.slots[0])
        if len(got) != len(parts[k][0]):
            raise RuntimeError(f"chunk {k}: {len(got)} of {len(parts[k][0])} blocks committed")
        # the decode side puts the prompt in other block ids than the prefill side used
        load_ids.append(decode.call("submit_load", got, [b + blocks for b in parts[k][0]]))
    t_end = decode.call("wait_loads", load_ids, timeout_s=120)
    sched.release(leases)
    return (t_end - t0) / 1e9


def handoff_polled(prefill: Worker, decode: Worker, sched, ns: bytes, blocks: int, chunks: int,
                   tag: str) -> tuple[float, int]:
    """Seconds from the prefill's store request to the decode side's KV being usable, the
    decode side polling lookups; also how many load jobs it took."""
    keys, parts, _ = _prepare(sched, ns, blocks, chunks, tag)
    leases, load_ids = [], []
    have = 0
    t0 = time.monotonic_ns()
    prefill.conn.send(("pd_store", parts))
    deadline = time.monotonic() + 60
    while have < blocks:
        reply = sched.lookup(ns, [keys[have:]], pin=True)
        n = reply.hits[0]
        if n:
            leases += reply.leases
            load_ids.append(decode.call("submit_load", list(reply.slots[0]),
                                        [b + blocks for b in range(have, have + n)]))
            have += n
        elif time.monotonic() > deadline:
            raise RuntimeError(f"only {have} of {blocks} blocks landed in 60 s")
    t_end = decode.call("wait_loads", load_ids, timeout_s=120)
    while (msg := prefill.conn.recv())[0] != "end":
        if not msg[2]:
            raise RuntimeError(f"store failed: {msg[3]}")
    sched.release(leases)
    return (t_end - t0) / 1e9, len(load_ids)


def handoff_tp(prefills: list[Worker], decodes: list[Worker], sched, ns: bytes, blocks: int,
               chunks: int, tag: str) -> float:
    """Seconds from the prefill ranks' store requests to every decode rank's KV being usable;
    a chunk is looked up (and loaded by every decode rank) once every prefill rank's store of
    it has landed, as a decode told of each landed chunk would."""
    from multiprocessing.connection import wait

    keys, parts, per = _prepare(sched, ns, blocks, chunks, tag)
    landed: dict[int, int] = {}
    leases: list[int] = []
    load_ids: list[list[int]] = [[] for _ in decodes]
    t0 = time.monotonic_ns()
    for p in prefills:
        p.conn.send(("pd_store", parts))
    ended = 0
    conns = [p.conn for p in prefills]
    while ended < len(prefills):
        for conn in wait(conns):
            msg = conn.recv()
            if msg[0] == "end":
                ended += 1
                continue
            _, k, ok, why, _t = msg
            if not ok:
                raise RuntimeError(f"store failed: {why}")
            landed[k] = landed.get(k, 0) + 1
            if landed[k] < len(prefills):
                continue
            reply = sched.lookup(ns, [keys[k * per:(k + 1) * per]], pin=True)
            leases += reply.leases
            got = list(reply.slots[0])
            if len(got) != len(parts[k][0]):
                raise RuntimeError(f"chunk {k}: {len(got)} of {len(parts[k][0])} committed")
            for d, ids in zip(decodes, load_ids):
                ids.append(d.call("submit_load", got, [b + blocks for b in parts[k][0]]))
    t_end = max(d.call("wait_loads", ids, timeout_s=120) for d, ids in zip(decodes, load_ids))
    sched.release(leases)
    return (t_end - t0) / 1e9


def tp_cross(args, sock: str, sched, res: dict) -> None:
    """TP=2 -> TP=1 against TP=1 -> TP=1 and TP=2 -> TP=2, head-split slots throughout."""
    from bench.gpu_worker import join_parts, rank_part
    nbytes = args.blocks * BLOCK_BYTES
    out = res["tp_cross"] = {}
    for layout in args.cross_layouts.split(","):
        if LAYOUTS[layout][0] * LAYOUTS[layout][1] != BLOCK_BYTES:
            raise SystemExit(f"{layout}: the TP comparison wants 2 MiB blocks")
        nb = 2 * args.blocks
        gpu = (lambda i: -1) if args.dry_run_cpu else (lambda i: i % args.gpus)
        # TP=1 prefill and decode, TP=2 prefill ranks, TP=2 decode ranks
        ws = start_workers([(gpu(0), layout, nb), (gpu(1), layout, nb)]
                           + [(gpu(r), layout, nb, 2) for r in (0, 1, 0, 1)])
        one, two_p, two_d = ws[:2], ws[2:4], ws[4:]
        try:
            ns = hashlib.blake2b(f"pd-cross-{layout}".encode(), digest_size=16).digest()
            for w in one:
                w.call("connect", sock, ns, 0, 1, True)
            for ws in (two_p, two_d):
                for r, w in enumerate(ws):
                    w.call("connect", sock, ns, r, 2, True)
            for i, w in enumerate(one + two_p):
                w.call("fill", 11 + i)
            modes = {"tp1_to_tp1": (one[:1], one[1:]), "tp2_to_tp1": (two_p, one[1:]),
                     "tp2_to_tp2": (two_p, two_d)}
            for name, (pf, dc) in modes.items():          # warm every path once
                handoff_tp(pf, dc, sched, ns, min(64, args.blocks), 2, f"{layout}-{name}-warm")
            row = out[layout] = {}
            for chunks in (int(c) for c in args.cross_chunks.split(",")):
                # interleaved repetitions: drift over the run hits every mode alike
                ts: dict[str, list[float]] = {m: [] for m in modes}
                for rep in range(args.reps):
                    for name, (pf, dc) in modes.items():
                        ts[name].append(handoff_tp(pf, dc, sched, ns, args.blocks, chunks,
                                                   f"{layout}-{name}-{chunks}-{rep}"))
                cell = row[f"chunks_{chunks}"] = {}
                for name, t in ts.items():
                    med = statistics.median(t)
                    cell[name] = {"handoff_s": med, "GBps": nbytes / med / 1e9, "all_s": t}
                base = cell["tp1_to_tp1"]["GBps"]
                cell["ratio_tp2_to_tp1_vs_tp1_to_tp1"] = cell["tp2_to_tp1"]["GBps"] / base
                cell["ratio_tp2_to_tp1_vs_tp2_to_tp2"] = (cell["tp2_to_tp1"]["GBps"]
                                                          / cell["tp2_to_tp2"]["GBps"])
                print(f"[tp] {layout} {chunks} chunk(s): TP=1->1 {base:.2f} GB/s, TP=2->1 "
                      f"{cell['tp2_to_tp1']['GBps']:.2f} GB/s, TP=2->2 "
                      f"{cell['tp2_to_tp2']['GBps']:.2f} GB/s; TP=2->1 / TP=1->1 = "
                      f"{cell['ratio_tp2_to_tp1_vs_tp1_to_tp1']:.3f}, / TP=2->2 = "
                      f"{cell['ratio_tp2_to_tp1_vs_tp2_to_tp2']:.3f}", flush=True)
            # bit-exact: a TP=2 -> TP=1 and a TP=1 -> TP=2 hand-off of n blocks (the decode
            # side puts block b at b + n)
            n = min(40, args.blocks)
            handoff_tp(two_p, one[1:], sched, ns, n, 4, f"{layout}-check")
            ids = list(range(0, n, 3))
            parts = [w.call("blocks", ids) for w in two_p]
            got = one[1].call("blocks", [b + n for b in ids])
            exact = bool((join_parts(layout, parts) == got).all())
            handoff_tp(one[:1], two_d, sched, ns, n, 4, f"{layout}-check-back")
            full = one[0].call("blocks", ids)
            exact &= all(bool((rank_part(layout, full, 2, r) ==
                               w.call("blocks", [b + n for b in ids])).all())
                         for r, w in enumerate(two_d))
            row["bit_exact"] = exact
            print(f"[tp] {layout} bit-exact across TP sizes: {exact}", flush=True)
        finally:
            for w in one + two_p + two_d:
                w.close()
    ratios = [c["ratio_tp2_to_tp1_vs_tp1_to_tp1"] for r in out.values()
              for k, c in r.items() if k.startswith("chunks_")]
    res["tp_cross_worst_ratio"] = min(ratios) if ratios else None
    print(f"[summary] TP=2 -> TP=1 hand-off at {min(ratios):.3f}-{max(ratios):.3f} x the GB/s "
          f"of TP=1 -> TP=1 (target >= 0.9)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default="/tmp/kvpool-pd")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default="1,8,32")
    ap.add_argument("--layouts", default="per_layer,block_outer")
    ap.add_argument("--pool-size", default="6GiB")
    ap.add_argument("--mode", choices=["same", "cross", "all"], default="all",
                    help="same: TP=1 hand-off vs memcpy; cross: TP=2 -> TP=1 vs same-TP")
    ap.add_argument("--cross-layouts", default="per_layer,block_outer,block_heads")
    ap.add_argument("--cross-chunks", default="1,8")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the --mode cross flow on host memory, without GPUs (checks the "
                         "script and the bytes; its GB/s mean nothing)")
    args = ap.parse_args()
    import torch

    from bench.gpu_transfer import start_daemon
    if args.dry_run_cpu:
        args.mode = "cross"
    args.gpus = torch.cuda.device_count()
    if not args.dry_run_cpu and args.gpus < (1 if args.mode == "cross" else 2):
        raise SystemExit(f"pd_handoff --mode {args.mode} needs two GPUs (--mode cross one)")
    nbytes = args.blocks * BLOCK_BYTES
    res: dict = {"device": "cpu (dry run)" if args.dry_run_cpu else torch.cuda.get_device_name(0),
                 "gpus": torch.cuda.device_count(),
                 "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                 "command": " ".join(shlex.quote(a) for a in sys.argv), "blocks": args.blocks,
                 "bytes": nbytes, "layouts": {}}
    if not args.dry_run_cpu:
        res["memcpy_d2h_gpu0_s"] = one_way_s(0, nbytes, True, args.reps)
        res["memcpy_h2d_gpu1_s"] = one_way_s(1 % args.gpus, nbytes, False, args.reps)
        one_way = max(res["memcpy_d2h_gpu0_s"], res["memcpy_h2d_gpu1_s"])
        res["one_way_s"] = one_way
        print(f"[limit] one-way 1 GiB: d2h gpu0 {res['memcpy_d2h_gpu0_s'] * 1e3:.2f} ms, "
              f"h2d gpu1 {res['memcpy_h2d_gpu1_s'] * 1e3:.2f} ms", flush=True)
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    proc, sock = start_daemon(tmp, args.pool_size, cuda="off" if args.dry_run_cpu else "on")
    from kvpool.client.scheduler import SchedulerClient
    from kvpool.shared.config import ClientConfig
    sched = SchedulerClient(ClientConfig(socket=sock, timeout_ms=10000), name="pd-bench")
    try:
        if args.mode in ("cross", "all"):
            tp_cross(args, sock, sched, res)
        for layout in (args.layouts.split(",") if args.mode != "cross" else []):
            prefill, decode = start_workers([(0, layout, 2 * args.blocks),
                                             (1, layout, 2 * args.blocks)])
            try:
                ns = hashlib.blake2b(f"pd-{layout}".encode(), digest_size=16).digest()
                prefill.call("connect", sock, ns, 0, 1)
                decode.call("connect", sock, ns, 0, 1)
                prefill.call("fill", 3)
                handoff(prefill, decode, sched, ns, 64, 2, f"{layout}-warm")
                row = res["layouts"][layout] = {}
                for chunks in (int(c) for c in args.chunks.split(",")):
                    ts = [handoff(prefill, decode, sched, ns, args.blocks, chunks,
                                  f"{layout}-{chunks}-{r}") for r in range(args.reps)]
                    t = statistics.median(ts)
                    row[f"chunks_{chunks}"] = {"handoff_s": t, "ratio_to_one_way": t / one_way,
                                               "GBps": nbytes / t / 1e9, "all_s": ts}
                    print(f"[pd] {layout} {chunks} chunk(s), notified: {t * 1e3:.2f} ms = "
                          f"{t / one_way:.2f} x one-way memcpy", flush=True)
                    if chunks == 1:
                        continue        # one chunk: polling adds nothing to measure
                    polled = [handoff_polled(prefill, decode, sched, ns, args.blocks, chunks,
                                             f"{layout}-{chunks}-p{r}") for r in range(args.reps)]
                    t = statistics.median(x for x, _ in polled)
                    row[f"polled_{chunks}"] = {"handoff_s": t, "ratio_to_one_way": t / one_way,
                                               "GBps": nbytes / t / 1e9,
                                               "all_s": [x for x, _ in polled],
                                               "load_jobs": [n for _, n in polled]}
                    print(f"[pd] {layout} {chunks} chunk(s), polled: {t * 1e3:.2f} ms = "
                          f"{t / one_way:.2f} x one-way memcpy, load jobs "
                          f"{[n for _, n in polled]}", flush=True)
                # bit-exact check of the last hand-off's bytes
                want = prefill.call("blocks", list(range(0, args.blocks, 37)))
                got = decode.call("blocks", [b + args.blocks for b in range(0, args.blocks, 37)])
                row["bit_exact"] = bool((want == got).all())
                print(f"[pd] {layout} bit-exact: {row['bit_exact']}", flush=True)
            finally:
                prefill.close()
                decode.close()
    finally:
        sched.close()
        proc.terminate()
        proc.wait(30)
    best = min((c["ratio_to_one_way"] for r in res["layouts"].values()
                for k, c in r.items() if k.startswith("chunks_")), default=None)
    res["best_ratio_to_one_way"] = best
    res["best_polled_ratio_to_one_way"] = min(
        (c["ratio_to_one_way"] for r in res["layouts"].values()
         for k, c in r.items() if k.startswith("polled_")), default=None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = res["device"].replace(" ", "_").replace("/", "_")
    path = out / f"pd-{dev}-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(res, indent=1))
    if best is not None:
        print(f"[summary] best hand-off = {best:.2f} x one-way memcpy (target <= 2.2), polled as "
              f"the connector does: {res['best_polled_ratio_to_one_way'] or float('nan'):.2f} x",
              flush=True)
    print(f"[summary] results in {path}", flush=True)


if __name__ == "__main__":
    main()
