"""The connector's scheduler side assembled: each part built once, its collaborators passed in.

``build_parts`` is the one place that knows which part talks to which (the arrows below);
``SchedulerRole`` calls it, and so do the parts' tests (``tests/client/vllm/fakes.py`` fakes only
vLLM and the daemon's client). Nothing sets one part on another after construction.

    Requests ── admits / lets go ─► every part below (forget)
    Lookups ──► DaemonLink, PdStream, CommittedKeys      Loads (no collaborator)
    StorePlanner ──► DaemonLink, StoreBatches, Loads, LazyPolicy, StoreLosses
    Backlog ──► StorePlanner, DaemonLink, StoreLosses    StoreBatches ──► DaemonLink, StoreLosses
    LazyPolicy ──► LazyStore, StoreBatches               every part ──► Budgets (its clock)

No vLLM import (the parts are plain Python), no daemon call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.client.vllm.backlog import Backlog
from kvpool.client.vllm.budgets import Budgets
from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.keys import GroupInfo
from kvpool.client.vllm.lazy_store import LazyPolicy, LazyStore
from kvpool.client.vllm.loads import Loads
from kvpool.client.vllm.lookups import Lookups
from kvpool.client.vllm.pd_stream import PdStream
from kvpool.client.vllm.requests import Requests
from kvpool.client.vllm.store_batches import CommittedKeys, StoreBatches
from kvpool.client.vllm.store_losses import StoreLosses
from kvpool.client.vllm.store_planner import StorePlanner


@dataclass(frozen=True)
class RoleSettings:
    """What the scheduler side is built from (``KVPoolConnector`` reads it off vLLM's config
    and ``ClientConfig``)."""

    groups: list[GroupInfo]
    budgets: Budgets = field(default_factory=Budgets.from_config)
    world_size: int = 1            # ranks that each ack every store batch
    kv_producer: bool = False      # kv_role "kv_producer": every request is a P/D hand-off
    engine_id: str = ""            # named in a hand-off's parameters
    tp_size: int = 1
    pd_stream: bool = True         # P/D consumers load a hand-off chunk by chunk
    events_enabled: bool = True    # vLLM publishes KV events: build them from committed stores
    store_policy: str = "eager"    # or "lazy" (store_planner.py says how)
    store_min_prefix_tokens: int = 0
    # How far one schedule() reaches into vLLM's free queue (lazy_store.horizon_for; 0:
    # unknown): the lazy policy's eviction horizon, and the eager planner's sign that a
    # preemption is near.
    horizon_blocks: int = 0
    # Why this model is not pooled at all (groups.py), "" when it is.
    refusal: str = ""


@dataclass(frozen=True, eq=False)
class Parts:
    block_tokens: int              # the token -> block grid every group shares (0: none)
    link: DaemonLink
    losses: StoreLosses
    batches: StoreBatches
    pd: PdStream
    lookups: Lookups
    loads: Loads
    lazy: LazyStore | None         # the lazy policy's memory of unstored blocks (None: eager)
    planner: StorePlanner
    backlog: Backlog
    requests: Requests


def build_parts(client: Any, settings: RoleSettings) -> Parts:
    """Every part of the scheduler side, wired. ``client``: a ``SchedulerClient`` (or a fake
    with its never-waiting methods)."""
    if settings.store_policy not in ("eager", "lazy"):
        raise ValueError(f"store_policy must be eager or lazy, not {settings.store_policy!r}")
    groups, b = settings.groups, settings.budgets
    sizes = {g.block_tokens for g in groups}
    bt = min(sizes) if sizes else 0     # (several sizes: the role stays idle)
    losses = StoreLosses(b.report_interval_s, b.clock)
    link = DaemonLink(client, b)
    committed = CommittedKeys(len(groups))
    batches = StoreBatches(groups, bt, settings.world_size, client, link, losses, committed,
                           settings.events_enabled)
    pd = PdStream(groups, bt, b, settings.pd_stream)
    lookups = Lookups(groups, bt, client, link, pd, committed, b)
    loads = Loads(groups, bt)
    lazy = LazyStore(max(1, settings.horizon_blocks)) \
        if settings.store_policy == "lazy" else None
    planner = StorePlanner(groups, bt, client, link, batches, losses, b, loads,
                           LazyPolicy(lazy, groups, client, batches) if lazy else None,
                           settings.store_min_prefix_tokens, settings.horizon_blocks)
    backlog = Backlog(planner, client, link, [g.namespace for g in groups], losses, b)
    requests = Requests(groups, bt, settings.kv_producer, planner, pd,
                        [lookups, loads, pd, planner, backlog, batches])
    return Parts(bt, link, losses, batches, pd, lookups, loads, lazy, planner, backlog,
                 requests)
