"""GPU <-> pool transfer benchmark (issue 3, item 7), measured in one run on one GPU.

End to end through a real kvpoold (request sent -> completion seen, in a worker process that
owns the KV tensors): store, load and simultaneous store+load for the block-outermost and the
per-layer layout of Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks:
2 MiB per block, 1024 blocks per job); the contiguous pinned memcpy limit of the same run
(H2D, D2H, both at once); a bf16 8192^3 GEMM loop alone and while kvpool offloads at full
speed (GEMM in its own process, as in vLLM); the p50 of single-block stores and loads.

Every job's hops are timed through the daemon's ``trace`` file (``KVPOOL_TRACE``) (client send -> daemon
dispatch -> engine launch -> copy done -> event loop -> reply -> client), reported as medians for
single-block jobs (``single_breakdown_us``) and as launch / copy times for the big jobs. The
GEMM is run both in its own process and in the offloading worker's process (the vLLM situation: ``gemm_slowdown_same_process``).

``--engine-compare`` adds a side table that drives the copy engine directly (no daemon) with
each backend forced, to show what the automatic choice picks between.

Writes ``<out>/gpu-<device>-<date>.json`` and a PNG chart beside it.

Run: ``python -m bench.gpu_transfer --out bench/results`` (needs a GPU).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from bench.gpu_worker import LAYOUTS, ShmPool, Worker  # noqa: E402

from kvpool.daemon import cuda  # noqa: E402

GB = 1e9
BLOCK_BYTES = 2 << 20


def memcpy_limits(nbytes: int, reps: int, rounds: int = 3) -> dict[str, float | dict]:
    """Contiguous pinned memcpy GB/s: H2D, D2H, and both directions at once (total). Each limit
    is the best of ``rounds`` rounds, each the median of ``reps`` copies, the three limits taken
    in turn within a round: one slow round (both directions have sampled 70 GB/s on a host that
    gives 85-90) would otherwise set a limit below what kvpool's own copies reach, and ratios
    above 1. ``memcpy_rounds_GBps`` keeps every round's figure."""
    bufs = PinnedBuffers(0, nbytes)
    dev, streams, h = bufs.dev, bufs.streams, bufs.host_at

    def timed(copies) -> float:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for s, (dst, src) in zip(streams, copies):
                cuda.memcpy_async(dst, src, nbytes, s)
            for s in streams[:len(copies)]:
                cuda.stream_synchronize(s)
            times.append(time.perf_counter() - t0)
        return len(copies) * nbytes / statistics.median(times[1:]) / GB

    limits = {"limit_h2d_GBps": [(dev[0], h[0])], "limit_d2h_GBps": [(h[0], dev[0])],
              "limit_bidir_GBps": [(h[0], dev[0]), (dev[1], h[1])]}
    samples: dict[str, list[float]] = {k: [] for k in limits}
    for _ in range(max(1, rounds)):
        for key, copies in limits.items():
            samples[key].append(round(timed(copies), 2))
    out: dict[str, float | dict] = {k: max(v) for k, v in samples.items()}
    out["memcpy_rounds_GBps"] = samples
    bufs.close()
    return out


class PinnedBuffers:
    """What a pinned memcpy limit copies between on GPU ``device``: two device buffers of
    ``nbytes``, a host buffer of twice that in POSIX shared memory registered as the pool is
    (``host_at``: its two halves), and two streams."""

    def __init__(self, device: int, nbytes: int, tag: str = "") -> None:
        self.device = device
        cuda.use_device(device)
        self.host = ShmPool(2 * nbytes, name=f"kvpool-bench-limit-{os.getpid()}{tag}")
        cuda.host_register(self.host.base_address, self.host.nbytes)
        self.dev = [cuda.mem_alloc(nbytes), cuda.mem_alloc(nbytes)]
        self.streams = [cuda.stream_create(), cuda.stream_create()]
        self.host_at = [self.host.base_address, self.host.base_address + nbytes]

    def close(self) -> None:
        cuda.use_device(self.device)
        for s in self.streams:
            cuda.stream_destroy(s)
        for d in self.dev:
            cuda.mem_free(d)
        cuda.host_unregister(self.host.base_address)
        self.host.close()


class LinkReference:
    """A plain pinned memcpy of a job's bytes, timed right before the job: what the link gives
    at that moment, from memory registered as the pool is."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.bufs = PinnedBuffers(0, nbytes, "-ref")

    def seconds(self, kind: str) -> float:
        """One synchronised copy: "store" device -> host, "load" host -> device, "bidir" both
        at once on two streams."""
        b = self.bufs
        copies = {"store": [(b.host_at[0], b.dev[0])], "load": [(b.dev[0], b.host_at[0])],
                  "bidir": [(b.host_at[0], b.dev[0]), (b.dev[1], b.host_at[1])]}[kind]
        t0 = time.perf_counter()
        for s, (dst, src) in zip(b.streams, copies):
            cuda.memcpy_async(dst, src, self.nbytes, s)
        for s in b.streams[:len(copies)]:
            cuda.stream_synchronize(s)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.bufs.close()


def start_daemon(tmp: Path, pool_size: str, env: dict | None = None, tag: str = "",
                 cuda: str = "on") -> tuple[subprocess.Popen, str]:
    sock = str(tmp / f"kvpoold{tag}.sock")
    log = open(tmp / "kvpoold.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.daemon", "--socket", sock,
                             "--pool-name", f"kvpool-bench-{os.getpid()}{tag}", "--pool-size",
                             pool_size, "--cuda", cuda, "--log-level", "info"],
                            stdout=log, stderr=log, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvpoold did not start: {(tmp / 'kvpoold.log').read_text()}")
        time.sleep(0.05)
    profile = os.environ.get("KVPOOL_BENCH_PYSPY")
    if profile:
        # For the daemon's whole life, idle threads too; KVPOOL_BENCH_PYSPY_GIL=1: only the
        # thread holding the GIL, i.e. the Python each thread runs (what keeps the event loop
        # busy, without the sleeps py-spy may count as running).
        # KVPOOL_BENCH_PYSPY_NATIVE=1: C frames too (uvloop's, libzmq's, numpy's).
        gil = bool(os.environ.get("KVPOOL_BENCH_PYSPY_GIL"))
        native = bool(os.environ.get("KVPOOL_BENCH_PYSPY_NATIVE"))
        pyspy_record(proc.pid, f"{profile}{tag}.txt", 250, idle=not gil, log=log,
                     extra=["--gil"] * gil + ["--native"] * native)
    return proc, sock


def pyspy_record(pid: int, path: str | Path, rate: int, idle: bool = False,
                 log=subprocess.DEVNULL, extra: list[str] | None = None) -> subprocess.Popen:
    """py-spy sampling process ``pid`` at ``rate`` Hz, every thread, without pausing it, into
    folded stacks at ``path`` (one line per stack and its count) once it stops (SIGINT or the
    process's end); ``idle``: sleeping threads' samples too; ``extra``: more py-spy flags.
    With ``--native`` in ``extra`` py-spy pauses the process for each sample (it cannot read
    C stacks otherwise): shares hold, timings do not."""
    extra = extra or []
    pause = [] if "--native" in extra else ["--nonblocking"]
    return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-o", str(path), "--format",
                             "raw", "-r", str(rate), "--threads", *pause,
                             *(["--idle"] if idle else []), *extra],
                            stdout=log, stderr=subprocess.STDOUT)


def stop_daemon(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL past 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def gemm_alone_and_with(gemm: Worker, offloader: Worker | None, iters: int, offload_cmd
                        ) -> tuple[float, float | None]:
    gemm.conn.send(("gemm", iters))
    assert gemm.conn.recv() == "ready"
    gemm.conn.send("go")
    t_alone = gemm.conn.recv()
    if offloader is None:
        return t_alone, None
    offloader.conn.send(offload_cmd(3 * t_alone + 1.0))
    time.sleep(0.3)                                  # offload at full speed first
    gemm.conn.send(("gemm", iters))
    assert gemm.conn.recv() == "ready"
    gemm.conn.send("go")
    t_with = gemm.conn.recv()
    rate = offloader.conn.recv()
    if isinstance(rate, Exception):
        raise rate
    # Alone again after: the mean of before and after cancels a drift in clocks.
    gemm.conn.send(("gemm", iters))
    assert gemm.conn.recv() == "ready"
    gemm.conn.send("go")
    return (t_alone + gemm.conn.recv()) / 2, (t_with, rate)


HOPS = ["client->dispatch", "dispatch->queued", "queued->launch", "launch", "copy+sync",
        "done->loop", "loop->sent", "sent->client", "client event+sync"]


def read_trace(path: Path) -> dict[tuple[int, int], list]:
    """The trace's rows by (owner, job id); a job a worker sent as several requests (its lead
    and the rest, ``protocol.LEAD_BLOCKS``) as one row: its blocks summed, its start from the
    first request's, its end from the last's, the chunks of all in turn (so ``gpu_idle``
    shows whether the rest's checks were hidden by the lead's copy)."""
    rows: dict[tuple[int, int], list[list]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            f = line.split()
            rows.setdefault((int(f[0]), int(f[1])), []).append(
                [f[2], int(f[3])] + [int(x) for x in f[4:]])
    return {k: v[0] if len(v) == 1 else _merged(v) for k, v in rows.items()}


def _merged(parts: list[list]) -> list:
    first = min(parts, key=lambda t: t[2])
    last = max(parts, key=lambda t: t[8])
    row = [first[0], sum(t[1] for t in parts), *first[2:6], *last[6:10]]
    if all(len(t) > 10 for t in parts):
        ordered = sorted(parts, key=lambda t: t[2])
        up = [x for t in ordered for x in _chunks(t)[0]]
        down = [x for t in ordered for x in _chunks(t)[1]]
        row += [len(up), *up, *down, *first[11 + 2 * first[10]:]]
    return row


def breakdown(trace: dict, client: dict, kind: str) -> dict[str, float]:
    """Median microseconds of each hop of the ``kind`` jobs in ``client`` stamps."""
    rows = []
    for jid, n0, n_seen, n_end in client["jobs"]:
        t = trace.get((client["owner"], jid))
        if t is None or t[0] != kind:
            continue
        recv, sub, l0, l1, done, cb, sent = t[2:9]
        if not (l0 and l1 and done):
            continue
        rows.append([recv - n0, sub - recv, l0 - sub, l1 - l0, done - l1, cb - done, sent - cb,
                     n_seen - sent, n_end - n_seen])
    if not rows:
        return {}
    med = np.median(np.asarray(rows, dtype=np.float64), axis=0) / 1e3
    return {h: round(float(v), 1) for h, v in zip(HOPS, med)} | {"jobs": len(rows)}


def big_jobs(trace: dict, owner: int, min_blocks: int, client: dict | None = None
             ) -> dict[str, float]:
    """Median hops (ms) of the ``owner``'s jobs of >= ``min_blocks``. A big job is launched in
    chunks (``CHUNK_BLOCKS``), its first one possibly on the event loop's thread inside the
    dispatch: ``launch`` ends when the first chunk is enqueued (the GPU has work), ``copy``
    runs from there to the last chunk's event; ``to_copy`` (request received -> first chunk
    enqueued) and ``after_copy`` (last copy done -> reply sent) are the parts no copy hides.
    With the ``client``'s stamps of one-job stores and loads, also the hops outside the
    daemon: ``client_to_recv`` (before the submit -> the job's start in the daemon) and
    ``sent_to_seen`` (reply sent -> its completion seen by the client). Where the trace has
    each chunk's stamps (the CUDA engine's): ``gpu_idle`` per job, the time the lane had
    nothing enqueued (a chunk launched after the one before it was seen landed)."""
    out = {}
    if client is not None:
        # (stamps of an older worker have no submit stamp: 0)
        seen = {jid: (n0, n1, (n_sub or [0])[0]) for jid, n0, n1, *n_sub in client["jobs"]}
        for kind in ("store", "load"):
            r = [(seen[j], t) for (o, j), t in trace.items() if o == client["owner"]
                 and j in seen and t[0] == kind and t[1] >= min_blocks and t[8]]
            if r:
                ms = lambda xs: round(float(np.median(xs)) / 1e6, 3)  # noqa: E731
                out[f"{kind}_client_to_recv_ms"] = ms([t[2] - n0 for (n0, _, _), t in r])
                out[f"{kind}_sent_to_seen_ms"] = ms([n1 - t[8] for (_, n1, _), t in r])
                if all(ns for (_, _, ns), _ in r):
                    # client_to_recv's two parts: the client's submit call (its event and
                    # the request's encoding), then the transport and the daemon's decode
                    out[f"{kind}_client_submit_ms"] = ms([ns - n0 for (n0, _, ns), _ in r])
                    out[f"{kind}_submitted_to_recv_ms"] = ms([t[2] - ns for (_, _, ns), t in r])
    for kind in ("store", "load"):
        r = [t for (o, _), t in trace.items() if o == owner and t[0] == kind
             and t[1] >= min_blocks and t[4] and t[5] and t[6]]
        if r:
            med = lambda xs: round(float(np.median(xs)) / 1e6, 2)  # noqa: E731
            out[f"{kind}_dispatch_ms"] = med([t[3] - t[2] for t in r])
            out[f"{kind}_queue_ms"] = med([t[4] - t[3] for t in r])
            out[f"{kind}_reply_ms"] = med([t[8] - t[7] for t in r])
            out[f"{kind}_launch_ms"] = round(float(np.median([t[5] - t[4] for t in r])) / 1e6, 2)
            out[f"{kind}_copy_ms"] = round(float(np.median([t[6] - t[5] for t in r])) / 1e6, 2)
            out[f"{kind}_to_copy_ms"] = med([t[5] - t[2] for t in r])
            out[f"{kind}_after_copy_ms"] = med([t[8] - t[6] for t in r])
            # after_copy's two hops: the engine's thread saw the copy end -> the loop runs the
            # job's end; that end (a store's last commit) -> its reply sent
            out[f"{kind}_done_to_loop_ms"] = med([t[7] - t[6] for t in r])
            out[f"{kind}_loop_to_sent_ms"] = med([t[8] - t[7] for t in r])
            if kind == "store" and all(len(t) > 9 and t[9] for t in r):
                # of which: the store's last slots committed (the reply waits for them)
                out["store_end_commit_ms"] = med([t[9] - t[7] for t in r])
            out[f"{kind}_jobs"] = len(r)
            # every job's copy and end-to-end span, in order: a slow rep shows where it lost
            out[f"{kind}_copy_ms_each"] = [round((t[6] - t[5]) / 1e6, 2) for t in r]
            out[f"{kind}_total_ms_each"] = [round((t[8] - t[2]) / 1e6, 2) for t in r]
            chunked = [_chunks(t) for t in r if len(t) > 10]
            if chunked:
                # the lane's pace against the copy's: time with nothing enqueued (a chunk
                # launched after the one before it was seen landed), and when the last chunk
                # went out, from the first chunk's launch
                out[f"{kind}_gpu_idle_ms_each"] = [round(sum(
                    max(0, up[k] - down[k - 1]) for k in range(1, len(down))) / 1e6, 2)
                    for up, down in chunked]
                out[f"{kind}_all_launched_ms"] = med([up[-1] - up[0] for up, _ in chunked])
                # the last chunk's copy as the engine's thread saw it (a store's: its small tail)
                out[f"{kind}_last_chunk_ms"] = med([down[-1] - down[-2] for _, down in chunked
                                                    if len(down) > 1])
                out[f"{kind}_chunks"] = len(chunked[0][0])
            inside = [(t, x) for t in r if len(t) > 10 for x in [_first_launch(t)] if x[0]]
            if inside:
                # to_copy in parts: request received -> the engine has the job (a store's
                # checks and head room, a load's refs) -> its launch starts -> the worker's
                # event seen done -> the first chunk's copies enqueued -> its event recorded
                out[f"{kind}_to_engine_ms"] = med([x[0] - t[2] for t, x in inside])
                out[f"{kind}_engine_to_launch_ms"] = med([t[4] - x[0] for t, x in inside])
                if all(x[1] and x[2] for _, x in inside):
                    out[f"{kind}_launch_to_event_ms"] = med([x[1] - t[4] for t, x in inside])
                    out[f"{kind}_first_enqueue_ms"] = med([x[2] - x[1] for _, x in inside])
                    out[f"{kind}_first_mark_ms"] = med([t[5] - x[2] for t, x in inside])
    return out


def _chunks(t: list) -> tuple[list[int], list[int]]:
    """A trace row's per-chunk stamps: (launched, seen landed), monotonic ns."""
    k = t[10]
    return t[11:11 + k], t[11 + k:11 + 2 * k]


def _first_launch(t: list) -> tuple[int, int, int]:
    """A trace row's stamps after its chunks (a daemon that writes them): the engine took the
    job, the worker's event seen done, the first chunk's copies enqueued; zeros where absent."""
    k = t[10]
    return tuple((t[11 + 2 * k:14 + 2 * k] + [0, 0, 0])[:3])   # type: ignore[return-value]


def seen_p50_us(stamps: dict, kind_jobs: int, first: bool) -> float:
    """p50 of request sent -> completion seen (without the client's event wait and sync)."""
    jobs = stamps["jobs"][:kind_jobs] if first else stamps["jobs"][kind_jobs:]
    return statistics.median([(seen - n0) / 1e3 for _, n0, seen, _ in jobs])


def daemon_run(args, res: dict) -> None:
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    trace_path = tmp / "trace.txt"
    trace_path.unlink(missing_ok=True)
    proc, sock = start_daemon(tmp, args.pool_size, {"KVPOOL_TRACE": str(trace_path)})
    n = args.blocks
    gemm = Worker(0, "block_outer", 4)
    link = LinkReference(n * BLOCK_BYTES)
    try:
        for layout in ("block_outer", "per_layer"):
            w = Worker(0, layout, n)
            try:
                reg = w.call("connect", sock, layout.encode().ljust(16, b"\0")[:16], 0, 1)
                w.call("fill", 1)
                bench = lambda *a: w.call("bench", *a, timeout_s=300)  # noqa: E731
                # loads land in the blocks the stores read: the bytes are the same either way,
                # and one 2 GiB allocation per layout keeps the GPU footprint of the run small
                lo = hi = list(range(n))
                bench("store", lo[:64])                      # warm: registration, kernels
                bench("load", hi[:64])
                # Each job right after a plain memcpy of its bytes the same way (paired): the
                # link's own speed moves in spells (a 2 GiB memcpy has read 0.68-0.85 of its
                # best in some rounds), and the directions alternate so that a spell does not
                # take out every rep of one direction (issue 36).
                jobs = {"store": lambda: bench("store", lo), "load": lambda: bench("load", hi),
                        "bidir": lambda: bench("bidir", lo, hi),
                        "store_8jobs": lambda: bench("store", lo, 8),
                        "load_8jobs": lambda: bench("load", hi, 8)}
                times: dict[str, list[float]] = {k: [] for k in jobs}
                refs: dict[str, list[float]] = {k: [] for k in jobs}
                for _ in range(args.reps):
                    for kind, job in jobs.items():
                        refs[kind].append(link.seconds(kind.split("_")[0]))
                        times[kind].append(job())
                st, ld, bi, st8, ld8 = (times[k] for k in jobs)
                nbytes = n * BLOCK_BYTES
                r = res["layouts"][layout] = {
                    "store_GBps": nbytes / statistics.median(st) / GB,
                    "load_GBps": nbytes / statistics.median(ld) / GB,
                    "bidir_GBps": 2 * nbytes / statistics.median(bi) / GB,
                    "store_8jobs_GBps": nbytes / statistics.median(st8) / GB,
                    "load_8jobs_GBps": nbytes / statistics.median(ld8) / GB,
                    # per kind: the median over reps of (memcpy seconds / job seconds)
                    **{f"{k}_paired_ratio": statistics.median(
                        a / b for a, b in zip(refs[k], times[k])) for k in jobs},
                    "memcpy_ref_s": refs,
                    "store_s": st, "load_s": ld, "bidir_s": bi}
                bench("single", 0, 20)                      # warm the event rings
                sst, sld, stamps = bench("single", 0, args.single_reps)
                tr = read_trace(trace_path)
                r["single_store_breakdown_us"] = breakdown(tr, stamps, "store")
                r["single_load_breakdown_us"] = breakdown(tr, stamps, "load")
                r["big_jobs"] = big_jobs(tr, stamps["owner"], n, bench("job_stamps"))
                r["single_store_seen_p50_us"] = seen_p50_us(stamps, len(sst), True)
                r["single_load_seen_p50_us"] = seen_p50_us(stamps, len(sst), False)
                r["single_store_p50_us"] = statistics.median(sst) * 1e6
                r["single_load_p50_us"] = statistics.median(sld) * 1e6
                r["single_store_p99_us"] = float(np.percentile(sst, 99) * 1e6)
                r["single_load_p99_us"] = float(np.percentile(sld, 99) * 1e6)
                t_alone, (t_with, rate) = gemm_alone_and_with(
                    gemm, w, args.gemm_iters,
                    lambda secs: ("bench", "offload_for", secs, 128, lo, hi))
                r["gemm_alone_s"] = t_alone
                r["gemm_with_offload_s"] = t_with
                r["gemm_slowdown"] = t_with / t_alone
                r["offload_during_gemm_GBps"] = rate * BLOCK_BYTES / GB
                a2, w2, rate2 = bench("gemm_offload", args.gemm_iters, 128, lo, hi)
                r["gemm_same_process_alone_s"] = a2
                r["gemm_same_process_with_offload_s"] = w2
                r["gemm_slowdown_same_process"] = w2 / a2
                r["offload_during_gemm_same_process_GBps"] = rate2 * BLOCK_BYTES / GB
                print(f"[daemon] {layout}: " + json.dumps(
                    {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                     if not isinstance(v, list)}), flush=True)
            finally:
                w.close()
    finally:
        gemm.close()
        link.close()
        stop_daemon(proc)
        res["daemon_log_tail"] = (tmp / "kvpoold.log").read_text(errors="replace")[-4000:]


def engine_compare(args, res: dict) -> None:
    """The copy engine alone, each backend forced: where the automatic choice comes from."""
    from kvpool.daemon.cuda_copy import CudaCopyEngine
    n = args.blocks
    pool = ShmPool(n * BLOCK_BYTES + (64 << 20), name=f"kvpool-bench-eng-{os.getpid()}")
    eng = CudaCopyEngine(pool)
    eng.registration.wait()
    eng._require_ready()
    eng._check_pitched(0)        # before the variants below set it by hand
    res["pitched_copies_checked_ok"] = eng.pitched
    out = res["engine_compare"] = {}
    gemm = Worker(0, "block_outer", 4)
    try:
        for layout in ("block_outer", "per_layer", "per_head"):
            w = Worker(0, layout, n)
            try:
                reg = w.register_request()
                m = eng.attach(reg)
                w.call("fill", 2)
                blocks = np.arange(n)
                offs = np.arange(n, dtype=np.int64) * reg.layout.slot_bytes
                for backend, ctas, per, nstreams in args.variants:
                    eng.backend, eng.max_ctas = backend.replace("dma2d", "dma"), ctas or 32
                    eng.pitched = backend == "dma2d"
                    if backend == "dma2d":
                        eng.dma_2d_batch_ops = per
                    eng.dma_batch_copies, eng.dma_streams = per, nstreams
                    eng.dma_calls_s = 0.0
                    eng.submit_store(m, blocks[:32], offs[:32]).result(120)
                    eng.submit_load(m, offs[:32], blocks[:32]).result(120)
                    row = {}
                    for name, fn in (("store", lambda: eng.submit_store(m, blocks, offs)),
                                     ("load", lambda: eng.submit_load(m, offs, blocks))):
                        ts = []
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            fn().result(120)
                            ts.append(time.perf_counter() - t0)
                        row[f"{name}_GBps"] = n * reg.layout.shard_bytes / statistics.median(ts) / GB
                    t0 = time.perf_counter()
                    f1 = eng.submit_store(m, blocks, offs)
                    f2 = eng.submit_load(m, offs, blocks)
                    f1.result(120), f2.result(120)
                    row["bidir_GBps"] = 2 * n * reg.layout.shard_bytes / (time.perf_counter() - t0) / GB
                    row["dma_call_ms_per_job"] = eng.dma_calls_s * 1e3 / (2 * args.reps + 4)
                    if layout != "per_head" or backend == "dma":
                        row["gemm_slowdown"] = _gemm_vs_engine(gemm, eng, m, blocks, offs,
                                                               args.gemm_iters)
                    key = f"{layout}/{backend}" + (f"/{ctas}cta" if backend == "kernel" else
                                                   f"/{per}x{nstreams}")
                    row["backend_used"] = eng._choose(m, True) if backend != "dma2d" else "dma2d"
                    out[key] = row
                    print(f"[engine] {key}: " + json.dumps(
                        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                        flush=True)
                eng.backend, eng.max_ctas = "auto", 32
                eng.dma_batch_copies, eng.dma_streams = 2048, 4
                eng.pitched, eng.dma_2d_batch_ops = None, 256
                eng.detach(m, wait_s=30)
            finally:
                w.close()
    finally:
        gemm.close()
        eng.close()
        pool.close()


def _gemm_vs_engine(gemm: Worker, eng, m, blocks, offs, iters: int) -> float:
    import threading
    gemm.conn.send(("gemm", iters))
    assert gemm.conn.recv() == "ready"
    gemm.conn.send("go")
    t_alone = gemm.conn.recv()
    stop = threading.Event()

    def offload():
        half = len(blocks) // 2
        while not stop.is_set():
            f1 = eng.submit_store(m, blocks[:half], offs[:half])
            f2 = eng.submit_load(m, offs[half:], blocks[half:])
            f1.result(120), f2.result(120)
    th = threading.Thread(target=offload)
    th.start()
    time.sleep(0.3)
    gemm.conn.send(("gemm", iters))
    assert gemm.conn.recv() == "ready"
    gemm.conn.send("go")
    t_with = gemm.conn.recv()
    stop.set()
    th.join()
    return t_with / t_alone


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0)


def chart(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels, vals, colors = [], [], []
    for layout, r in res.get("layouts", {}).items():
        for d, c in (("store", "tab:blue"), ("load", "tab:orange"), ("bidir", "tab:green")):
            labels.append(f"{layout}\n{d}")
            vals.append(r[f"{d}_GBps"])
            colors.append(c)
    ax.bar(range(len(vals)), vals, color=colors)
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    for key, style in (("limit_d2h_GBps", "--"), ("limit_h2d_GBps", ":"),
                       ("limit_bidir_GBps", "-.")):
        if key in res:
            ax.axhline(res[key], linestyle=style, color="k", linewidth=1,
                       label=f"{key[6:-5]} memcpy limit {res[key]:.1f}")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvpool GPU<->pool through kvpoold, {res['device']}, {res['blocks']} x 2 MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default="/tmp/kvpool-bench")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--limit-rounds", type=int, default=3,
                    help="memcpy limits: best of this many rounds of --reps copies each")
    ap.add_argument("--single-reps", type=int, default=200)
    ap.add_argument("--gemm-iters", type=int, default=200)
    ap.add_argument("--pool-size", default="12GiB")
    ap.add_argument("--engine-compare", action="store_true")
    ap.add_argument("--no-daemon", action="store_true")
    ap.add_argument("--variant", action="append", default=[],
                    help="engine-compare variant backend:ctas:batch_copies:streams "
                         "(e.g. dma:0:4096:2, kernel:32:0:1); repeatable")
    args = ap.parse_args()
    args.variants = [(b, int(c), int(p), int(s)) for b, c, p, s in
                     (v.split(":") for v in args.variant)] or [
        ("dma", 0, 1 << 30, 1), ("dma", 0, 4096, 1), ("dma", 0, 4096, 2), ("dma", 0, 2048, 4),
        ("dma2d", 0, 256, 4), ("dma2d", 0, 1 << 20, 1), ("kernel", 32, 0, 1)]
    dev = device_name()
    res: dict = {"device": dev, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                 "command": " ".join(shlex.quote(a) for a in sys.argv), "blocks": args.blocks,
                 "block_bytes": BLOCK_BYTES, "layouts": {}}
    res.update(memcpy_limits(args.blocks * BLOCK_BYTES, args.reps, args.limit_rounds))
    print("[limits] " + json.dumps({k: round(v, 2) for k, v in res.items()
                                    if k.startswith("limit")}), flush=True)
    if args.engine_compare:
        engine_compare(args, res)
    if not args.no_daemon:
        daemon_run(args, res)
        b, p = res["layouts"]["block_outer"], res["layouts"]["per_layer"]
        res.update({
            # against a memcpy of the same bytes the same way right before each job (paired)
            "store_ratio_block": b["store_paired_ratio"],
            "load_ratio_block": b["load_paired_ratio"],
            "store_ratio_per_layer": p["store_paired_ratio"],
            "load_ratio_per_layer": p["load_paired_ratio"],
            "bidir_ratio": b["bidir_paired_ratio"],
            "bidir_ratio_per_layer": p["bidir_paired_ratio"],
            # against the best of the run's memcpy rounds (the definition before issue 36)
            "store_ratio_block_unpaired": b["store_GBps"] / res["limit_d2h_GBps"],
            "load_ratio_block_unpaired": b["load_GBps"] / res["limit_h2d_GBps"],
            "store_ratio_per_layer_unpaired": p["store_GBps"] / res["limit_d2h_GBps"],
            "load_ratio_per_layer_unpaired": p["load_GBps"] / res["limit_h2d_GBps"],
            "bidir_ratio_unpaired": b["bidir_GBps"] / res["limit_bidir_GBps"],
            "bidir_ratio_per_layer_unpaired": p["bidir_GBps"] / res["limit_bidir_GBps"],
            "gemm_slowdown": b["gemm_slowdown"],
            "gemm_slowdown_per_layer": p["gemm_slowdown"],
            "gemm_slowdown_same_process": b["gemm_slowdown_same_process"],
            "gemm_slowdown_same_process_per_layer": p["gemm_slowdown_same_process"],
            # p50 request sent -> completion seen of one 2 MiB block (the definition),
            # the slower of store and load; "usable" adds the worker's wait on the load's
            # event and a host sync of its stream (an engine only waits on the GPU)
            "single_block_roundtrip_us": max(b["single_store_seen_p50_us"],
                                             b["single_load_seen_p50_us"]),
            "single_block_roundtrip_us_per_layer": max(p["single_store_seen_p50_us"],
                                                       p["single_load_seen_p50_us"]),
            "single_block_usable_us": max(b["single_store_p50_us"], b["single_load_p50_us"]),
        })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-{dev.replace(' ', '_').replace('/', '_')}-{dt.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    if res["layouts"]:
        chart(res, out / f"{stem}.png")
    print("[summary] " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                     for k, v in res.items()
                                     if not isinstance(v, (dict, list)) and k != "daemon_log_tail"}),
          flush=True)


if __name__ == "__main__":
    main()
