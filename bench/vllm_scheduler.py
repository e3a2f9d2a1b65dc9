"""A vLLM engine without a GPU: the real scheduler plus fake workers running our connector.

``Engine`` (a ``bench/vllm_driver.py`` ``SchedulerDriver``) builds a real ``Scheduler`` or
``AsyncScheduler`` (vLLM 0.33, pure Python) that loads ``KVPoolConnector`` through
``kv_connector_module_path`` like the engine core does, and one ``FakeWorker`` per TP rank. A fake worker owns host KV tensors in POSIX shm, runs the
connector's worker role exactly in the order vLLM's model runner does, "computes" KV by writing
a deterministic pattern of (token, position, layer, KV head) into its heads of the scheduled
slots (vLLM's split: ``KV_HEADS`` over the TP ranks, replicated past TP=2), and checks
every block a load brings back against that pattern. ``AsyncScheduler`` is driven with a
two-deep batch queue (step N+1 is scheduled before step N's output is applied), as the engine
core does with async scheduling.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from bench.vllm_driver import (BS, HEAD, KV_HEADS, Group, SchedulerDriver,  # noqa: E402
                               fake_token, kv_cache_config, local_heads, vllm_config)
from kvpool.client.host_memory import SharedHostMemory  # noqa: E402
from kvpool.client.vllm import KVPoolConnector  # noqa: E402
from kvpool.client.vllm.meta import StepMeta  # noqa: E402


def _pattern(token: int, pos: int, layer: int, kv: int, heads: range) -> torch.Tensor:
    """The KV of ``heads`` at (token, position, layer): the same whatever TP holds them."""
    base = token * 7 + pos * 13 + layer * 3 + kv * 5
    return torch.stack([(torch.arange(HEAD, dtype=torch.float16) + (base + h * 11) % 997)
                        for h in heads])


class SlowStores:
    """Makes one worker's store completions arrive ``steps`` steps late, as a copy queued
    behind a busy GPU would; ``wait`` (handle_preemptions) still gets them at once."""

    def __init__(self, role, steps: int) -> None:
        self.role, self.steps, self.step = role, steps, 0
        self.held: list[tuple[int, object]] = []
        client = role.client
        self._poll, self._wait = client.poll, client.wait
        self._passthrough = False
        client.poll, client.wait = self.poll, self.wait

    def poll(self):
        got = self._poll()
        if self._passthrough:
            return got
        out = []
        for c in got:
            if c.job_id in self.role._store_jobs:
                self.held.append((self.step + self.steps, c))
            else:
                out.append(c)
        out += [c for due, c in self.held if due <= self.step]
        self.held = [(due, c) for due, c in self.held if due > self.step]
        return out

    def wait(self, job_ids, timeout_s):
        want = set(job_ids)
        self.role.client._done.extend(c for _, c in self.held if c.job_id in want)
        self.held = [(due, c) for due, c in self.held if c.job_id not in want]
        self._passthrough = True
        try:
            return self._wait(job_ids, timeout_s)
        finally:
            self._passthrough = False


class HeldStores:
    """Holds one worker's store jobs back from the daemon, which commits their blocks only
    once they are let go: ``release`` (by the test) or ``steps`` steps after they were made
    (``steps=None``: only by the test). Stands for a prefill whose copies land over several
    steps; ``fail`` makes the held ones fail instead, as a prefill that dies mid-hand-off.
    ``wait`` (handle_preemptions) lets go of what it waits for at once."""

    def __init__(self, role, steps: int | None) -> None:
        self.steps, self.step = steps, 0
        client = self.client = role.client
        self._submit, self._poll, self._wait = client.submit_store, client.poll, client.wait
        client.submit_store, client.poll, client.wait = self.submit_store, self.poll, self.wait
        self.held: list[tuple[float, int, tuple, dict]] = []   # (due step, our id, call)
        self._ids = itertools.count(-1, -1)     # ours are negative: never a client's id
        self._ours: dict[int, int] = {}         # the client's job id -> ours
        self._done: list = []                    # completions made here (failures)
        self.sent_blocks: list[int] = []         # blocks per job let go, in order
        self._passthrough = False                # inside ``wait``: the client's own ids

    def submit_store(self, *args, **kw) -> int:
        job = next(self._ids)
        due = self.step + self.steps if self.steps is not None else float("inf")
        self.held.append((due, job, args, kw))
        return job

    def release(self, n: int | None = None, want: set[int] | None = None) -> None:
        """Let go of the ``n`` oldest held jobs (all if None), or of those in ``want``."""
        from kvpool.client.worker import JobCompletion
        from kvpool.shared.errors import DaemonUnavailable

        go = [h for h in self.held if want is None or h[1] in want][:n]
        gone = {h[1] for h in go}
        self.held = [h for h in self.held if h[1] not in gone]
        for _, job, args, kw in go:
            try:
                self._ours[self._submit(*args, **kw)] = job
                self.sent_blocks.append(len(args[1]))
            except (DaemonUnavailable, KeyError) as e:
                self._done.append(JobCompletion(job, False, message=str(e)))

    def fail(self) -> None:
        """Every held job fails without reaching the daemon."""
        from kvpool.client.worker import JobCompletion

        self._done += [JobCompletion(job, False, message="the prefill died")
                       for _, job, _, _ in self.held]
        self.held = []

    def tick(self) -> None:
        self.step += 1
        due = {job for d, job, _, _ in self.held if d <= self.step}
        if due:
            self.release(want=due)

    def _map(self, got):
        return [replace(c, job_id=self._ours.pop(c.job_id)) if c.job_id in self._ours else c
                for c in got]

    def poll(self):
        if self._passthrough:
            return self._poll()
        out, self._done = self._done + self._map(self._poll()), []
        return out

    def wait(self, job_ids, timeout_s):
        self.release(want=set(job_ids))
        mine = {o: c for c, o in self._ours.items()}
        # The client's ``wait`` polls through ``poll``, which must then leave its ids as they
        # are (mapped, they matched nothing it waited for and it timed out).
        self._passthrough = True
        try:
            got = self._wait([mine.get(j, j) for j in job_ids if j in mine], timeout_s)
        finally:
            self._passthrough = False
        got = self._map(got)
        got += [c for c in self._done if c.job_id in set(job_ids)]
        self._done = [c for c in self._done if c.job_id not in set(job_ids)]
        by_id = {c.job_id: c for c in got}
        return [by_id[j] for j in job_ids]


class FakeWorker:
    """One TP rank: KV tensors in shm, the connector's worker role, a pattern-writing model."""

    def __init__(self, cfg: VllmConfig, kv_cfg: KVCacheConfig, groups: list[Group], rank: int,
                 block_outermost: bool) -> None:
        self.rank = rank
        tp = cfg.parallel_config.tensor_parallel_size
        local = local_heads(tp)
        first = rank * KV_HEADS // tp if tp > KV_HEADS else rank * local
        self.heads = range(first, first + local)
        self.conn = KVPoolConnector(cfg, KVConnectorRole.WORKER, kv_cfg)
        assert self.conn.worker is not None
        self.conn.worker.tp_rank = rank
        self.groups = groups
        self.layers = [name for g in groups for name in g.layers]
        self.kv = self._allocate(kv_cfg.num_blocks, local, block_outermost)
        self.conn.register_kv_caches(self.kv)
        self.loads: dict[str, list[tuple[int, list[int]]]] = {}   # req → [(group, block ids)]
        self.load_history: dict[str, list[tuple[int, list[int]]]] = {}
        self.verified_blocks = 0

    def _allocate(self, nb: int, local: int, block_outermost: bool) -> dict[str, torch.Tensor]:
        """The attention layers' KV tensors, in one shm segment (``self.mem``)."""
        layers = [name for g in self.groups if g.spec is None for name in g.layers]
        page = 2 * BS * local * HEAD * 2
        self.mem = SharedHostMemory(len(layers) * nb * page)
        flat = self.mem.tensor.view(torch.float16)
        if block_outermost:   # BL...: one block of every layer is contiguous
            full = flat.view(nb, len(layers), 2, BS, local, HEAD)
            return {name: full[:, i] for i, name in enumerate(layers)}
        # LB...: each layer its own region, (num_blocks, 2, bs, H, D)
        full = flat.view(len(layers), nb, 2, BS, local, HEAD)
        return {name: full[i] for i, name in enumerate(layers)}

    def write(self, block_table: tuple[list[int], ...], tokens: list[int], start: int,
              n: int) -> None:
        for gi, g in enumerate(self.groups):
            ids = block_table[gi]
            for p in range(start, start + n):
                bid = ids[p // BS]
                if bid == 0:
                    continue
                for li, name in enumerate(g.layers):
                    layer = self.layers.index(name)
                    for kv in (0, 1):
                        self.kv[name][bid, kv, p % BS] = _pattern(tokens[p], p, layer, kv,
                                                                  self.heads)

    def check_block(self, gi: int, bid: int, index: int, tokens: list[int]) -> None:
        for name in self.groups[gi].layers:
            layer = self.layers.index(name)
            for kv in (0, 1):
                for off in range(BS):
                    p = index * BS + off
                    want = _pattern(tokens[p], p, layer, kv, self.heads)
                    got = self.kv[name][bid, kv, off]
                    assert torch.equal(got, want), (
                        f"rank {self.rank}: loaded block {bid} (request block {index}) layer "
                        f"{name} kv {kv} offset {off} differs from what was stored")
        self.verified_blocks += 1

    def close(self) -> None:
        self.conn.shutdown()
        self.mem.close()


class Engine(SchedulerDriver):
    """A scheduler and ``tp`` fake workers, driven step by step like vLLM's engine core."""

    def __init__(self, root: Path, socket: str, *, async_scheduling: bool, tp: int = 1,
                 num_blocks: int = 128, hybrid: bool = False, engine_id: str = "engine-a",
                 block_outermost: bool = False, max_num_batched_tokens: int = 64,
                 extra: dict | None = None, kv_role: str = "kv_both",
                 load_failure_policy: str = "recompute", slow_stores: int = 0,
                 hold_stores: bool = False, late_stores: int = 0, max_num_seqs: int = 16,
                 write_kv: bool = True, kv_events: bool = True, step_s: float = 0.0,
                 scheduler_first: bool = False, groups: list[Group] | None = None,
                 worker_cls: type[FakeWorker] = FakeWorker) -> None:
        self.groups = groups or ([Group(["model.layers.0.self_attn"]),
                                  Group(["model.layers.1.self_attn"], sliding_window=32)]
                                 if hybrid else
                                 [Group(["model.layers.0.self_attn", "model.layers.1.self_attn"])])
        states = any(g.spec is not None and type(g.spec).__name__ == "MambaSpec"
                     for g in self.groups)
        # A generous timeout: these tests are about correctness on a loaded 2-core machine;
        # the tests about a slow daemon set their own.
        extra_config = {"socket": socket, "timeout_ms": 10000, "reconnect_backoff_ms": 50,
                        **(extra or {})}
        # store_wait_s followed timeout_ms until it had a setting of its own (issue 38); the
        # suites were written against that.
        extra_config.setdefault("store_wait_s", extra_config["timeout_ms"] / 1000)
        self.cfg = vllm_config(
            root, KVTransferConfig(
                kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.client.vllm",
                kv_role=kv_role, engine_id=engine_id, kv_connector_extra_config=extra_config,
                kv_load_failure_policy=load_failure_policy),
            async_scheduling=async_scheduling, tp=tp, num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kv_events=kv_events, mamba_align=states)
        self.kv_cfg = kv_cache_config(self.groups, tp, num_blocks,
                                      "BLNHC" if block_outermost else "LBNHC")
        # vLLM's order: the workers register their KV caches, then the engine core builds
        # the scheduler (and its connector). scheduler_first: the other way round, as after a
        # daemon restart where the scheduler may reconnect before its workers re-register.
        # No priming either way: the first step runs as soon as the engine is built.
        if not scheduler_first:
            self.workers = [worker_cls(self.cfg, self.kv_cfg, self.groups, r, block_outermost)
                            for r in range(tp)]
        super().__init__(self.cfg, self.kv_cfg, async_scheduling=async_scheduling, step_s=step_s)
        self.connector: KVPoolConnector = self.sched.connector
        if scheduler_first:
            self.workers = [worker_cls(self.cfg, self.kv_cfg, self.groups, r, block_outermost)
                            for r in range(tp)]
        # vLLM drains connector events every step; keep a copy for the tests.
        self.events: list = []
        take = self.connector.take_events

        def take_and_keep():
            got = list(take())
            self.events.extend(got)
            return got

        self.connector.take_events = take_and_keep
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        self.slow = [SlowStores(w.conn.worker, slow_stores) for w in self.workers] \
            if slow_stores else []
        # hold_stores: store jobs reach the daemon only when the test lets them go
        # (release_stores); late_stores: that many steps after they were made.
        self.held = [HeldStores(w.conn.worker, late_stores or None) for w in self.workers] \
            if hold_stores or late_stores else []
        # write_kv=False (benchmarks): the fake model writes no KV and loads are not checked;
        # the connector and daemon do exactly the same work.
        self.write_kv = write_kv
        self.fail_next_loads = 0   # test hook: make the loads of the next N steps fail
        self._bad_loads: set[str] = set()
        self.flushed_batches = 0   # stores the workers had to finish before blocks were reused

    # ---- requests ------------------------------------------------------------------------

    def release_stores(self, n: int | None = None, *, from_now_on: bool = False) -> None:
        """Let the ``n`` oldest held store jobs of every rank go to the daemon; with
        ``from_now_on``, every later one goes out at once too."""
        for h in self.held:
            h.release(n)
            if from_now_on:
                h.steps = 0

    def fail_stores(self) -> None:
        """Make every held store job fail, as if this engine died before they were copied."""
        for h in self.held:
            h.fail()

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus
        self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    # ---- stepping ------------------------------------------------------------------------

    def _execute(self, so) -> ModelRunnerOutput:
        meta = so.kv_connector_metadata
        assert isinstance(meta, StepMeta)
        ids = list(so.num_scheduled_tokens)
        for rid, n in so.num_scheduled_tokens.items():
            self.stats.scheduled[rid] = self.stats.scheduled.get(rid, 0) + n
        outs = []
        self.flushed_batches += len(meta.flush_batches)
        for slow in self.slow:
            slow.step += 1
        for held in self.held:
            held.tick()
        if self.fail_next_loads and meta.loads:
            self._break_loads(meta)
            self.fail_next_loads -= 1
        for w in self.workers:
            w.conn.handle_preemptions(meta)
            w.conn.bind_connector_metadata(meta)
            for spec in meta.loads:
                w.loads.setdefault(spec.req_id, []).append((spec.group, list(spec.block_ids)))
                if spec.block_ids:
                    w.load_history.setdefault(spec.req_id, []).append(
                        (spec.group, list(spec.block_ids)))
            w.conn.start_load_kv(None)
            for rid, n in so.num_scheduled_tokens.items() if self.write_kv else ():
                req = self.sched.requests[rid]
                start = req.num_computed_tokens - n
                tokens = list(req.all_token_ids)
                tokens += [fake_token(p) for p in range(len(tokens), start + n)]
                w.write(self.sched.kv_cache_manager.get_block_ids(rid), tokens, start, n)
            w.conn.wait_for_save()
            res = w.conn.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=w.conn.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=w.conn.build_connector_worker_meta())
            if self.write_kv:
                self._verify_loads(w, res.finished_recving, res.failed_recving,
                                   kv_out.invalid_block_ids)
            w.conn.clear_connector_metadata()
            sampled = []
            for r in ids:
                req = self.sched.requests[r]
                sampled.append([fake_token(req.num_computed_tokens)]
                               if req.num_computed_tokens >= req.num_tokens else [])
            outs.append(ModelRunnerOutput(req_ids=ids,
                                          req_id_to_index={r: k for k, r in enumerate(ids)},
                                          sampled_token_ids=sampled,
                                          kv_connector_output=kv_out))
        out = self.aggregator.aggregate(outs)
        kv = out.kv_connector_output
        if kv is not None:
            bad = set(kv.failed_recving or ())
            for rid in kv.finished_recving or ():
                (self.stats.failed_loads if rid in bad or rid in self._bad_loads
                 else self.stats.loaded_reqs).add(rid)
        return out

    def _break_loads(self, meta: StepMeta) -> None:
        """Point this step's loads at slot refs of another tenancy, so the daemon fails them."""
        for spec in meta.loads:
            spec.slots = [s ^ (0x7FFF << 32) for s in spec.slots]
            self._bad_loads.add(spec.req_id)

    def _verify_loads(self, w: FakeWorker, done: set[str], failed: set[str],
                      invalid: set[int]) -> None:
        for rid in done:
            specs = w.loads.pop(rid, [])
            if rid in failed or rid in self._bad_loads:
                continue
            req = self.sched.requests.get(rid)
            if req is None:
                continue
            tokens = list(req.all_token_ids)
            table = self.sched.kv_cache_manager.get_block_ids(rid)
            for gi, bids in specs:
                for bid in bids:
                    if bid in invalid:
                        continue
                    w.check_block(gi, bid, table[gi].index(bid), tokens)

    def describe(self) -> str:
        """What keeps the engine busy, for failure messages."""
        sc, role = self.sched, self.connector.scheduler
        counts = sc.get_request_counts()
        return (f"requests={list(sc.requests)} running/waiting={counts} "
                f"finished_ids={sc.finished_req_ids} batches={list(role.batches.by_id)} "
                f"release={role.lookups.release} free_now={role._free_now} "
                f"retry={role.lookups.retry} abort={role.batches.abort_tickets} "
                f"kept={role.requests.kept_anywhere()} queue={len(self._queue)} "
                f"backlog={sorted(role.backlog.tracked())} worker store jobs="
                f"{[dict(w.conn.worker._store_jobs) for w in self.workers]} in flight="
                f"{[sorted(w.conn.worker.client._in_flight) for w in self.workers]}")

    # ---- checks --------------------------------------------------------------------------

    def assert_clean(self, info_client=None, timeout_s: float = 10.0) -> None:
        """No request left, no GPU block leaked, no connector state, no lease in the daemon."""
        assert not self.sched.has_requests(), list(self.sched.requests)
        bp = self.sched.kv_cache_manager.block_pool
        assert bp.get_num_free_blocks() == bp.num_gpu_blocks - 1, "GPU blocks leaked"
        role = self.connector.scheduler
        assert role is not None
        # One exit: no part of the connector keeps anything for a request once it left.
        kept = role.requests.kept_anywhere()
        assert not kept, f"connector still keeps state for {kept}"
        assert not role.batches.by_id, f"connector still has batches {list(role.batches.by_id)}"
        if info_client is not None:
            deadline = time.monotonic() + timeout_s
            while True:
                info = info_client.info()
                mine = [c for c in info.clients if c.engine_id == self.engine_id]
                if all(c.leases == 0 and c.jobs_in_flight == 0 for c in mine) \
                        and info.slots_writing == 0:
                    break
                assert time.monotonic() < deadline, f"daemon still holds: {info}"
                time.sleep(0.01)

    @property
    def engine_id(self) -> str:
        return self.cfg.kv_transfer_config.engine_id

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.connector.shutdown()


def run_together(*engines: Engine, until=None, timeout_s: float = 60.0) -> None:
    """Step several engines in turns, as concurrent instances would run, until all are idle
    or ``until()`` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not until() if until is not None else any(e.sched.has_requests() for e in engines):
        for e in engines:
            if e.sched.has_requests():
                e.step()
        assert time.monotonic() < deadline, (
            f"engines did not {'get there' if until else 'settle'} in {timeout_s} s: "
            + "; ".join(f"{e.engine_id}: {e.describe()}" for e in engines))
    if until is None:
        for e in engines:
            e.drain_queue()
