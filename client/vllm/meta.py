"""What the connector's scheduler role tells its workers each step, and what they answer.

Owns the two per-step messages and nothing else: ``StepMeta`` (scheduler → every worker, built
by ``build_connector_meta``) and ``WorkerAcks`` (each worker → scheduler, summed over ranks by
vLLM's output aggregator). Both are plain data: no daemon calls, no tensors.

Stores are acknowledged by *store batch*: one per (group, step), covering every request's
blocks the step stores (the workers copy them in one job anyway). A batch is done when every
rank has reported it; it is committed only if none of them failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

# The specs are plain data, in a module without vLLM so the scheduler's parts can build them.
from kvpool.client.vllm.specs import LoadSpec, StoreSpec


@dataclass
class StepMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    # Stores that must have finished reading their GPU blocks before this step's forward runs:
    # their blocks were freed (preemption, sliding window) and handed to someone else.
    flush_batches: list[int] = field(default_factory=list)
    # Finished requests whose stores have all landed: every worker reports them as finished
    # sending this step, which lets vLLM free their blocks.
    free_now: list[str] = field(default_factory=list)


@dataclass
class WorkerAcks(KVConnectorWorkerMetadata):
    """Per store batch: how many ranks finished it, and how many of those failed."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerAcks)
        done, failed = dict(self.done), dict(self.failed)
        for t, n in other.done.items():
            done[t] = done.get(t, 0) + n
        for t, n in other.failed.items():
            failed[t] = failed.get(t, 0) + n
        return WorkerAcks(done, failed)

    def __bool__(self) -> bool:
        return bool(self.done)
