"""The connector's worker role: moves the blocks the scheduler role planned, one rank's share.

Runs in each vLLM worker process (one per TP rank), on the model-runner thread. Owns this
rank's registrations (one per pooled KV-cache group) and its jobs in flight: one batched load
submission per group in ``start_load_kv``, one batched store submission per group in
``wait_for_save``, completions collected without waiting in ``get_transfer_results``. It never
decides what to move and never raises the daemon's absence to vLLM: a load that cannot be
submitted or fails is reported as failed (vLLM recomputes), a store that cannot be submitted is
acknowledged as failed (the block is simply not pooled).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvpool.client.kv_layout import plan_kv_memory
from kvpool.client.vllm_keys import GroupInfo
from kvpool.client.vllm_memory import TransferEvents, block_dim, regions_for
from kvpool.client.vllm_meta import StepMeta, WorkerAcks
from kvpool.shared.errors import DaemonUnavailable, KvpoolError
from kvpool.shared.layout import Layout

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvpool.vllm")

# handle_preemptions waits this long for stores still reading blocks about to be reused.
FLUSH_TIMEOUT_S = 30.0


class WorkerRole:
    def __init__(self, groups: list[GroupInfo], num_blocks: int, tp_rank: int, tp_size: int,
                 client: Any, block_level_errors: bool = True, *, quota_bytes: int = 0,
                 pd_handoff: bool = False) -> None:
        self.groups = groups
        self.quota_bytes = quota_bytes
        self.pd_handoff = pd_handoff
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
        self._load_jobs: dict[int, list[str]] = {}  # job → request ids
        self._load_pending: dict[str, int] = {}     # request → jobs not finished on this rank
        self._load_blocks: dict[str, list[int]] = {}
        self._load_failed: set[str] = set()
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._error_blocks: set[int] = set()
        self._store_jobs: dict[int, list[int]] = {}  # job → tickets
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
                plan = plan_kv_memory(tensors, [block_dim(t, self.num_blocks) for t in tensors],
                                      spans)
            except (ValueError, ImportError) as e:
                logger.warning("kvpool: KV-cache group %d cannot be pooled: %s", g.index, e)
                continue
            layout = Layout(block_tokens=g.block_tokens, tp_size=self.tp_size,
                            dtype=str(tensors[0].dtype).removeprefix("torch."),
                            segment_bytes=plan.segment_bytes, description=g.identity)
            self._tensors.extend(tensors)
            try:
                # A missing daemon raises nothing: the client sends it when the daemon appears.
                self._regs[gi] = self.client.register(
                    g.namespace, layout, self.tp_rank, plan.num_blocks, regions, plan.placement,
                    quota_bytes=self.quota_bytes, handoff=g.handoff if self.pd_handoff else b"")
            except KvpoolError as e:
                logger.error("kvpool refused the registration of group %d: %s", g.index, e)
        self._events = TransferEvents(self._tensors)

    # ---- per step --------------------------------------------------------------------------

    def handle_preemptions(self, meta: StepMeta) -> None:
        """Stores still reading blocks that this step reuses must finish before the forward."""
        if not meta.flush_tickets or not self._store_jobs:
            return
        want = set(meta.flush_tickets)
        jobs = [j for j, tickets in self._store_jobs.items() if want.intersection(tickets)]
        if not jobs:
            return
        try:
            self._consume(self.client.wait(jobs, FLUSH_TIMEOUT_S))
        except TimeoutError as e:
            logger.error("kvpool: stores reading reused blocks did not finish (%s); the pool "
                         "may hold wrong bytes for them", e)

    def start_load_kv(self, meta: StepMeta) -> None:
        by_group: dict[int, tuple[list[int], list[int], list[str]]] = {}
        for spec in meta.loads:
            self._load_blocks.setdefault(spec.req_id, []).extend(spec.block_ids)
            self._load_pending.setdefault(spec.req_id, 0)
            if spec.failed:
                self._load_failed.add(spec.req_id)
            if not spec.slots:
                continue
            slots, bids, reqs = by_group.setdefault(spec.group, ([], [], []))
            slots.extend(spec.slots)
            bids.extend(spec.block_ids)
            if spec.req_id not in reqs:
                reqs.append(spec.req_id)
        for gi, (slots, bids, reqs) in by_group.items():
            reg = self._regs.get(gi)
            try:
                if reg is None:
                    raise KeyError("group not registered")
                job = self.client.submit_load(reg, slots, bids)
            except (DaemonUnavailable, KeyError) as e:
                logger.debug("kvpool: load not submitted (%s); recomputing", e)
                self._load_failed.update(reqs)
                continue
            self._load_jobs[job] = reqs
            for r in reqs:
                self._load_pending[r] += 1
        for spec in meta.loads:
            if self._load_pending.get(spec.req_id) == 0:
                self._finish_load(spec.req_id)

    def wait_for_save(self, meta: StepMeta) -> None:
        if not meta.stores:
            return
        by_group: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for spec in meta.stores:
            slots, bids, tickets = by_group.setdefault(spec.group, ([], [], []))
            slots.extend(spec.slots)
            bids.extend(spec.block_ids)
            tickets.append(spec.ticket)
        event = self._events.store_event()
        for gi, (slots, bids, tickets) in by_group.items():
            reg = self._regs.get(gi)
            try:
                if reg is None:
                    raise KeyError("group not registered")
                job = self.client.submit_store(reg, bids, slots, event)
            except (DaemonUnavailable, KeyError) as e:
                logger.debug("kvpool: store not submitted (%s)", e)
                self._ack(tickets, ok=False)
                continue
            self._store_jobs[job] = tickets

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
            reqs = self._load_jobs.pop(c.job_id, None)
            if reqs is not None:
                if c.ok:
                    self._events.loaded(c.done_event)
                else:
                    logger.debug("kvpool: load job failed (%s); recomputing", c.message)
                for r in reqs:
                    if not c.ok:
                        self._load_failed.add(r)
                    self._load_pending[r] -= 1
                    if self._load_pending[r] == 0:
                        self._finish_load(r)
                continue
            tickets = self._store_jobs.pop(c.job_id, None)
            if tickets is not None:
                self._ack(tickets, c.ok)

    def _finish_load(self, req_id: str) -> None:
        del self._load_pending[req_id]
        blocks = self._load_blocks.pop(req_id, [])
        self._recv_done.add(req_id)
        if req_id in self._load_failed:
            self._load_failed.discard(req_id)
            if self.block_level_errors:
                self._error_blocks.update(blocks)
            else:
                self._recv_failed.add(req_id)

    def _ack(self, tickets: list[int], ok: bool) -> None:
        for t in tickets:
            self._acks.done[t] = self._acks.done.get(t, 0) + 1
            if not ok:
                self._acks.failed[t] = self._acks.failed.get(t, 0) + 1
