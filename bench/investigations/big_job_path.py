"""The daemon's own Python around a big job's copy, on CPU, without a GPU or a socket (issue 15).

    python -m bench.investigations.big_job_path [--blocks 1024] [--jobs 200] [--out DIR]
        [--idle-ms 40 --flush-mib 256]

A 1024-block store on an H100 copies for ~40 ms; what no copy hides is the daemon's work before
the first chunk goes out and after the last one lands. This times that work in process: a
``Server`` on a real ``Pool`` (16 KiB slots in 2 MiB extents: 128 slots per extent, the ratio of
2 MiB blocks in 256 MiB extents) with an engine that holds each job until told, so that:

- ``decode``: ``decode_request`` of the job's frame alone;
- ``to_submit``: ``Server._dispatch`` of the frame until the engine's ``submit_*`` is called
  (decode, checks, ``begin_store``/``begin_load``, offsets; the engine's own launch is not in it);
- ``chunk``: each leading chunk's commit as the engine reports it landed (``CopyJobs._landed``, hidden by
  the next chunk's copy on a GPU);
- ``job_done``: ``_job_done`` (the last chunk's commit, counters, the JobDone) and
  ``done_to_sent``: the engine's future resolved -> the reply handed to the socket, which adds the
  loop's wake-up (here a same-thread ``call_soon_threadsafe``).

Stores name tickets from ``reserve`` that the store gives slots by its keys (the one store
path since protocol 2, the vLLM connector's; on a full pool ``to_submit`` includes evicting a
slot per block). The runs that led to chunking (issue 15) also timed stores into slots bound
beforehand by protocol 1's ``prepare_store``, which is gone. Each figure is the median over
``--jobs`` jobs (the first 10% not counted), in microseconds.

On a GPU host a job comes after the daemon slept through a copy whose DMA into host memory
evicted the CPU's caches: the same Python then ran 4-6x slower there (a 64-block lead's 33 us
here took 0.37-0.49 ms on an H200 host). ``--idle-ms`` and ``--flush-mib`` set that scene before
each dispatch, so the cold path can be worked on without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import secrets
import statistics
import time

import numpy as np
from concurrent.futures import Future

from bench.soak.common import wait_for_async
from kvpool.daemon.copy_engine import CopyEngine, JobResult, Mapped
from kvpool.daemon.pool import Pool
from kvpool.daemon.server import Server
from kvpool.shared import protocol as p
from kvpool.shared.config import DaemonConfig
from kvpool.shared.layout import Layout, SegmentPlacement
from kvpool.shared.protocol import CudaRegion

SLOT = 16 << 10


class _Mapped(Mapped):
    def __init__(self, registration) -> None:
        self.registration = registration


class _Held(CopyEngine):
    """Hands back an unresolved future per job and remembers when it was asked."""

    name = "held"

    def __init__(self) -> None:
        self.t_submit = 0
        self.fut: Future | None = None

    def attach(self, registration, peer=None):
        return _Mapped(registration)

    def detach(self, mapped) -> None:
        pass

    def _hold(self) -> Future:
        self.t_submit = time.perf_counter_ns()
        self.fut = Future()
        return self.fut

    def submit_store(self, mapped, block_ids, shard_offsets, wait_event=b"", progress=None,
                     late=None):
        t = self._hold()
        self.progress, self.n = progress, len(block_ids)
        return t

    def submit_load(self, mapped, shard_offsets, block_ids, late=None):
        t = self._hold()
        self.progress, self.n = None, len(block_ids)
        return t


class _Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def run(blocks: int, jobs: int, idle_s: float = 0.0, flush_mib: int = 0
        ) -> dict[str, dict[str, float]]:
    from kvpool.daemon import copy_engine
    from kvpool.daemon.copy_engine import chunk_bounds
    cfg = DaemonConfig(pool_name=f"kvpool-bench-big-{os.getpid()}-{secrets.token_hex(3)}",
                       pool_size=f"{max(64, 16 * blocks * SLOT >> 20)}MiB", extent_size="2MiB")
    pool = Pool.open(cfg)
    times: dict[str, list[int]] = {}
    add = lambda k, v: times.setdefault(k, []).append(v)  # noqa: E731
    try:
        eng = _Held()
        srv = Server(cfg, pool, {CudaRegion: eng})
        replies: list = []
        sent: list[int] = []

        def send(_identity, reply) -> None:
            sent.append(time.perf_counter_ns())
            replies.append(reply)
        srv._send = srv.jobs.send = send                  # no socket
        for name in ("_landed", "_job_done"):             # (CopyJobs, daemon/copy_jobs.py)
            inner = getattr(srv.jobs, name)

            def timed(*a, _inner=inner, _name=name):
                t0 = time.perf_counter_ns()
                _inner(*a)
                add(f"{kind}_{_name.strip('_')}", time.perf_counter_ns() - t0)
            setattr(srv.jobs, name, timed)
        ident = b"\0bench"
        req = iter(range(1, 1 << 40))

        def call(msg) -> object:
            srv._dispatch(ident, _Frame(p.encode(msg)))
            return replies[-1]

        async def registered(msg) -> object:
            """The reply to a RegisterRequest: it comes once the attach (off the loop) is done."""
            n = len(replies)
            srv._dispatch(ident, _Frame(p.encode(msg)))
            await wait_for_async(lambda: len(replies) > n, 10, "the RegisterReply")
            return replies[-1]

        async def finish(nbytes: int) -> None:
            """Land every chunk but the last (their commits run on the loop), then the job."""
            # The chunks the CUDA engine would report (a store's end with a small tail
            # where it has TAIL_BLOCKS).
            tail = getattr(copy_engine, "TAIL_BLOCKS", 0) if eng.progress is not None else 0
            bounds = chunk_bounds(eng.n, cfg.chunk_blocks, *([tail] if tail else []))
            for end in bounds[1:-1]:
                if eng.progress is not None:
                    eng.progress(end)
                    await asyncio.sleep(0)
            n_sent = len(sent)
            t0 = time.perf_counter_ns()
            eng.fut.set_result(JobResult(nbytes))
            while len(sent) == n_sent:
                await asyncio.sleep(0)
            add(f"{kind}_done_to_sent", sent[-1] - t0)
            assert replies[-1].code == 0, replies[-1]

        flush = np.zeros(flush_mib << 20, np.uint8) if flush_mib else None

        def cool() -> None:
            """Before a dispatch: what a job meets on a GPU host, where the daemon sleeps
            through the copy before it (``idle_s``) and the copy's DMA into host memory
            evicts the CPU's caches (``flush_mib`` written)."""
            if flush is not None:
                flush.fill(len(times))
            if idle_s:
                time.sleep(idle_s)

        async def main() -> None:
            nonlocal kind
            call(p.Hello(next(req), p.PROTOCOL_VERSION, p.Role.WORKER, "bench", os.getpid()))
            ns = b"n" * 16
            lay = Layout(16, 1, "bfloat16", (SLOT,), "bench")
            reg = (await registered(p.RegisterRequest(
                next(req), ns, lay, 0, blocks, [CudaRegion("GPU-0", b"h" * 64, blocks * SLOT)],
                [SegmentPlacement(0, 0, SLOT)]))).registration_id
            idx = srv.index
            ids = list(range(blocks))
            for i in range(jobs):
                ks = [b"%08d%08d" % (i, j) for j in range(blocks)]
                slots = idx.reserve(ns, blocks, 99, 0.0)
                msg = p.StoreRequest(next(req), reg, i, ids, slots, keys=ks)
                assert len(slots) == blocks
                frame = p.encode(msg)
                t0 = time.perf_counter_ns()
                p.decode_request(frame)
                add("store_decode", time.perf_counter_ns() - t0)
                kind = "store"
                cool()
                t0 = time.perf_counter_ns()
                srv._dispatch(ident, _Frame(frame))
                add("store_to_submit", eng.t_submit - t0)
                await finish(blocks * SLOT)
                hit = idx.lookup(ns, [ks], True, 99, 0.0)
                frame = p.encode(p.LoadRequest(next(req), reg, i, hit[2][0], ids))
                t0 = time.perf_counter_ns()
                p.decode_request(frame)
                add("load_decode", time.perf_counter_ns() - t0)
                kind = "load"
                cool()
                t0 = time.perf_counter_ns()
                srv._dispatch(ident, _Frame(frame))
                add("load_to_submit", eng.t_submit - t0)
                await finish(blocks * SLOT)
                idx.release_leases(hit[1], 99)
                idx.reset(ns)

        kind = ""
        try:
            import uvloop
            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
    finally:
        pool.close(unlink=True)
    skip = lambda v: v[len(v) // 10:]  # noqa: E731
    return {k: round(statistics.median(skip(v)) / 1e3, 1) for k, v in sorted(times.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="sleep this long before each dispatch (gpu_transfer's jobs come after "
                         "a 40 ms memcpy)")
    ap.add_argument("--flush-mib", type=int, default=0,
                    help="write this many MiB before each dispatch (a copy's DMA into host "
                         "memory evicts the caches)")
    ap.add_argument("--out", default="", help="directory for the JSON (default: none)")
    args = ap.parse_args()
    res = {"device": f"cpu {platform.machine()}, {os.cpu_count()} cores",
           "date": datetime.date.today().isoformat(), "blocks": args.blocks, "jobs": args.jobs,
           "idle_ms": args.idle_ms, "flush_mib": args.flush_mib,
           "us": run(args.blocks, args.jobs, args.idle_ms / 1000, args.flush_mib)}
    print(f"daemon Python around a {args.blocks}-block job ({res['device']}, tickets+keys), "
          f"median us")
    for k, v in res["us"].items():
        print(f"  {k:20s} {v:8.1f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"big-job-path-cpu-{res['date']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"  written to {path}")


if __name__ == "__main__":
    main()
