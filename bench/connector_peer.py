"""vLLM's own CPU offload connector under vLLM's real scheduler, with fake workers: the peer that
``bench/connector_methods.py`` times beside ours.

``PeerEngine`` loads vLLM 0.33's ``OffloadingConnector`` with its ``CPUOffloadingSpec`` exactly
as an operator configures it (``kv_connector="OffloadingConnector"``,
``kv_connector_extra_config={"cpu_bytes_to_use": ...}``): its scheduler side (the
``OffloadingConnectorScheduler`` over a ``CPUOffloadingManager``, an LRU of CPU chunks) is pure
Python and runs as in an engine. Its worker side is vLLM's ``OffloadingConnectorWorker`` too,
run in the model runner's order, with one part swapped: the spec's ``CPUOffloadingWorker``
copies with CUDA streams and pinned buffers, so a ``HostOffloadingWorker`` stands in for it,
reporting each job it is given as done by the next ``get_finished`` (a GPU's copy of a step's
blocks finishes within a step), with the byte count and a copy time a PCIe link would give, so
the scheduler's transfer statistics run as they do with a GPU. It moves no bytes: as with ours
under ``write_kv=False``, the scheduler side sees the same jobs and completions either way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from bench.vllm_driver import (BS, HEAD, Group, SchedulerDriver, fake_token, kv_cache_config,
                               local_heads, vllm_config)

PEER_CONNECTOR = "OffloadingConnector"
PCIE_BYTES_PER_S = 25e9      # what a copy's reported time assumes (one direction of PCIe 4 x16)


class HostOffloadingWorker(OffloadingWorker):
    """Stands for ``CPUOffloadingWorker`` on a machine without CUDA: every job submitted has
    finished by the next ``get_finished``; ``wait`` has nothing to wait for."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._done: list[TransferResult] = []
        self.stored_blocks = 0
        self.loaded_blocks = 0

    def _finish(self, job_id: int, blocks: int) -> bool:
        nbytes = blocks * self.block_bytes
        self._done.append(TransferResult(job_id, True, nbytes, nbytes / PCIE_BYTES_PER_S))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.stored_blocks += len(src_spec.block_ids)
        return self._finish(job_id, len(src_spec.block_ids))

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        self.loaded_blocks += len(dst_spec.block_ids)
        return self._finish(job_id, len(dst_spec.block_ids))

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        pass


class PeerWorker:
    """One TP rank: vLLM's worker-side ``OffloadingConnector`` over host tensors shaped like
    FlashAttention's per-layer KV cache, its copy engine a ``HostOffloadingWorker``."""

    def __init__(self, cfg, kv_cfg, groups: list[Group]) -> None:
        self.conn = OffloadingConnector(cfg, KVConnectorRole.WORKER, kv_cfg)
        layers = [name for g in groups for name in g.layers]
        heads = local_heads(cfg.parallel_config.tensor_parallel_size)
        shape = (kv_cfg.num_blocks, 2, BS, heads, HEAD)
        self.copies = HostOffloadingWorker(2 * BS * heads * HEAD * 2 * len(layers))
        # The one swap: the spec hands vLLM's worker our copy engine instead of its CUDA one.
        self.conn.connector_worker.spec.get_worker = lambda kv_caches: self.copies
        self.conn.register_kv_caches({name: torch.zeros(shape, dtype=torch.float16)
                                      for name in layers})

    def run(self, so) -> KVConnectorOutput:
        """The connector's worker calls of one step, in vLLM's model runner's order."""
        meta = so.kv_connector_metadata
        self.conn.handle_preemptions(meta)
        self.conn.bind_connector_metadata(meta)
        self.conn.start_load_kv(None)
        self.conn.wait_for_save()
        res = self.conn.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                failed_recving=res.failed_recving,
                                invalid_block_ids=self.conn.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=self.conn.build_connector_worker_meta())
        self.conn.clear_connector_metadata()
        return out

    def close(self) -> None:
        self.conn.shutdown()


class PeerEngine(SchedulerDriver):
    """vLLM's scheduler with ``OffloadingConnector`` (its CPU spec) and one ``PeerWorker``,
    stepped as ``bench/vllm_scheduler.py``'s ``Engine`` steps ours."""

    def __init__(self, root: Path, *, async_scheduling: bool, num_blocks: int,
                 max_num_seqs: int, max_num_batched_tokens: int, cpu_bytes: int,
                 engine_id: str = "peer") -> None:
        self.groups = [Group(["model.layers.0.self_attn", "model.layers.1.self_attn"])]
        cfg = vllm_config(root, KVTransferConfig(
            kv_connector=PEER_CONNECTOR, kv_role="kv_both", engine_id=engine_id,
            kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes}),
            async_scheduling=async_scheduling, tp=1, num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kv_events=False)
        # vLLM's required layout for this connector (its get_required_kvcache_layout).
        kv_cfg = kv_cache_config(self.groups, 1, num_blocks, "LBHNC")
        self.worker = PeerWorker(cfg, kv_cfg, self.groups)   # the workers first, as in vLLM
        super().__init__(cfg, kv_cfg, async_scheduling=async_scheduling)
        self.connector: OffloadingConnector = self.sched.connector
        assert isinstance(self.connector, OffloadingConnector), type(self.connector)
        self.aggregator = KVOutputAggregator(expected_finished_count=1)
        self.load_jobs = 0           # load jobs the scheduler side made (its hits)

    def _execute(self, so) -> ModelRunnerOutput:
        meta = so.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata), type(meta)
        self.load_jobs += len(meta.load_jobs)
        kv_out = self.worker.run(so)
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in ids:
            req = self.sched.requests[r]
            sampled.append([fake_token(req.num_computed_tokens)]
                           if req.num_computed_tokens >= req.num_tokens else [])
        out = self.aggregator.aggregate([ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out)])
        kv = out.kv_connector_output
        if kv is not None:
            self.stats.loaded_reqs.update(kv.finished_recving or ())
        return out

    @property
    def loaded_blocks(self) -> int:
        return self.worker.copies.loaded_blocks

    @property
    def stored_blocks(self) -> int:
        return self.worker.copies.stored_blocks

    def describe(self) -> str:
        sc = self.sched
        return (f"requests={len(sc.requests)} running/waiting={sc.get_request_counts()} "
                f"pending push work={self.connector.has_pending_push_work()} "
                f"queue={len(self._queue)} load jobs={self.load_jobs} "
                f"stored/loaded blocks={self.stored_blocks}/{self.loaded_blocks}")

    def close(self) -> None:
        self.worker.close()
        self.connector.shutdown()
