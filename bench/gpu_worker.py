"""A stand-in vLLM worker for GPU tests and the GPU benchmark: a separate process that owns KV
tensors on one GPU, exports them over CUDA IPC and answers commands over a pipe.

Layouts are given as one contiguous allocation ``[lead, num_blocks, inner]`` in bytes (all the
vLLM shapes reduce to this): per-layer FlashAttention ``[L, 2, NB, N, H, C]`` has lead = 2L
segments of N*H*C*2 bytes; block-outermost ``[NB, L, 2, N, H, C]`` has lead = 1; MLA
``[L, NB, N, 576]`` has lead = L. Segment ``i`` of block ``b`` sits at ``(i*NB + b) * inner``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.shm_pool import ShmPool  # noqa: F401 (imported from here by the GPU tests)

# name -> (lead segments, inner bytes) for a 16-token block of Llama-3.1-8B (8 KV heads,
# head dim 128, bf16) or DeepSeek-style MLA (576 latent, bf16), as one rank of TP=1 holds it.
LAYOUTS = {
    "per_layer": (64, 16 * 8 * 128 * 2),        # LBNHC-style: 64 x 32 KiB per block
    "block_outer": (1, 64 * 16 * 8 * 128 * 2),  # BLNHC-style: one 2 MiB chunk per block
    "block_heads": (1, 64 * 8 * 16 * 128 * 2),  # BLHNC-style: one 2 MiB chunk, heads outside tokens
    "per_head": (512, 16 * 128 * 2),            # LHBNC-style: 512 x 4 KiB per block
    "mla": (61, 16 * 576 * 2),                  # 61 layers x 18 KiB per block
}
# name -> (KV heads of the model, bytes of one head's cell, whether segments are per head): how
# the bytes above split into heads for head-split layouts (a rank at TP=t holds kv_heads / t
# heads: fewer bytes per segment, or fewer segments where each segment is one head).
HEADS = {
    "per_layer": (8, 128 * 2, False),           # cell: one token's K (or V) of a head
    "block_outer": (8, 128 * 2, False),
    "block_heads": (8, 16 * 128 * 2, False),    # cell: all 16 tokens of a head
    "per_head": (8, 16 * 128 * 2, True),
    "mla": (1, 16 * 576 * 2, False),            # one latent, the same on every rank
}


def local_shape(layout: str, tp_size: int) -> tuple[int, int]:
    """(lead segments, inner bytes) of one rank's part at ``tp_size`` (replicated heads: one)."""
    lead, inner = LAYOUTS[layout]
    heads, _, per_head = HEADS[layout]
    local = max(1, heads // tp_size)
    return (lead * local // heads, inner) if per_head else (lead, inner * local // heads)


def head_range(layout: str, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds (vLLM's split)."""
    heads = HEADS[layout][0]
    if tp_size > heads:
        h = tp_rank * heads // tp_size
        return h, h + 1
    n = heads // tp_size
    return tp_rank * n, (tp_rank + 1) * n


def rank_part(layout: str, full: np.ndarray, tp_size: int, tp_rank: int) -> np.ndarray:
    """Rank ``tp_rank``'s shard bytes of blocks whose TP=1 shard bytes are ``full``
    ([blocks, shard]): a block is rows of one cell per head, so the rank's part is its head
    range of every row."""
    heads, cell, _ = HEADS[layout]
    h0, h1 = head_range(layout, tp_size, tp_rank)
    rows = full.reshape(len(full), -1, heads, cell)
    return np.ascontiguousarray(rows[:, :, h0:h1, :]).reshape(len(full), -1)


def join_parts(layout: str, parts: list[np.ndarray]) -> np.ndarray:
    """The TP=1 shard bytes of blocks from every rank's ``rank_part`` (rank order, TP =
    ``len(parts)`` <= heads)."""
    heads, cell, _ = HEADS[layout]
    n = len(parts[0])
    return np.concatenate([p.reshape(n, -1, heads // len(parts), cell) for p in parts],
                          axis=2).reshape(n, -1)


def gpu_count() -> int:
    """GPUs the driver sees; 0 without a driver (no torch import, so collection stays fast)."""
    from kvpool.daemon import cuda
    try:
        return cuda.device_count()
    except (cuda.CudaUnavailable, cuda.CudaError):
        return 0


@dataclass
class Exported:
    regions: list
    placement: list
    segment_bytes: tuple
    num_blocks: int
    pid: int


def placement_for(lead: int, inner: int, num_blocks: int) -> tuple[list, tuple]:
    from kvpool.shared.layout import SegmentPlacement
    placement = [SegmentPlacement(0, i * num_blocks * inner, inner) for i in range(lead)]
    return placement, (inner,) * lead


def head_layout(layout: str, seg_bytes: tuple, tp_size: int, dtype: str = "uint8") -> Any:
    """The head-split ``Layout`` of one rank of ``layout`` at ``tp_size`` (shared by every TP
    size of it)."""
    from kvpool.shared.layout import Layout
    heads, cell, _ = HEADS[layout]
    return Layout(block_tokens=16, tp_size=tp_size, dtype=dtype, segment_bytes=tuple(seg_bytes),
                  description=f"gpu-test {layout}", kv_heads=heads,
                  head_bytes=cell if heads > 1 else sum(seg_bytes))


def _serve(conn: Any, device: int, layout: str, num_blocks: int, tp_size: int = 1) -> None:
    import torch

    layout_name = layout
    lead, inner = local_shape(layout, tp_size)
    if device < 0:
        # Host shared memory instead of a GPU: dry runs of the tests' and benchmark's flows on
        # a machine without CUDA (bench/pd_handoff.py --dry-run-cpu); same commands.
        from kvpool.client.host_memory import SharedHostMemory
        mem = SharedHostMemory(lead * num_blocks * inner)
        kv = mem.tensor.view(torch.uint8)[:lead * num_blocks * inner]
        regions = [mem.region]
        store_events = _NoEvents()
        gen = torch.Generator()
        sync = _no_sync
    else:
        from kvpool.client.cuda_export import StoreEvents, export_regions
        torch.cuda.set_device(device)
        kv = torch.empty(lead * num_blocks * inner, dtype=torch.uint8, device=f"cuda:{device}")
        regions, _ = export_regions([kv])
        store_events = StoreEvents()
        gen = torch.Generator(device=f"cuda:{device}")
        sync = torch.cuda.synchronize
    view = kv.view(lead, num_blocks, inner)
    placement, seg_bytes = placement_for(lead, inner, num_blocks)
    conn.send(Exported(regions, placement, seg_bytes, num_blocks, os.getpid()))
    client: Any = None
    bench: Any = None
    reg_id = 0
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            conn.send(None)
            return
        if cmd == "fill":            # random bytes, as int64 words (fast on the GPU)
            gen.manual_seed(args[0])
            w = kv.view(torch.int64)
            w.random_(generator=gen)
            sync()
            conn.send(None)
        elif cmd == "poison":
            kv.fill_(args[0])
            sync()
            conn.send(None)
        elif cmd == "blocks":        # the shard bytes of these blocks, segment order
            idx = torch.as_tensor(args[0], device=kv.device)
            conn.send(view[:, idx, :].permute(1, 0, 2).reshape(len(args[0]), -1).cpu().numpy())
        elif cmd == "count":         # bytes equal to ``value`` over the whole cache
            conn.send(int((kv == args[0]).sum().item()))
        elif cmd == "event":         # a store's wait event, recorded after some GPU work
            kv[:16].add_(0)
            conn.send(store_events.record())
        elif cmd == "late_fill":     # (seed, gpu ms) -> a store event recorded after a GPU
            # spin of about ``ms`` and then the fill, returned at once (the event still pending)
            torch.cuda._sleep(int(args[1] * 1.0e6))      # cycles: ~1-2 GHz
            gen.manual_seed(args[0])
            kv.view(torch.int64).random_(generator=gen)
            conn.send(store_events.record())
        elif cmd == "events_round":  # records every store event of the ring once (each one's
            # next record goes through the driver): -> "driver" if that is how they go now
            for _ in range(len(getattr(store_events, "_events", ()))):
                store_events.record()
            sync()
            conn.send("driver" if getattr(store_events, "_raw_stream", None) else "torch")
        elif cmd == "event_done":    # () -> whether the last recorded store event completed
            ring = store_events._events
            conn.send(bool(ring[(store_events._next - 1) % len(ring)].query()))
        elif cmd == "gemm":          # (iterations) -> seconds for the loop, bf16 8192^3
            n = 8192
            a = torch.randn(n, n, device=kv.device, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=kv.device, dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            sync()
            # The same pause before every timed loop: a GEMM loop right after other GPU work
            # runs at lower clocks than one after a pause (bench/investigations/gemm_probe.py, run 10).
            time.sleep(0.3)
            conn.send("ready")
            conn.recv()
            t0 = time.perf_counter()
            for _ in range(args[0]):
                a @ b
            sync()
            conn.send(time.perf_counter() - t0)
        elif cmd == "connect":       # (socket, namespace, tp_rank, tp_size[, heads]) -> reg id
            from kvpool.client.worker import WorkerClient
            from kvpool.shared.config import ClientConfig
            from kvpool.shared.layout import Layout
            sock, namespace, tp_rank, tp_size, *heads = args
            client = WorkerClient(ClientConfig(socket=sock, timeout_ms=10000),
                                  name=f"gpu-test tp{tp_rank}/{tp_size}")
            if heads and heads[0]:     # head-split: shared with every TP size of this layout
                layout = head_layout(layout_name, seg_bytes, tp_size)
            else:
                layout = Layout(block_tokens=16, tp_size=tp_size, dtype="uint8",
                                segment_bytes=tuple(seg_bytes))
            reg_id = client.register(namespace, layout, tp_rank, num_blocks, regions, placement)
            from kvpool.client.scheduler import SchedulerClient
            sched = SchedulerClient(ClientConfig(socket=sock, timeout_ms=10000), name="gpu-test")
            bench = _DaemonBench(client, sched, reg_id, namespace, store_events)
            conn.send(reg_id)
        elif cmd == "bench":         # (method, *args) -> its result; see _DaemonBench
            conn.send(getattr(bench, args[0])(*args[1:]))
        elif cmd == "store":         # (blocks, slots[, keys, grant]) -> (seconds request ->
            # completion, ok, msg); with keys, ``slots`` are reserved tickets bound by the store
            t0 = time.perf_counter()
            ev = store_events.record()
            keys, grant = (args[2], args[3]) if len(args) > 2 else ((), "")
            job = client.submit_store(reg_id, args[0], args[1], ev, keys=keys, grant=grant)
            done = client.wait([job], 60)[0]
            conn.send((time.perf_counter() - t0, done.ok, done.message))
        elif cmd == "load":          # (slots, blocks) -> (seconds, ok, msg); KV usable after
            t0 = time.perf_counter()
            job = client.submit_load(reg_id, args[0], args[1])
            done = client.wait([job], 60)[0]
            dt = time.perf_counter() - t0
            conn.send((dt, done.ok, done.message))
        elif cmd == "stream":        # (kind, [(blocks, slots[, keys, grant])...]) pipelined,
            # -> seconds
            kind, jobs = args
            t0 = time.perf_counter()
            ids = []
            for blocks, slots, *keyed in jobs:
                if kind == "store":
                    keys, grant = keyed if keyed else ((), "")
                    ids.append(client.submit_store(reg_id, blocks, slots, store_events.record(),
                                                   keys=keys, grant=grant))
                else:
                    ids.append(client.submit_load(reg_id, slots, blocks))
            dones = client.wait(ids, 120)
            dt = time.perf_counter() - t0
            conn.send((dt, all(d.ok for d in dones), [d.message for d in dones if not d.ok][:1]))
        elif cmd == "pd_store":      # [(blocks, slots, keys, grant)...]: submit all (reserved
            # slots, bound to their keys by the store), report each completion
            ids = [client.submit_store(reg_id, blocks, slots, store_events.record(), keys=keys,
                                       grant=grant)
                   for blocks, slots, keys, grant in args[0]]
            order = {j: k for k, j in enumerate(ids)}
            left = set(ids)
            while left:
                for c in _some(client, left):
                    left.discard(c.job_id)
                    conn.send(("done", order[c.job_id], c.ok, c.message, time.monotonic_ns()))
            conn.send(("end",))
        elif cmd == "submit_load":   # (slots, blocks) -> job id, not waiting
            conn.send(client.submit_load(reg_id, args[0], args[1]))
        elif cmd == "wait_loads":    # (job ids) -> monotonic ns once every load's KV is usable
            for d in client.wait(args[0], 120):
                if not d.ok:
                    conn.send(RuntimeError(f"load failed: {d.message}"))
                    break
            else:
                conn.send(time.monotonic_ns())
        elif cmd == "mem_free":
            conn.send(torch.cuda.mem_get_info()[0])
        else:
            conn.send(RuntimeError(f"unknown command {cmd}"))


class _NoEvents:
    """Store events of host memory: nothing to order (see TransferEvents)."""

    def record(self, stream: Any = None) -> bytes:
        return b""


def _record_variants() -> dict[str, Any]:
    """Other ways to record a store's event on the current stream, for ``submit_parts``: an
    interprocess event through the driver (no torch), a plain torch event, and the same
    torch interprocess record with its stream looked up once."""
    import torch

    from kvpool.daemon import cuda
    stream = torch.cuda.current_stream()
    handle = stream.cuda_stream
    cuda.use_device(torch.cuda.current_device())
    ipc = cuda.event_create(True, False)
    plain = torch.cuda.Event()
    ipc_torch = torch.cuda.Event(interprocess=True)
    return {"record_driver_ipc_us": lambda: cuda.event_record(ipc, handle),
            "record_torch_plain_us": lambda: plain.record(stream),
            "record_torch_ipc_stream_given_us": lambda: ipc_torch.record(stream)}


def _no_sync() -> None:
    return None


def _some(client: Any, want: set[int]) -> list:
    """At least one completion of ``want`` (blocking on the client's socket for it)."""
    while True:
        got = [c for c in client.poll() if c.job_id in want]
        if got:
            return got
        client._t.wait_readable(0.05)


class _DaemonBench:
    """Timed transfers through kvpoold, measured where an engine would see them: from the
    request being sent to the completion being seen (the KV is usable then).

    Stores take the engine's path: tickets reserved ahead (``SchedulerClient.reserve``, as the
    connector keeps a stock), then keyed stores (``submit_store(..., keys=...)``) that bind each
    ticket to its key and find its slot, evicting where the pool is full, in the store's own
    dispatch: that work is inside the timed span, as it is inside an engine's."""

    def __init__(self, client, sched, reg_id, namespace, store_events) -> None:
        self.client, self.sched, self.reg_id, self.ns = client, sched, reg_id, namespace
        self.store_events = store_events
        self.counter = 0
        self.committed: list[int] = []   # slot refs of the last stored batch (for loads)
        self.committed_keys: list[bytes] = []   # and its keys
        self.prepared_keys: list[bytes] = []
        self.grant = ""                  # the daemon life that granted the tickets
        self.lease: list[int] = []
        # (job id, monotonic ns before its submit, ns its completion was seen, ns its submit
        # call returned) of every one-job ``store`` and ``load``: the client's side of the
        # daemon's KVPOOL_TRACE hops
        self.timed: list[tuple[int, int, int, int]] = []

    def _keys(self, n: int) -> list[bytes]:
        import hashlib
        self.counter += 1
        return [hashlib.blake2b(f"{os.getpid()}-{self.counter}-{i}".encode(),
                                digest_size=16).digest() for i in range(n)]

    def prepare(self, n: int) -> list[int]:
        """``n`` tickets for fresh keys (``prepared_keys``), reserved before the timed span as
        the connector's stock is; raises if the daemon grants fewer."""
        keys = self._keys(n)
        reply = self.sched.reserve(self.ns, n)
        if len(reply.slots) < n:
            raise RuntimeError(f"reserve granted {len(reply.slots)} of {n} tickets")
        self.prepared_keys = keys
        self.grant = reply.daemon_id
        return list(reply.slots)

    def submit_store(self, blocks: list[int], slots: list[int], keys: list[bytes],
                     side: Any = None, event: bool = True) -> int:
        """One keyed store of ``blocks`` into tickets ``slots`` for ``keys``; its job id."""
        return self.client.submit_store(self.reg_id, blocks, slots,
                                        self.store_events.record(side) if event else b"",
                                        keys=keys, grant=self.grant)

    def _commit(self, slots: list[int]) -> None:
        # pin what was just stored, so later stores cannot evict what the loads read
        if self.lease:
            self.sched.release(self.lease)
        reply = self.sched.lookup(self.ns, [self.prepared_keys], pin=True)
        self.lease = list(reply.leases)
        self.committed = list(reply.slots[0])
        self.committed_keys = self.prepared_keys[:len(self.committed)]

    def keys_committed(self) -> list[bytes]:
        """The keys of the last stored batch (leased: what the loads read)."""
        return self.committed_keys

    def fill(self, n: int, blocks_per_job: int, blocks: list[int]) -> int:
        """Store ``n`` blocks of fresh keys (from ``blocks``, over and over), four jobs in
        flight, committed and not leased: pushes a pool past full before a timed run, so that
        its stores evict. Returns the blocks whose jobs succeeded."""
        done, sent, inflight = 0, 0, []
        while sent < n or inflight:
            while sent < n and len(inflight) < 4:
                k = min(blocks_per_job, n - sent, len(blocks))
                slots = self.prepare(k)
                inflight.append((self.submit_store(blocks[:k], slots, self.prepared_keys), k))
                sent += k
            jid, k = inflight.pop(0)
            if self.client.wait([jid], 120)[0].ok:
                done += k
        return done

    def _wait(self, ids: list[int]) -> None:
        for d in self.client.wait(ids, 120):
            if not d.ok:
                raise RuntimeError(f"job failed: {d.message}")

    def store(self, blocks: list[int], jobs: int = 1) -> float:
        """Store ``blocks`` in ``jobs`` equal jobs submitted back to back; seconds."""
        slots = self.prepare(len(blocks))
        per = -(-len(blocks) // jobs)
        t0 = time.perf_counter()
        n0 = time.monotonic_ns()
        keys = self.prepared_keys
        ids = [self.submit_store(blocks[i:i + per], slots[i:i + per], keys[i:i + per])
               for i in range(0, len(blocks), per)]
        n_sub = time.monotonic_ns()
        self._wait(ids)
        dt = time.perf_counter() - t0
        self._timed(ids, n0, n_sub)
        self._commit(slots)
        return dt

    def _timed(self, ids: list[int], n0: int, n_sub: int) -> None:
        if len(ids) == 1:
            self.timed.append((ids[0], n0, time.monotonic_ns(), n_sub))

    def job_stamps(self) -> dict:
        """``timed`` with this client's owner id, for joining with the daemon's trace."""
        return {"owner": self.client._t.owner_id, "jobs": self.timed}

    def submit_parts(self, blocks: list[int], reps: int, idle_s: float) -> dict[str, float]:
        """Median microseconds of a submit's parts on this worker, each after ``idle_s`` of
        sleep (as a big job's copy leaves the worker idle): the store's event record, the
        store's and the load's request built and encoded, and one whole connection check."""
        from kvpool.shared import protocol as p
        keys = self._keys(len(blocks))
        parts: dict[str, list[float]] = {"record_us": [], "store_encode_us": [],
                                         "load_encode_us": [], "connection_check_us": []}
        others = _record_variants() if hasattr(self.store_events, "_events") else {}
        for _ in range(reps):
            for name, record in others.items():     # what the store's record could cost
                time.sleep(idle_s)
                t0 = time.perf_counter()
                record()
                parts.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
            time.sleep(idle_s)
            t0 = time.perf_counter()
            ev = self.store_events.record()
            t1 = time.perf_counter()
            p.encode(p.StoreRequest(1, self.reg_id, 1, list(blocks), list(blocks), ev,
                                    list(keys), self.grant))
            t2 = time.perf_counter()
            p.encode(p.LoadRequest(1, self.reg_id, 1, list(blocks), list(blocks), []))
            t3 = time.perf_counter()
            self.client._t.ensure_connected()
            t4 = time.perf_counter()
            for k, a, b in (("record_us", t0, t1), ("store_encode_us", t1, t2),
                            ("load_encode_us", t2, t3), ("connection_check_us", t3, t4)):
                parts[k].append((b - a) * 1e6)
        return {k: round(float(np.median(v)), 1) for k, v in parts.items()}

    def job_stamps_reset(self) -> None:
        """Forget the jobs timed so far (a profile of the jobs after this alone)."""
        self.timed = []

    def load(self, blocks: list[int], jobs: int = 1) -> float:
        """Load the last stored batch into ``blocks``; seconds."""
        slots = self.committed[:len(blocks)]
        per = -(-len(blocks) // jobs)
        t0 = time.perf_counter()
        n0 = time.monotonic_ns()
        ids = [self.client.submit_load(self.reg_id, slots[i:i + per], blocks[i:i + per])
               for i in range(0, len(blocks), per)]
        n_sub = time.monotonic_ns()
        self._wait(ids)
        dt = time.perf_counter() - t0
        self._timed(ids, n0, n_sub)
        return dt

    def bidir(self, store_blocks: list[int], load_blocks: list[int], jobs: int = 1) -> float:
        """Store one batch and load the previous one at the same time; seconds for both."""
        load_slots = self.committed[:len(load_blocks)]
        slots = self.prepare(len(store_blocks))
        per = -(-len(store_blocks) // jobs)
        t0 = time.perf_counter()
        sids, lids = [], []
        keys = self.prepared_keys
        for i in range(0, len(store_blocks), per):
            sids.append(self.submit_store(store_blocks[i:i + per], slots[i:i + per],
                                          keys[i:i + per]))
            lids.append(self.client.submit_load(self.reg_id, load_slots[i:i + per],
                                                load_blocks[i:i + per]))
        self._wait(sids)
        self._wait(lids)
        dt = time.perf_counter() - t0
        self._commit(slots)
        return dt

    def replay(self, steps: list[tuple[list[int], list[int]]]) -> list[float]:
        """Each step's store of its GPU blocks and load into its GPU blocks (from slots stored
        earlier), submitted together; seconds from the first submit to the last completion,
        per step (0 for a step that moves nothing). For ``bench/store_policy.py``."""
        stored: list[int] = []
        times = []
        for store_blocks, load_blocks in steps:
            if not store_blocks and not load_blocks:
                times.append(0.0)
                continue
            slots = self.prepare(len(store_blocks)) if store_blocks else []
            # (the trace's loads read blocks stored earlier; any committed slots move as much)
            load_slots = stored[:len(load_blocks)]
            load_blocks = load_blocks[:len(load_slots)]
            t0 = time.perf_counter()
            ids = []
            if store_blocks:
                ids.append(self.submit_store(store_blocks, slots, self.prepared_keys))
            if load_blocks and load_slots:
                ids.append(self.client.submit_load(self.reg_id, load_slots, load_blocks))
            self._wait(ids)
            times.append(time.perf_counter() - t0)
            stored.extend(slots)
        return times

    def single(self, block: int, reps: int) -> tuple[list[float], list[float], dict]:
        """Seconds of ``reps`` one-block stores and of ``reps`` one-block loads, and the
        client's side of each job's hop timestamps (owner id, job id, monotonic ns of: before
        submit, completion seen, KV usable) for joining with the daemon's ``KVPOOL_TRACE``."""
        slots = self.prepare(reps)
        st, ld, stamps = [], [], []
        mono = time.monotonic_ns
        for s, key in zip(slots, self.prepared_keys):
            t0 = time.perf_counter()
            n0 = mono()
            jid = self.submit_store([block], [s], [key])
            self._wait([jid])
            n1 = mono()
            st.append(time.perf_counter() - t0)
            stamps.append((jid, n0, n1, n1))
        self._commit(slots)
        for s in self.committed:
            t0 = time.perf_counter()
            n0 = mono()
            jid = self.client.submit_load(self.reg_id, [s], [block + 1])
            done = self.client.wait([jid], 120)[0]
            n1 = mono()
            if not done.ok:
                raise RuntimeError(f"job failed: {done.message}")
            ld.append(time.perf_counter() - t0)
            stamps.append((jid, n0, n1, mono()))
        return st, ld, {"owner": self.client._t.owner_id, "jobs": stamps}

    def gemm_offload(self, iters: int, blocks_per_job: int, store_blocks: list[int],
                     load_blocks: list[int]) -> tuple[float, float, float]:
        """The GEMM in this worker's own process (as in vLLM: the offloading worker is the
        engine): seconds of ``iters`` bf16 8192^3 GEMMs alone, then while another thread of
        this process offloads at full speed, then alone again; returns (alone: the mean of
        both, with, blocks/s moved). The
        offload thread records its store events on a side stream, as a connector does for
        blocks computed earlier, so they never wait for the GEMM queue."""
        import threading

        import torch
        n = 8192
        dev = torch.cuda.current_device()
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

        def loop() -> float:
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            time.sleep(0.3)         # the same pause before each timed loop (see "gemm")
            t0 = time.perf_counter()
            for _ in range(iters):
                a @ b
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        alone = loop()
        side = torch.cuda.Stream()
        out: dict = {}

        def offload() -> None:
            try:
                with torch.cuda.stream(side):
                    out["rate"] = self.offload_for(3 * alone + 1.0, blocks_per_job,
                                                   store_blocks, load_blocks)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                out["error"] = e
        th = threading.Thread(target=offload)
        th.start()
        with_offload = loop()       # (the offload reaches full speed during loop's pause)
        th.join()
        if "error" in out:
            raise out["error"]
        # Alone again after: the mean of before and after cancels a drift in clocks.
        return (alone + loop()) / 2, with_offload, out["rate"]

    def offload_for(self, seconds: float, blocks_per_job: int, store_blocks: list[int],
                    load_blocks: list[int], kinds: str = "both",
                    events: bool | str = True) -> float:
        """Store and load back to back, two jobs in flight each way, for ``seconds``; returns
        blocks/s moved (both directions together). ``kinds`` "stores" or "loads" keeps four
        jobs of one direction in flight; ``events=False`` sends stores without an event,
        ``"side"`` records them on a stream of their own (bench/investigations/gemm_breakdown.py: which
        ingredient slows a GEMM elsewhere)."""
        side = None
        if events == "side":
            import torch
            side = torch.cuda.Stream()
        moved = 0
        t_end = time.perf_counter() + seconds
        t0 = time.perf_counter()
        inflight: list[tuple[int, bool, int]] = []
        k = 0
        load_slots = self.committed
        while time.perf_counter() < t_end or inflight:
            while time.perf_counter() < t_end and len(inflight) < 4:
                i = (k * blocks_per_job) % max(1, len(load_slots) - blocks_per_job)
                if kinds == "stores" or (kinds == "both" and k % 2 == 0):
                    blocks = store_blocks[i:i + blocks_per_job]
                    slots = self.prepare(len(blocks))
                    jid = self.submit_store(blocks, slots, self.prepared_keys, side,
                                            bool(events))
                    inflight.append((jid, False, len(blocks)))
                else:
                    # (as many as the committed set holds: a small one, after ``single``)
                    blocks = load_blocks[i:i + min(blocks_per_job, len(load_slots))]
                    jid = self.client.submit_load(self.reg_id, load_slots[i:i + len(blocks)],
                                                  blocks)
                    inflight.append((jid, True, len(blocks)))
                k += 1
            jid, is_load, n = inflight.pop(0)
            self._wait([jid])
            moved += n
        return moved / (time.perf_counter() - t0)


def start_workers(specs: list[tuple]) -> list["Worker"]:
    """``Worker(*spec)`` for every spec, started together: each spends seconds importing torch
    and making its CUDA context (a TP comparison starts six). Where one fails, the others are
    closed and its error raised."""
    with ThreadPoolExecutor(max(1, len(specs))) as ex:
        futures = [ex.submit(Worker, *spec) for spec in specs]
    errors = [f.exception() for f in futures]
    started = [f.result() for f, e in zip(futures, errors) if e is None]
    if len(started) < len(specs):
        for w in started:
            w.close()
        raise next(e for e in errors if e is not None)
    return started


class Worker:
    """Parent-side handle: ``Worker(device, layout, num_blocks)`` starts the process."""

    def __init__(self, device: int, layout: str, num_blocks: int, tp_size: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.layout = layout
        self.tp_size = tp_size
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, device, layout, num_blocks, tp_size),
                                daemon=True)
        self.proc.start()
        # (the child's end closed here too: a worker that dies starting is then an EOF at
        # once, not a 120 s wait)
        child.close()
        if not self.conn.poll(120):
            raise TimeoutError("GPU worker did not start within 120 s")
        try:
            self.export: Exported = self.conn.recv()
        except EOFError:
            self.proc.join(30)
            raise RuntimeError(f"GPU worker ({device}, {layout}) exited while starting, code "
                               f"{self.proc.exitcode}") from None

    def call(self, *cmd: Any, timeout_s: float = 120) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"GPU worker did not answer {cmd[0]!r} within {timeout_s} s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def register_request(self, namespace: bytes = b"ns", tp_rank: int = 0, tp_size: int = 1,
                         dtype: str = "uint8", heads: bool = False) -> Any:
        from kvpool.shared.layout import Layout
        from kvpool.shared.protocol import RegisterRequest
        e = self.export
        if heads:
            layout = head_layout(self.layout, e.segment_bytes, tp_size, dtype)
        else:
            layout = Layout(block_tokens=16, tp_size=tp_size, dtype=dtype,
                            segment_bytes=tuple(e.segment_bytes))
        return RegisterRequest(req_id=1, namespace=namespace, layout=layout, tp_rank=tp_rank,
                               num_blocks=e.num_blocks, regions=list(e.regions),
                               placement=list(e.placement))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=30)
            except (TimeoutError, EOFError, BrokenPipeError):
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
