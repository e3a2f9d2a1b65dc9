"""The daemon's own Python per single-block job, on CPU, without a GPU or a socket (issue 15).

    python -m bench.investigations.small_jobs [--jobs 3000] [--out DIR]

Two parts, each the median over ``--jobs`` jobs of one 2 MiB block (the first 10% not counted):

- ``engine``: the CUDA copy engine driven through tests/daemon/test_cuda_copy.py's stand-in
  driver (its batched copies made no-ops, its events always complete), so what is timed is the
  engine's Python and nothing of the GPU: submit -> launch start (on the caller's thread when
  the job launches inline, else the hop to the lane's thread), launch (tables and driver calls
  until the job's event is recorded), and launched -> done (the waiting thread's wake-up and the
  future's callbacks). Layouts: block-outermost (one 1D copy per block) and per-layer with
  pitched copies (one 2D record per block), the two of bench/gpu_transfer.py.
- ``server``: ``Server._dispatch`` of a StoreRequest (naming a ticket reserved before it, not
  timed) and of a LoadRequest, in process, with an engine whose futures are done at once and no
  socket: decode, the ticket's binding to a slot for its key (``open_store``) / begin_load,
  submit, end_store / end_load, metrics, JobDone. What a reply costs the event loop besides its
  sends.

On a GPU host these hops add driver calls (cuMemcpyBatchAsync, cuEventRecord, cuEventQuery) and
the real socket; bench/gpu_transfer.py's single-block breakdown measures those.
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
from concurrent.futures import Future
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

BLOCK = 2 << 20
LAYOUTS = {"block_outer": (1, BLOCK, False), "per_layer_pitched": (64, BLOCK // 64, True)}


def engine_hops(layout: str, jobs: int) -> dict[str, dict[str, float]]:
    """Median us of each engine hop of 1-block stores and loads (stand-in driver)."""
    import torch
    from tests.daemon import test_cuda_copy as fake_driver

    from kvpool.client.kv_layout import plan_kv_memory
    from kvpool.daemon import cuda_copy
    from kvpool.shared.layout import Layout
    from kvpool.shared.protocol import CudaRegion, RegisterRequest

    lead, inner, pitched = LAYOUTS[layout]
    blocks = 16
    drv = fake_driver.FakeDriver()
    drv.pitched = pitched
    saved = [module.cuda for module in fake_driver.DRIVER_USERS]
    for module in fake_driver.DRIVER_USERS:
        module.cuda = drv
    try:
        kv = np.zeros(lead * blocks * inner, np.uint8)
        drv.memory[b"h" * 64] = kv
        t = torch.from_numpy(kv).view(lead, blocks, inner)
        plan = plan_kv_memory(list(t), [0] * lead, [(kv.ctypes.data, kv.nbytes)])
        pool = fake_driver.HostPool(2 * blocks * BLOCK)
        eng = cuda_copy.CudaCopyEngine(pool, backend="dma", register_pool=False,
                                       dma_2d=pitched)
        eng.trace = True
        reg = RegisterRequest(1, b"n" * 16, Layout(16, 1, "uint8", plan.segment_bytes), 0,
                              plan.num_blocks, [CudaRegion("GPU-0", b"h" * 64, kv.nbytes)],
                              plan.placement)
        m = eng.attach(reg)
        # the copies are not what is timed (a 2 MiB host memmove would be most of it)
        drv.memcpy_batch_async = lambda *_a: None
        drv.memcpy_2d_batch_async = lambda *_a: None
        rows: dict[str, list[list[int]]] = {"store": [], "load": []}
        for i in range(2 * jobs):
            b, off = i % blocks, (i % blocks) * BLOCK
            if i % 2 == 0:
                fut = eng.submit_store(m, np.array([b]), np.array([off]), b"e" * 64)
            else:
                fut = eng.submit_load(m, np.array([off]), np.array([b]))
            fut.result(10)
            t0, l0, l1, done = fut.kvpool_trace
            rows["load" if i % 2 else "store"].append([l0 - t0, l1 - l0, done - l1, done - t0])
        eng.detach(m, 5)
        eng.close()
    finally:
        for module, cuda in zip(fake_driver.DRIVER_USERS, saved):
            module.cuda = cuda
    out = {}
    for kind, r in rows.items():
        med = np.median(np.asarray(r[len(r) // 10:], dtype=np.float64), axis=0) / 1e3
        out[kind] = {k: round(float(v), 1) for k, v in
                     zip(["submit->launch", "launch", "launched->done", "total"], med)}
    return out


def server_job_us(jobs: int) -> dict[str, float]:
    """Median us of ``Server._dispatch`` of a 1-block store and load (done at once)."""
    from bench.soak.common import wait_for_async
    from kvpool.daemon.copy_engine import CopyEngine, JobResult, Mapped
    from kvpool.daemon.pool import Pool
    from kvpool.daemon.server import Server
    from kvpool.shared import protocol as p
    from kvpool.shared.config import DaemonConfig
    from kvpool.shared.layout import Layout, SegmentPlacement
    from kvpool.shared.protocol import CudaRegion

    class _Mapped(Mapped):
        def __init__(self, registration) -> None:
            self.registration = registration

    class _Done(CopyEngine):
        name = "done"

        def attach(self, registration, peer=None):
            return _Mapped(registration)

        def detach(self, mapped) -> None:
            pass

        @staticmethod
        def _done(blocks) -> Future:
            f: Future = Future()
            f.set_result(JobResult(len(blocks) * BLOCK))
            return f

        def submit_store(self, mapped, block_ids, shard_offsets, wait_event=b"", progress=None,
                         late=None):
            return self._done(block_ids)

        def submit_load(self, mapped, shard_offsets, block_ids, late=None):
            return self._done(block_ids)

    class _Frame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    cfg = DaemonConfig(pool_name=f"kvpool-bench-jobs-{os.getpid()}-{secrets.token_hex(3)}",
                       pool_size="256MiB", extent_size="2MiB")
    pool = Pool.open(cfg)
    times: dict[str, list[int]] = {"store": [], "load": []}
    try:
        srv = Server(cfg, pool, {CudaRegion: _Done()})
        replies: list = []
        srv._send = srv.jobs.send = lambda _identity, reply: replies.append(reply)  # no socket
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

        async def run() -> None:
            call(p.Hello(next(req), p.PROTOCOL_VERSION, p.Role.WORKER, "bench", os.getpid()))
            ns = b"n" * 16
            lay = Layout(16, 1, "bfloat16", (BLOCK,), "bench")
            reg = (await registered(p.RegisterRequest(
                next(req), ns, lay, 0, 64, [CudaRegion("GPU-0", b"h" * 64, 64 * BLOCK)],
                [SegmentPlacement(0, 0, BLOCK)]))).registration_id
            for i in range(jobs):
                key = b"%016d" % i
                grant = call(p.ReserveRequest(next(req), ns, 1))
                t0 = time.perf_counter_ns()
                done = call(p.StoreRequest(next(req), reg, i, [i % 64], grant.slots, keys=[key],
                                           grant=grant.daemon_id))
                times["store"].append(time.perf_counter_ns() - t0)
                assert isinstance(done, p.JobDone) and done.code == 0, done
                hit = call(p.LookupRequest(next(req), ns, [[key]], True))
                t0 = time.perf_counter_ns()
                done = call(p.LoadRequest(next(req), reg, i, hit.slots[0], [i % 64]))
                times["load"].append(time.perf_counter_ns() - t0)
                assert isinstance(done, p.JobDone) and done.code == 0, done
                call(p.ReleaseRequest(next(req), hit.leases))
                if i % 50 == 49:
                    call(p.ResetRequest(next(req), ns))

        asyncio.run(run())        # the server's job path asks for the running loop
    finally:
        pool.close(unlink=True)
    return {k: round(statistics.median(v[len(v) // 10:]) / 1e3, 1) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--out", default="", help="directory for the JSON (default: none)")
    args = ap.parse_args()
    res: dict = {"device": f"cpu {platform.machine()}, {os.cpu_count()} cores",
                 "date": datetime.date.today().isoformat(), "jobs": args.jobs,
                 "engine_us": {lay: engine_hops(lay, args.jobs) for lay in LAYOUTS},
                 "server_us": server_job_us(args.jobs)}
    print(f"daemon Python per 1-block job ({res['device']}, {res['date']}), median us")
    for lay, kinds in res["engine_us"].items():
        for kind, hops in kinds.items():
            print(f"  engine {lay:17s} {kind:5s}: " + ", ".join(f"{k} {v}" for k, v in
                                                                 hops.items()))
    print(f"  server dispatch + end (no copy, no socket): store {res['server_us']['store']}, "
          f"load {res['server_us']['load']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"small-jobs-cpu-{res['date']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"  written to {path}")


if __name__ == "__main__":
    main()
