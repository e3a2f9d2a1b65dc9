"""The load and store specs the scheduler side puts in a step's metadata for its workers.

Plain data (no vLLM import, no daemon calls), so the scheduler's parts build them and their
tests read them without vLLM; ``kvpool.client.vllm.meta`` carries them to the workers inside
``StepMeta``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadSpec:
    """Copy the pool slots named by the slot refs ``slots`` (a lookup's answer) into GPU
    ``block_ids`` of one group for one request.

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
    # Per slot, its block's key: the daemon finds a block again by key when its ref went stale
    # or a lower tier holds it (ref 0). Empty: refs only.
    keys: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class StoreSpec:
    """Store GPU ``block_ids`` of one group through the daemon's ``tickets``, one per block:
    the daemon finds each ticket a slot for its key in ``keys`` when the first rank's store
    arrives (and drops a duplicate of a key it already holds). ``batch`` names the store batch
    (one group's stores of one step) that every rank acks."""

    batch: int
    group: int
    tickets: list[int]
    block_ids: list[int]
    keys: list[bytes] = field(default_factory=list)
    granted_by: str = ""   # the daemon life whose grant the tickets came from (StoreRequest.grant)
