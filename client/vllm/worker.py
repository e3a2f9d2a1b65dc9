"""The connector's worker role: moves the blocks the scheduler role planned, one rank's share.

Runs in each vLLM worker process (one per TP rank), on the model-runner thread. Owns this
rank's registrations (one per pooled KV-cache group) and its jobs in flight: one batched load
submission per group in ``start_load_kv``, one batched store submission per group in
``wait_for_save``, completions collected without waiting in ``get_transfer_results``. A
request's load may arrive over several steps (P/D streaming); it is reported received once its
final spec came and all its jobs completed. It never decides what to move and never raises the
daemon's absence to vLLM: the blocks of a load that cannot be submitted or fails are reported
as load errors (vLLM recomputes from the first of them, keeping the blocks before it), a store
that cannot be submitted is acknowledged as failed (the block is simply not pooled).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvpool.client.kv_layout import head_split, plan_kv_memory
from kvpool.client.vllm.keys import GroupInfo
from kvpool.client.vllm.memory import TransferEvents, block_dim, head_dim, regions_for
from kvpool.client.vllm.meta import StepMeta, WorkerAcks
from kvpool.shared.errors import DaemonUnavailable, KvpoolError
from kvpool.shared.layout import Layout

if TYPE_CHECKING:
    import torch

    from kvpool.client.vllm.alloc import ShmKvAllocation

logger = logging.getLogger("kvpool.vllm")

# handle_preemptions waits this long for stores still reading blocks about to be reused.
FLUSH_TIMEOUT_S = 30.0


class WorkerRole:
    def __init__(self, groups: list[GroupInfo], num_blocks: int, tp_rank: int, tp_size: int,
                 client: Any, block_level_errors: bool = True, *, quota_bytes: int = 0,
                 kv_alloc: "ShmKvAllocation | None" = None) -> None:
        self.groups = groups
        # Where vLLM allocates a CPU worker's KV cache (see get_mem_pool_context); holds the
        # shared memory for the worker's life.
        self.kv_alloc = kv_alloc
        self.quota_bytes = quota_bytes
        # vLLM maps failed block ids back to requests only when the model has one KV-cache
        # group; with several it needs the failed request ids instead.
        self.block_level_errors = block_level_errors
        self.num_blocks = num_blocks
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.client = client
        self._regs: dict[int, int] = {}            # group → local registration id
        self._tensors: list["torch.Tensor"] = []
        self._events = TransferEvents([])
        # job → (request, its block ids in the job) for each request in the job
        self._load_jobs: dict[int, list[tuple[str, list[int]]]] = {}
        self._load_pending: dict[str, int] = {}     # request → jobs not finished on this rank
        self._load_final: set[str] = set()          # requests whose last spec has arrived
        self._load_errors: dict[str, list[int]] = {}   # request → blocks that did not load
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._error_blocks: set[int] = set()
        self._store_jobs: dict[int, list[int]] = {}  # job → store batches
        self._acks = WorkerAcks()

    # ---- registration --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        for gi, g in enumerate(self.groups):
            tensors, seen = [], set()
            for name in g.layer_names:
                t = kv_caches.get(name)
                # Layers sharing one cache (KV sharing) are stored once.
                if t is None or (t.data_ptr(), tuple(t.shape)) in seen:
                    continue
                seen.add((t.data_ptr(), tuple(t.shape)))
                tensors.append(t)
            if not tensors:
                continue
            try:
                regions, spans = regions_for(tensors)
                bdims = [block_dim(t, self.num_blocks) for t in tensors]
                plan = plan_kv_memory(tensors, bdims, spans)
            except (ValueError, ImportError) as e:
                why = self.kv_alloc.failure if self.kv_alloc and self.kv_alloc.failure else e
                logger.warning("kvpool: KV-cache group %d cannot be pooled, running without "
                               "kvpool: %s", g.index, why)
                continue
            hdims = [head_dim(t, d) for t, d in zip(tensors, bdims)]
            head_bytes = head_split(tensors, bdims, hdims, g.kv_heads, self.tp_size,
                                    sum(plan.segment_bytes))
            if g.kv_heads and not head_bytes:
                logger.warning("kvpool: the KV of group %d is not laid out as rows of KV heads "
                               "(shape %s, strides %s): its blocks are shared only with engines "
                               "of tensor_parallel_size=%d", g.index, tuple(tensors[0].shape),
                               tensors[0].stride(), self.tp_size)
            layout = Layout(block_tokens=g.block_tokens, tp_size=self.tp_size,
                            dtype=str(tensors[0].dtype).removeprefix("torch."),
                            segment_bytes=plan.segment_bytes, description=g.identity,
                            kv_heads=g.kv_heads if head_bytes else 0, head_bytes=head_bytes)
            self._tensors.extend(tensors)
            try:
                # A missing daemon raises nothing: the client sends it when the daemon appears.
                self._regs[gi] = self.client.register(
                    g.namespace, layout, self.tp_rank, plan.num_blocks, regions, plan.placement,
                    quota_bytes=self.quota_bytes)
            except KvpoolError as e:
                logger.error("kvpool refused the registration of group %d: %s", g.index, e)
        self._events = TransferEvents(self._tensors)

    # ---- per step --------------------------------------------------------------------------

    def handle_preemptions(self, meta: StepMeta) -> None:
        """Stores still reading blocks that this step reuses must finish before the forward."""
        if not meta.flush_batches or not self._store_jobs:
            return
        want = set(meta.flush_batches)
        jobs = [j for j, batches in self._store_jobs.items() if want.intersection(batches)]
        if not jobs:
            return
        try:
            self._consume(self.client.wait(jobs, FLUSH_TIMEOUT_S))
        except TimeoutError as e:
            logger.error("kvpool: stores reading reused blocks did not finish (%s); the pool "
                         "may hold wrong bytes for them", e)

    def start_load_kv(self, meta: StepMeta) -> None:
        by_group: dict[int, tuple[list[int], list[int], list[tuple[str, list[int]]],
                                  list[bytes]]] = {}
        for spec in meta.loads:
            rid = spec.req_id
            self._load_pending.setdefault(rid, 0)
            if spec.final:
                self._load_final.add(rid)
            if spec.failed:
                self._load_errors.setdefault(rid, []).extend(spec.block_ids)
            if not spec.slots:
                continue
            slots, bids, parts, keys = by_group.setdefault(spec.group, ([], [], [], []))
            slots.extend(spec.slots)
            bids.extend(spec.block_ids)
            parts.append((rid, spec.block_ids))
            # Keys in the slots' order; a spec without them (refs only) leaves the job's keys
            # out, and a ref of 0 in it then fails alone.
            keys.extend(spec.keys if len(spec.keys) == len(spec.slots) else
                        [b""] * len(spec.slots))
        for gi, (slots, bids, parts, keys) in by_group.items():
            reg = self._regs.get(gi)
            try:
                if reg is None:
                    raise KeyError("group not registered")
                job = self.client.submit_load(reg, slots, bids,
                                              keys=keys if all(keys) else ())
            except (DaemonUnavailable, KeyError) as e:
                logger.debug("kvpool: load not submitted (%s); recomputing", e)
                for rid, blocks in parts:
                    self._load_errors.setdefault(rid, []).extend(blocks)
                continue
            self._load_jobs[job] = parts
            for rid in {rid for rid, _ in parts}:
                self._load_pending[rid] += 1
        for spec in meta.loads:
            self._maybe_finish_load(spec.req_id)

    def wait_for_save(self, meta: StepMeta) -> None:
        if not meta.stores:
            return
        # One job per group (and per daemon life that granted the tickets: two only around a
        # daemon restart, when the older ones are refused).
        by_group: dict[tuple[int, str], tuple[list[int], list[int], list[int], list[bytes]]] = {}
        for spec in meta.stores:
            tickets, bids, batches, keys = by_group.setdefault((spec.group, spec.granted_by),
                                                               ([], [], [], []))
            tickets.extend(spec.tickets)
            bids.extend(spec.block_ids)
            batches.append(spec.batch)
            keys.extend(spec.keys)
        event = self._events.store_event()
        for (gi, granted_by), (tickets, bids, batches, keys) in by_group.items():
            reg = self._regs.get(gi)
            try:
                if reg is None:
                    raise KeyError("group not registered")
                job = self.client.submit_store(reg, bids, tickets, event, keys=keys,
                                               grant=granted_by)
            except (DaemonUnavailable, KeyError) as e:
                logger.debug("kvpool: store not submitted (%s)", e)
                self._ack(batches, ok=False)
                continue
            self._store_jobs[job] = batches

    def get_transfer_results(self, meta: StepMeta | None) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) on this rank."""
        self._consume(self.client.poll())
        sending = set(meta.free_now) if meta is not None else set()
        recv, self._recv_done = self._recv_done, set()
        failed, self._recv_failed = self._recv_failed, set()
        return sending, recv, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._error_blocks = self._error_blocks, set()
        return out

    def build_worker_meta(self) -> WorkerAcks | None:
        if not self._acks:
            return None
        out, self._acks = self._acks, WorkerAcks()
        return out

    def shutdown(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

    # ---- completions ---------------------------------------------------------------------

    def _consume(self, completions) -> None:
        for c in completions:
            parts = self._load_jobs.pop(c.job_id, None)
            if parts is not None:
                if not c.ok:
                    logger.debug("kvpool: load job failed (%s); recomputing", c.message)
                    for rid, blocks in parts:
                        self._load_errors.setdefault(rid, []).extend(blocks)
                elif c.failed:
                    # Blocks the daemon could not load (evicted since the lookup, held by no
                    # tier): left unwritten, so vLLM must recompute them like a failed load's.
                    logger.debug("kvpool: %d block(s) of a load were gone; recomputing",
                                 len(c.failed))
                    self._fail_positions(parts, c.failed)
                for rid in {rid for rid, _ in parts}:
                    self._load_pending[rid] -= 1
                    self._maybe_finish_load(rid)
                continue
            batches = self._store_jobs.pop(c.job_id, None)
            if batches is not None:
                if not c.ok:   # (counted by the scheduler role as store_failed)
                    logger.debug("kvpool: store job failed (%s)", c.message)
                self._ack(batches, c.ok)

    def _fail_positions(self, parts: list[tuple[str, list[int]]],
                        failed: tuple[int, ...]) -> None:
        """Record the blocks at positions ``failed`` of a load job made of ``parts`` (its
        requests' block ids, in the job's order) as load errors of their requests."""
        bad = sorted(failed)
        at, k = 0, 0
        for rid, blocks in parts:
            end = at + len(blocks)
            while k < len(bad) and bad[k] < end:
                self._load_errors.setdefault(rid, []).append(blocks[bad[k] - at])
                k += 1
            at = end

    def _maybe_finish_load(self, req_id: str) -> None:
        """Report the request received once its last spec came and all its jobs are done."""
        if self._load_pending.get(req_id) != 0 or req_id not in self._load_final:
            return
        del self._load_pending[req_id]
        self._load_final.discard(req_id)
        self._recv_done.add(req_id)
        errors = self._load_errors.pop(req_id, None)
        if errors is not None:
            # Blocks that loaded stay valid: vLLM recomputes from the first failed one.
            if self.block_level_errors and errors:
                self._error_blocks.update(errors)
            else:
                self._recv_failed.add(req_id)

    def _ack(self, batches: list[int], ok: bool) -> None:
        for t in batches:
            self._acks.done[t] = self._acks.done.get(t, 0) + 1
            if not ok:
                self._acks.failed[t] = self._acks.failed.get(t, 0) + 1
