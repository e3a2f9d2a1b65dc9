"""The limit kvpool's copies are measured against: N processes copying at once, each with its
own pinned buffers (a GPU's, or host shared memory on the host path), per direction, for
``bench/host_scale.py``. Each process can be bound to its GPU's NUMA node."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.gpu_transfer import PinnedBuffers
from bench.shm_pool import ShmPool
from kvpool.daemon import cuda

GB = 1e9
DIRECTIONS = ("store", "load", "bidir")


def _gpu_copies(device: int, nbytes: int, tag: str) -> tuple[dict[str, list[Callable]], int,
                                                             Callable]:
    """One copy of ``nbytes`` per call, synchronised, for each direction (one stream each way);
    the bytes of one call; and the cleanup."""
    bufs = PinnedBuffers(device, nbytes, tag)
    h, dev, streams = bufs.host_at, bufs.dev, bufs.streams

    def copy(dst: int, src: int, stream: int) -> Callable[[], None]:
        def run() -> None:
            cuda.use_device(device)      # each copying thread needs the context current
            cuda.memcpy_async(dst, src, nbytes, stream)
            cuda.stream_synchronize(stream)
        return run

    d2h, h2d = copy(h[0], dev[0], streams[0]), copy(dev[1], h[1], streams[1])
    return {"store": [d2h], "load": [h2d], "bidir": [d2h, h2d]}, nbytes, bufs.close


def _host_copies(nbytes: int, threads: int, tag: str) -> tuple[dict[str, list[Callable]], int,
                                                               Callable]:
    """The host path's limit: private memory into shared memory (store) and back (load), each
    direction cut over ``threads`` threads as the daemon cuts a job over its copy threads
    (``copy_threads``): with fewer, a host whose cores other processes share gives the limit a
    smaller share of them than the daemon gets."""
    shared = ShmPool(2 * nbytes, name=f"kvpool-scale-limit-{os.getpid()}-{tag}")
    pool = shared.array()
    private = np.ones(2 * nbytes, dtype=np.uint8)
    pool[:] = 1                          # fault every page in before timing
    part = nbytes // threads
    cuts = [(k * part, (k + 1) * part) for k in range(threads)]
    store = [lambda a=a, b=b: np.copyto(pool[a:b], private[a:b]) for a, b in cuts]
    load = [lambda a=a, b=b: np.copyto(private[nbytes + a:nbytes + b], pool[nbytes + a:nbytes + b])
            for a, b in cuts]

    def close() -> None:
        # only the name: numpy views still export the mapping, which goes with the process
        os.unlink(shared.path)
    return {"store": store, "load": load, "bidir": store + load}, part, close


def _copy_for(fns: list[Callable[[], None]], nbytes: int, seconds: float
              ) -> tuple[float, float]:
    """(GB/s, GB per CPU second of this process) of ``fns`` (one copy of ``nbytes`` each) run
    back to back, each on its own thread, for ``seconds`` (numpy copies and ctypes calls
    release the GIL: the threads copy at once)."""
    counts = [0] * len(fns)
    t_end = time.perf_counter() + seconds

    def loop(k: int) -> None:
        while time.perf_counter() < t_end:
            fns[k]()
            counts[k] += 1
    c0 = os.times()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(1, len(fns))]
    for t in threads:
        t.start()
    loop(0)
    for t in threads:
        t.join()
    c1 = os.times()
    gb = sum(counts) * nbytes / GB
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    return gb / (time.perf_counter() - t0), gb / cpu_s if cpu_s > 0 else math.inf


def gpu_numa_node(device: int) -> int:
    """The NUMA node of CUDA GPU ``device``'s PCI function; -1 where the host does not say."""
    import torch
    p = torch.cuda.get_device_properties(device)
    ids = [getattr(p, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None in ids:             # a torch that does not report them
        return -1
    bus = "{:04x}:{:02x}:{:02x}.0".format(*ids)
    try:
        return int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (OSError, ValueError):
        return -1


def bind_to_node(node: int) -> bool:
    """Run this process on NUMA node ``node``'s CPUs, so the pages it touches first land on
    that node; False where the host has no such node."""
    try:
        spec = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return False
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)
    return True


def _limit_proc(device: int, nbytes: int, threads: int, seconds: float, barrier: Any,
                conn: Any) -> None:
    """One of N processes measuring the limit together: every direction starts on a barrier,
    so the N processes' copies overlap. A GPU's process runs on the GPU's NUMA node and so
    copies from memory there: the best placement, what the host can do (the daemon's one pool
    is placed wherever its pages were first touched)."""
    close = None
    try:
        node = -1 if device < 0 else gpu_numa_node(device)
        bound = node >= 0 and bind_to_node(node)
        fns, per_call, close = (_host_copies(nbytes, threads, "h") if device < 0
                                else _gpu_copies(device, nbytes, f"-scale-g{device}"))
        for f in fns["bidir"]:
            f()                          # warm: first-touch, context, DMA setup
        out: dict[str, Any] = {"numa_node": node, "numa_bound": bound}
        for d in DIRECTIONS:
            barrier.wait(120)
            out[d], out[f"{d}_per_cpu_s"] = _copy_for(fns[d], per_call, seconds)
        conn.send(out)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(e)
    finally:
        if close is not None:
            close()


def context(host: bool) -> Any:
    """How helper processes start: forked on the host path (a spawned one imports torch again,
    seconds of a CI machine's two cores), spawned beside CUDA, which a fork cannot inherit."""
    return mp.get_context("fork" if host else "spawn")


def limits(devices: list[int], nbytes: int, threads: int, seconds: float) -> dict[str, Any]:
    """Aggregate GB/s of ``len(devices)`` processes copying at once, per direction."""
    ctx = context(devices[0] < 0)
    barrier = ctx.Barrier(len(devices))
    pipes = [ctx.Pipe() for _ in devices]
    procs = [ctx.Process(target=_limit_proc, args=(d, nbytes, threads, seconds, barrier, child),
                         daemon=True) for d, (_, child) in zip(devices, pipes)]
    for p in procs:
        p.start()
    rows = []
    try:
        for parent, _ in pipes:
            if not parent.poll(120 + 6 * seconds):
                raise TimeoutError("a limit process did not answer")
            r = parent.recv()
            if isinstance(r, Exception):
                raise r
            rows.append(r)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {f"{d}_GBps": sum(r[d] for r in rows) for d in DIRECTIONS} | {
        # bytes per CPU second: what a copy costs, whatever share of the cores it got
        f"{d}_GB_per_cpu_s": statistics.median(r[f"{d}_per_cpu_s"] for r in rows)
        for d in DIRECTIONS} | {
        "per_process_GBps": {d: [round(r[d], 2) for r in rows] for d in DIRECTIONS},
        "numa_node_bound": [r["numa_node"] if r["numa_bound"] else None for r in rows]}


# ---- engines through the daemon ----------------------------------------------------------------
