"""``KVPoolConnector``: the vLLM (0.33) KV connector that offloads KV blocks to kvpoold.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvpool/kvpoold.sock"}}'

This module is a facade with no logic of its own: in vLLM's scheduler process it delegates to
``scheduler.SchedulerRole`` (lookups, leases, store planning; its parts are the other modules
of this package), in each worker process to ``worker.WorkerRole`` (registration, batched
loads and stores). Importing it loads neither
the daemon nor any CUDA code; the GPU exporter is imported only when a worker registers CUDA
tensors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool.client.vllm.compat import CompatMixin, check_version
from kvpool.client.vllm.groups import pool_groups
from kvpool.client.vllm.meta import StepMeta
from kvpool.shared.config import (ConnectorConfig, connector_config, parse_size,
                                  unknown_variables)

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpool.client.call_timing import CallTimer
    from kvpool.client.vllm.meta import WorkerAcks
    from kvpool.client.vllm.scheduler import SchedulerRole
    from kvpool.client.vllm.worker import WorkerRole

class KvpoolStats(KVConnectorStats):
    """What kvpool adds to vLLM's KV-transfer stats each logging interval: full blocks not
    stored in the pool, by reason (``kvpool.client.vllm.store_losses``). Built by the scheduler
    side; the workers report none."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvpoolStats":
        for reason, n in other.data.items():
            self.data[reason] = self.data.get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvpool unstored blocks ({reason})": n for reason, n in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# What vLLM's scheduler calls into the connector (timed under KVPOOL_CONNECTOR_TIMING).
SCHEDULER_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "update_connector_output", "request_finished",
                     "request_finished_all_groups")

# kv_connector_extra_config keys that are not ClientConfig fields (shared/config.py has both).
CONNECTOR_KEYS = ConnectorConfig.__struct_fields__


def _tp_rank() -> int:
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_rank()
    return 0


def _apply_load_failure_policy(kv_transfer_config: Any, policy: str) -> None:
    """Make vLLM recompute blocks whose load failed, unless told to keep its policy.

    vLLM's default ``kv_load_failure_policy`` is "fail": a failed load fails the request. For a
    cache that is the wrong answer (a daemon restarted mid-load would fail requests the engine
    can simply recompute), so the connector switches it to "recompute" before vLLM's scheduler
    reads it (the scheduler builds its connector first). ``load_failure_policy: "fail"`` in the
    extra config (or ``KVPOOL_LOAD_FAILURE_POLICY``) leaves vLLM's setting alone.
    """
    if policy == "recompute":
        kv_transfer_config.kv_load_failure_policy = "recompute"


class KVPoolConnector(CompatMixin, KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError("KVPoolConnector does not support pipeline parallelism yet: each "
                             "stage holds different layers (use tensor parallelism)")
        assert kv_cache_config is not None, "vLLM 0.33 passes kv_cache_config to connectors"
        config, settings = connector_config(
            self._kv_transfer_config.kv_connector_extra_config or {})
        _apply_load_failure_policy(self._kv_transfer_config, settings.load_failure_policy)
        if role == KVConnectorRole.SCHEDULER:
            # Once per engine: a misspelled KVPOOL_* variable would otherwise do nothing, quietly.
            for warning in [w for w in (check_version(),) if w] + unknown_variables():
                logging.getLogger("kvpool.vllm").warning("kvpool: %s", warning)
        model = pool_groups(vllm_config, kv_cache_config, {"model_id": settings.model_id})
        groups = model.groups
        engine_id = self._kv_transfer_config.engine_id or ""
        quota_bytes = parse_size(settings.quota)
        # A stream that stalls reports its missing blocks as load errors, which vLLM's "fail"
        # policy turns into a failed request: there, wait for the whole hand-off instead.
        pd_stream = settings.pd_stream if settings.pd_stream is not None else (
            self._kv_transfer_config.kv_load_failure_policy != "fail")
        self.scheduler: SchedulerRole | None = None
        self.worker: WorkerRole | None = None
        self._timer: CallTimer | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvpool.client.call_timing import maybe_time
            from kvpool.client.scheduler import SchedulerClient
            from kvpool.client.vllm.budgets import Budgets
            from kvpool.client.vllm.lazy_store import horizon_for
            from kvpool.client.vllm.parts import RoleSettings
            from kvpool.client.vllm.scheduler import SchedulerRole

            self._timer = maybe_time(self, SCHEDULER_METHODS, config.connector_timing)
            client = SchedulerClient(config, name=f"vllm scheduler {engine_id}",
                                     engine_id=engine_id)
            for note in model.notes:
                logging.getLogger("kvpool.vllm").info("kvpool: %s", note)
            role_settings = RoleSettings(
                groups, Budgets.from_config(config), world_size=pc.world_size,
                kv_producer=self._kv_transfer_config.kv_role == "kv_producer",
                engine_id=engine_id, tp_size=pc.tensor_parallel_size, pd_stream=pd_stream,
                events_enabled=bool(getattr(vllm_config.kv_events_config,
                                            "enable_kv_cache_events", False)),
                store_policy=config.store_policy,
                store_min_prefix_tokens=config.store_min_prefix_tokens,
                horizon_blocks=horizon_for(vllm_config, kv_cache_config),
                refusal=model.refusal)
            self.scheduler = SchedulerRole(
                client, role_settings,
                self._timer.line_log("store_steps") if self._timer is not None else None)
        else:
            from kvpool.client.vllm.worker import WorkerRole
            from kvpool.client.worker import WorkerClient

            rank = _tp_rank()
            client = WorkerClient(config, name=f"vllm worker tp{rank} {engine_id}",
                                  engine_id=engine_id)
            # A CPU worker's KV cache would land in private memory kvpoold cannot map: vLLM
            # allocates it inside get_mem_pool_context(), which places it in /dev/shm.
            kv_alloc = None
            if vllm_config.device_config.device_type == "cpu":
                from kvpool.client.vllm.alloc import ShmKvAllocation

                kv_alloc = ShmKvAllocation([t.size for t in kv_cache_config.kv_cache_tensors])
            self.worker = WorkerRole(groups, kv_cache_config.num_blocks, rank,
                                     pc.tensor_parallel_size, client,
                                     block_level_errors=len(kv_cache_config.kv_cache_groups) == 1,
                                     quota_bytes=quota_bytes, kv_alloc=kv_alloc)

    @property
    def requires_kv_delivery(self) -> bool:
        # As kv_both this is a best-effort cache (a dropped store is a later miss); as a P/D
        # producer its stores are the hand-off.
        return self._kv_transfer_config.kv_role == "kv_producer"

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        # Block-outermost: one block of every layer is one contiguous run, one copy per block.
        # Only a preference: vLLM keeps the backend's layout when it cannot use this one, and
        # every layout works (registration describes whatever the tensors are).
        return "BLHNC"

    # ---- worker side ---------------------------------------------------------------------

    def get_mem_pool_context(self) -> "AbstractContextManager | None":
        return self.worker.kv_alloc if self.worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None and isinstance(kv_connector_metadata, StepMeta)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return   # loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor",
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return   # stores are submitted once per step, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        meta = self._connector_metadata if isinstance(self._connector_metadata, StepMeta) else None
        sending, recving, failed = self.worker.get_transfer_results(meta)
        return KVConnectorTransferResults(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> "WorkerAcks | None":
        return self.worker.build_worker_meta() if self.worker is not None else None

    def _meta(self) -> StepMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMeta)
        return meta

    # ---- scheduler side ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: "Request") -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def get_kv_connector_stats(self) -> KvpoolStats | None:
        if self.scheduler is None:
            return None
        got = self.scheduler.losses.take_interval()
        return KvpoolStats(data=got) if got else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvpoolStats:
        return KvpoolStats(data=dict(data or {}))

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        assert self.scheduler is not None
        return self.scheduler.reset_cache()

    def shutdown(self) -> None:
        if self._timer is not None:
            self._timer.dump()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
