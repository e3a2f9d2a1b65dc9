"""What the connector's scheduler role tells its workers each step, and what they answer.

Owns the two per-step messages and nothing else: ``StepMeta`` (scheduler → every worker, built
by ``build_connector_meta``) and ``WorkerAcks`` (each worker → scheduler, summed over ranks by
vLLM's output aggregator). Both are plain data: no daemon calls, no tensors.

Stores are named by *tickets*: one per (group, step), covering every request's blocks the
step stores (the workers copy them in one job anyway). A ticket is done when every rank has
reported it; it is committed only if none of them failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(slots=True)
class LoadSpec:
    """Copy pool ``slots`` into GPU ``block_ids`` of one group for one request.

    A request's load may come in several steps (a P/D consumer loads each chunk of the
    prefill's hand-off as it lands): the workers report the request as received only once a
    ``final`` spec has arrived and every load job of the request has completed.
    """

    req_id: str
    group: int          # position in the connector's group list (not vLLM's group index)
    slots: list[int]
    block_ids: list[int]
    # ``block_ids`` cannot be served (``slots`` is empty): report them as load errors, so vLLM
    # recomputes from the first of them and keeps the blocks before it.
    failed: bool = False
    final: bool = True  # no more specs follow for this request's load


@dataclass(slots=True)
class StoreSpec:
    """Copy GPU ``block_ids`` of one group into reserved pool ``slots``, binding each slot to
    its block hash in ``keys`` (the daemon drops a duplicate of a key it already holds)."""

    ticket: int
    group: int
    slots: list[int]
    block_ids: list[int]
    keys: list[bytes] = field(default_factory=list)
    grant: str = ""     # the daemon life that reserved the slots (StoreRequest.grant)


@dataclass
class StepMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    # Stores that must have finished reading their GPU blocks before this step's forward runs:
    # their blocks were freed (preemption, sliding window) and handed to someone else.
    flush_tickets: list[int] = field(default_factory=list)
    # Finished requests whose stores have all landed: every worker reports them as finished
    # sending this step, which lets vLLM free their blocks.
    free_now: list[str] = field(default_factory=list)


@dataclass
class WorkerAcks(KVConnectorWorkerMetadata):
    """Per ticket: how many ranks finished it, and how many of those failed."""

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
