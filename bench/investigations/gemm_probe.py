"""Where a GEMM loses time beside an offload (issue 15): one cause at a time, side by side.

    python -m bench.investigations.gemm_probe [--out DIR] [--iters 300] [--reps 3] [--chunk-mib 2]

A bf16 8192^3 GEMM loop runs in one process (the engine); a second process (the daemon's
place) does one thing at a time while it runs, and the GEMM's time is divided by its time
alone, measured just before and just after (their mean; median of ``--reps``). Each step adds
one ingredient of what kvpoold does, so the step where the slowdown appears names the cause:

- ``idle_context``: the second process only holds a CUDA context (time-slicing between
  contexts costs nothing while the other context has no work);
- ``copy_own``: it copies its own device memory to pinned host memory, ``--chunk-mib`` at a
  time, back to back (DMA from another context: copy engines, no SMs);
- ``copy_ipc``: the same copies, from the engine's memory opened through CUDA IPC (what the
  daemon copies);
- ``copy_ipc_event_sync``: and an event recorded and waited for on the host after every
  chunk (the completion polling of a job per block);
- ``copy_ipc_wait_ipc_event``: before every chunk the copy stream waits on an interprocess
  event recorded on another stream (a store waiting on the worker's IPC event);
- ``copy_ipc_record_ipc_event``: an interprocess event recorded after every chunk and never
  waited on the GPU (a worker recording its store events, the daemon its load-done events);
- ``bidir_ipc``: chunks out of and into the engine's memory at once, on two streams (stores
  and loads together);
- ``batch_ipc``: the chunks in one ``cuMemcpyBatchAsync`` per 16 (kvpool's 1D path, with
  its attributes);
- ``batch2d_ipc``: per-layer blocks (64 strided 32 KiB segments each) in one
  ``cuMemcpy3DBatchAsync`` per 16 blocks (kvpool's pitched path);
- ``copy_ipc_kernel``: a gather kernel (``index_select``) over each chunk before its copy:
  SMs of another context beside the GEMM;
- ``copy_same_process``: the engine process itself copies on a side stream (vLLM's
  in-process offload; one context, no time-slicing).

Writes ``gemm-probe-<gpu>-<date>.json`` into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import threading
import time

import torch
import torch.multiprocessing as mp

GB = 1e9
MODES = ("idle_context", "copy_own", "copy_ipc", "copy_ipc_event_sync", "copy_ipc_wait_ipc_event",
         "copy_ipc_record_ipc_event",
         "bidir_ipc", "batch_ipc", "batch2d_ipc", "copy_ipc_kernel", "copy_same_process")
SEGMENT = 32 << 10      # batch2d_ipc: a per-layer layout's K or V of one layer of one block


class CopyLoop:
    """Copies ``src`` (device) into pinned host memory chunk by chunk on a side stream until
    stopped; counts the bytes."""

    def __init__(self, src: torch.Tensor, chunk: int, mode: str) -> None:
        self.src = src.view(-1, chunk)
        self.dst = torch.empty(self.src.shape, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream()
        self.mode = mode
        self.stop = threading.Event()
        self.bytes = 0
        self.seconds = 0.0
        self.error = ""
        self.other = torch.cuda.Stream()
        if mode in ("copy_ipc_wait_ipc_event", "copy_ipc_record_ipc_event"):
            self.ipc_event = torch.cuda.Event(interprocess=True)
        if mode == "bidir_ipc":
            self.back = torch.full(self.src.shape, 3, dtype=torch.uint8, pin_memory=True)
        if mode == "copy_ipc_kernel":
            self.rows = torch.arange(self.src.shape[0], device=src.device)

    def run(self) -> None:
        try:
            # A new thread has no current context until a runtime call binds the primary
            # one; kvpool's driver calls below need it.
            torch.cuda.synchronize()
            if self.mode.startswith("batch"):
                self._run_batched()
            else:
                self._run_copies()
        except Exception as e:      # reported with the mode, never a hung probe
            self.error = f"{type(e).__name__}: {e}"
            self.seconds = self.seconds or 1.0

    def _run_copies(self) -> None:
        n, chunk = self.src.shape
        t0 = time.perf_counter()
        i = 0
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                for _ in range(16):
                    j = i % n
                    if self.mode == "copy_ipc_kernel":
                        self.dst[j:j + 1].copy_(self.src.index_select(0, self.rows[j:j + 1]),
                                                non_blocking=True)
                    else:
                        if self.mode == "copy_ipc_wait_ipc_event":
                            self.ipc_event.record(self.other)
                            self.stream.wait_event(self.ipc_event)
                        self.dst[j].copy_(self.src[j], non_blocking=True)
                        if self.mode == "copy_ipc_record_ipc_event":
                            self.ipc_event.record(self.stream)
                        if self.mode == "bidir_ipc":
                            with torch.cuda.stream(self.other):
                                self.src[(j + n // 2) % n].copy_(self.back[j],
                                                                 non_blocking=True)
                    if self.mode == "copy_ipc_event_sync":
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                        ev.synchronize()
                    i += 1
                self.stream.synchronize()
                self.other.synchronize()
        self.bytes = i * chunk * (2 if self.mode == "bidir_ipc" else 1)
        self.seconds = time.perf_counter() - t0

    def _run_batched(self) -> None:
        """kvpool's own driver calls (``kvpool.daemon.cuda``), 16 blocks a call."""
        import numpy as np

        from kvpool.daemon import cuda as kc

        n, chunk = self.src.shape
        src, dst = self.src.data_ptr(), self.dst.data_ptr()
        stream = self.stream.cuda_stream
        ops_of = []
        for first in range(0, n, 16):
            blocks = np.arange(first, min(n, first + 16), dtype=np.uint64)
            if self.mode == "batch_ipc":
                ops_of.append((src + blocks * chunk, dst + blocks * chunk,
                               np.full(len(blocks), chunk, dtype=np.uint64)))
            else:
                # The engine's KV as [rows = layers x K/V][blocks][SEGMENT]: a block is a
                # column of rows, one pitched op.
                rows = chunk // SEGMENT
                one = np.ones(len(blocks), dtype=np.uint64)
                ops_of.append(kc.pitched_ops(dst + blocks * chunk, one * SEGMENT,
                                             src + blocks * SEGMENT, one * (n * SEGMENT),
                                             one * SEGMENT, one * rows))
        t0 = time.perf_counter()
        i = 0
        while not self.stop.is_set():
            ops = ops_of[i % len(ops_of)]
            if self.mode == "batch_ipc":
                kc.memcpy_batch_async(*ops, stream)
                i += len(ops[2])
            else:
                kc.memcpy_2d_batch_async(ops, stream)
                i += len(ops)
            self.stream.synchronize()
        self.bytes = i * chunk
        self.seconds = time.perf_counter() - t0


def gemm_seconds(a: torch.Tensor, b: torch.Tensor, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    # The same pause before every timed loop, alone or not: a GEMM right after another runs
    # at lower clocks than one after a pause, which biased a first version of this probe.
    time.sleep(0.3)
    start.record()
    for _ in range(iters):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def engine(conn, to_copier, kv_bytes: int, chunk: int) -> None:
    """The GEMM process; it owns the KV memory the copier opens through CUDA IPC."""
    conn.send(torch.cuda.get_device_name(0))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    kv = torch.randint(0, 255, (kv_bytes,), dtype=torch.uint8, device="cuda")
    to_copier.send(kv)                  # shared through CUDA IPC by torch's reductions
    gemm_seconds(a, b, 20)              # warm
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        what, iters = cmd
        loop = None
        if what == "with_own_copies":
            loop = CopyLoop(kv, chunk, "copy_same_process")
            th = threading.Thread(target=loop.run)
            th.start()                  # (at full speed by the end of gemm_seconds' pause)
        t = gemm_seconds(a, b, iters)
        rate = 0.0
        if loop is not None:
            loop.stop.set()
            th.join()
            rate = loop.bytes / loop.seconds / GB
        conn.send((t, rate, loop.error if loop is not None else ""))


def copier(conn, from_engine, chunk: int) -> None:
    """The daemon's place: does one thing at a time, on command."""
    kv = from_engine.recv()             # the engine's memory, opened through CUDA IPC
    own = torch.empty_like(kv)
    own.fill_(7)
    torch.cuda.synchronize()
    while True:
        mode = conn.recv()
        if mode is None:
            return
        loop = None
        if mode != "idle_context":
            loop = CopyLoop(own if mode == "copy_own" else kv, chunk, mode)
            th = threading.Thread(target=loop.run)
            th.start()
            time.sleep(0.2)
        conn.send("running")
        assert conn.recv() == "stop"
        rate, error = 0.0, ""
        if loop is not None:
            loop.stop.set()
            th.join()
            rate, error = loop.bytes / loop.seconds / GB, loop.error
        conn.send((rate, error))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    chunk = args.chunk_mib << 20
    e_conn, e_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    kv_a, kv_b = ctx.Pipe()
    # This process never touches CUDA: two contexts only, the engine's and the copier's.
    eng = ctx.Process(target=engine, args=(e_child, kv_a, args.kv_mib << 20, chunk))
    cop = ctx.Process(target=copier, args=(c_child, kv_b, chunk))
    eng.start()
    cop.start()
    device = e_conn.recv()
    results: dict = {"device": device,
                     "date": datetime.date.today().isoformat(),
                     "command": "python -m bench.investigations.gemm_probe " + " ".join(
                         f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
                     "gemm": "bf16 8192x8192 @ 8192x8192", "iters": args.iters,
                     "chunk_bytes": chunk, "modes": {}}
    try:
        for mode in args.modes.split(","):
            slow, rates, errors = [], [], []
            for _ in range(args.reps):
                e_conn.send(("alone", args.iters))
                alone = e_conn.recv()[0]
                if mode == "copy_same_process":
                    e_conn.send(("with_own_copies", args.iters))
                    t, rate, error = e_conn.recv()
                else:
                    c_conn.send(mode)
                    assert c_conn.recv() == "running"
                    e_conn.send(("alone", args.iters))
                    t = e_conn.recv()[0]
                    c_conn.send("stop")
                    rate, error = c_conn.recv()
                if error:
                    errors.append(error)
                e_conn.send(("alone", args.iters))
                after = e_conn.recv()[0]
                slow.append(t / ((alone + after) / 2))     # alone before and after: no drift
                rates.append(rate)
            results["modes"][mode] = {"gemm_slowdown": statistics.median(slow),
                                      "gemm_slowdown_reps": slow,
                                      "copy_GBps_during_gemm": statistics.median(rates),
                                      "errors": sorted(set(errors))}
            print(f"{mode:22s} GEMM x{statistics.median(slow):.3f}  copies "
                  f"{statistics.median(rates):6.2f} GB/s  (reps {[round(s, 3) for s in slow]})"
                  f"{'  ERROR ' + errors[0] if errors else ''}", flush=True)
    finally:
        e_conn.send(None)
        c_conn.send(None)
        eng.join(60)
        cop.join(60)
    out_dir = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    os.makedirs(out_dir, exist_ok=True)
    name = results["device"].replace(" ", "_")
    path = os.path.join(out_dir, f"gemm-probe-{name}-{results['date']}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print("written to", path)


if __name__ == "__main__":
    main()
