"""The connector's scheduler role: decides what to load and store, never moves bytes.

Runs inside vLLM's scheduler (engine core) process, on its one thread. ``SchedulerRole`` gets
its parts from ``parts.build_parts`` and forwards each call vLLM makes to them, in order; it
owns what it hands vLLM (the step's load specs and the requests vLLM may free) and a request's
life (``ReqState.finished``/``finishing``), and lets requests go through ``Requests.leave``,
the one way out, when nothing needs them any more:

- ``requests.py``: the requests known, admitted and let go;
- ``daemon_link.py``: the daemon connection behind a circuit breaker;
- ``lookups.py``: which leading blocks the pool holds, and their pins;
- ``loads.py``: a hit turned into load specs once vLLM allocated its blocks, until reported;
- ``pd_stream.py``: P/D consumers loading a prefill's hand-off chunk by chunk;
- ``store_planner.py``: which full blocks are stored each step (the life of one store is
  described there);
- ``store_batches.py``: store batches until every rank acked them, and KV events;
- ``backlog.py``: finished requests keeping their blocks until their last ones are planned;
- ``store_losses.py``: full blocks not stored, by reason;
- ``budgets.py``: every wall-clock budget, and the clock.

No method vLLM calls here waits on the daemon: lookups go out at the end of a step and are
answered at the start of the next (``None`` meanwhile: "ask again next step"), stores take
tickets from the client's stock, and releases, aborts and resets are sent without waiting. A
daemon that is missing or slow turns into zero hits and skipped stores (``DaemonUnavailable``
is caught by the parts, never raised to vLLM).

Lifecycle of a request, as vLLM drives it:
``get_num_new_matched_tokens`` (queue a lookup, answer ``None`` until it lands, then the hit)
→ ``update_state_after_alloc`` (turn the hit into load specs, or let its pins go)
→ ``build_connector_meta`` each step (stores of newly full blocks)
→ ``update_connector_output`` (load done: release the lease; store batches acked by every rank)
→ ``request_finished`` (keep the blocks while stores are in flight; free them via ``free_now``)
→ it leaves (``Requests.leave``) when finished and nothing is in flight for it.

This module is the only part that imports vLLM's types (``StepMeta``, ``WorkerAcks``).
"""


from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvpool.client.vllm.meta import StepMeta, WorkerAcks
from kvpool.client.vllm.parts import RoleSettings, build_parts
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import LoadSpec
from kvpool.client.vllm.store_planner import handed_blocks
from kvpool.shared.errors import DaemonUnavailable

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpool.vllm")


class SchedulerRole:
    """See the module docstring. Public methods mirror ``KVConnectorBase_V1``'s scheduler side
    and are called only from vLLM's scheduler thread. ``store_log`` (benchmarks, connector
    timing on): told (wall time, tokens scheduled, blocks planned) of each step that planned
    stores."""

    def __init__(self, client: Any, settings: RoleSettings,
                 store_log: Callable[[float, int, int], None] | None = None) -> None:
        self.settings = settings
        self.groups = groups = settings.groups
        self.client = client
        sizes = {g.block_tokens for g in groups}
        # One token→block grid for every group, and every group of the model pooled
        # (groups.py; ``refusal`` says why not): anything else is served by recompute rather
        # than guessed at.
        self.enabled = bool(groups) and len(sizes) == 1 and not settings.refusal
        if not self.enabled:
            logger.warning("kvpool: stores and hits are off for this model: %s",
                           settings.refusal or f"KV-cache groups {[g.identity for g in groups]}")
        parts = self.parts = build_parts(client, settings)
        self.block_tokens = parts.block_tokens
        self.requests, self.link, self.losses = parts.requests, parts.link, parts.losses
        self.lookups, self.loads, self.pd = parts.lookups, parts.loads, parts.pd
        self.planner, self.batches, self.backlog = parts.planner, parts.batches, parts.backlog
        self.lazy = parts.lazy
        self._clock = settings.budgets.clock
        self.store_log = store_log
        self.kv_cache_manager: KVCacheManager | None = None   # bound by vLLM
        self._steps = 0                   # build_connector_meta calls so far
        # What the next step's metadata hands over: load specs made since the last step, and
        # finished requests whose stores have all landed (vLLM frees their blocks).
        self._step_loads: list[LoadSpec] = []
        self._free_now: list[str] = []
        if self.enabled:
            # Connect and start stocking tickets now (start-up, not a step: this may wait up to
            # timeout_ms once), so the first steps find them.
            for g in groups:
                self.client.keep_stock(g.namespace)
            connect = getattr(self.client, "connect", None)
            if connect is not None and not connect():
                self.link.failed(DaemonUnavailable("kvpoold not reachable at start"))
            if self.link.pump() and hasattr(self.client, "wait_stock"):
                self.client.wait_stock()      # the reservations the pump just sent

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        """vLLM's KV-cache manager, bound once vLLM built it (after the connector)."""
        self.kv_cache_manager = manager

    @property
    def unstored_total(self) -> int:
        return self.losses.total

    # ---- requests --------------------------------------------------------------------------

    def _state(self, request: "Request") -> ReqState:
        st = self.requests.get(request.request_id)
        if st is None or st.request is not request:
            st = self.requests.admit(request)
        return st

    def _free(self, rid: str) -> None:
        """``rid`` finished and nothing is in flight for it: vLLM may free its blocks (it
        kept them on our word), and it leaves."""
        self._free_now.append(rid)
        self.requests.leave(rid)

    def on_new_request(self, request: "Request") -> None:
        """A request entered the scheduler: hash its prompt's block keys now (as vLLM hashes
        its own blocks when a request is created), not inside a scheduling step."""
        if not self.enabled:
            return
        st = self._state(request)
        if st.keys.cacheable:
            n = (request.num_tokens - 1) // self.block_tokens
            for gi, g in enumerate(self.groups):
                if g.window_blocks is None:
                    st.keys.keys(request, gi, n)

    # ---- lookups → loads ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.enabled:
            return 0, False
        st = self._state(request)
        st.local_hit_tokens = num_computed_tokens
        if not st.keys.cacheable or request.skip_reading_prefix_cache:
            return 0, False
        end = self.lookups.offer(st, num_computed_tokens, self._steps)
        if end is None:
            return None, False
        ext = end * self.block_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        if self.loads.waits_for(st, num_computed_tokens, end):
            return None, False
        return ext, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        st = self.requests.get(rid)
        if st is None or self.loads.busy(rid):
            return
        st.computed_from = (st.local_hit_tokens + num_external_tokens) // self.block_tokens
        hit = self.lookups.accept(st) if num_external_tokens else None
        if hit is None:
            # Blocks the pool already holds need no store (those a load brought in, when vLLM
            # schedules the request after it); the GPU-cached ones past them do.
            held = self.lookups.decline(st)
            self.planner.restart(rid, 0 if st.producer else max(held, self.planner.pooled(rid)))
            return
        table = blocks.get_block_ids()
        load = self.loads.start(st, hit, table, num_external_tokens)
        self._step_loads += load.specs
        if load.end > load.first:
            # A P/D hand-off still landing: these specs are its first chunk, not its last;
            # the rest is asked for in this step's batch.
            self.pd.start(st, table, load.first, load.end)
            self.lookups.follow(st)
        self.planner.restart(rid, 0 if st.producer else load.end, pooled=load.pooled)

    # ---- per step: stores, flushes, releases -------------------------------------------------

    def build_connector_meta(self, so: "SchedulerOutput") -> StepMeta:
        meta = StepMeta()
        if not self.enabled:
            return meta
        started = self._clock()
        self.link.pump()
        self.lookups.begin_step(self._steps)
        if self.pd.streams:
            self.pd.expire()
        # Stores still reading blocks that are handed to a request this step must finish
        # first (preempted requests' blocks; sliding-window blocks freed and reused).
        flush: set[int] = set()
        if self.batches.by_id:
            handed = handed_blocks(so)
            if handed:
                flush = self.batches.reading(handed)
        preempted = [st for st in map(self.requests.get, so.preempted_req_ids or ())
                     if st is not None]
        for st in preempted:
            flush.update(self.batches.of(st.request.request_id))
            self.lookups.decline(st)
        meta.flush_batches = sorted(flush)
        # The step's messages go before store planning, whose budget runs from the step's
        # start: planning gets what they left of it, so a step that sends a lookup batch
        # does not also plan for the full budget.
        self.batches.send_aborts()
        self.lookups.end_step()
        meta.stores, planned = self.planner.plan(so, started, preempted, self.kv_cache_manager)
        if self.store_log is not None and meta.stores:
            self.store_log(time.time(), so.total_num_scheduled_tokens,
                           sum(len(s.tickets) for s in meta.stores))
        for st in preempted:
            # It resumes from token 0 (keys stored now are skipped).
            self.planner.restart(st.request.request_id, 0)
        meta.free_now, self._free_now = self._free_now, []
        if self.backlog:
            for rid in self.backlog.end(planned):
                if not self.batches.pending(rid):
                    self._free(rid)     # (freed in the next step's metadata)
        # Last: polling, deadlines and a failed send above may all have added load specs.
        if self.pd.has_specs:
            self._step_loads += self.pd.take_specs()
        meta.loads, self._step_loads = self._step_loads, []
        self._steps += 1
        return meta

    # ---- completions ---------------------------------------------------------------------------

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        acks = out.kv_connector_worker_meta
        if isinstance(acks, WorkerAcks):
            for st in self.batches.acked(acks.done, acks.failed):
                rid = st.request.request_id
                if st.finishing and not self.backlog.holds(rid) \
                        and self.requests.get(rid) is st:
                    self._free(rid)
        for rid, failed in self.loads.finished(out.finished_recving, out.failed_recving,
                                               out.invalid_block_ids):
            self.lookups.loaded(rid, failed)
            if failed:
                self.planner.restart(rid, 0, pooled=0)   # recomputed blocks get stored again
            st = self.requests.get(rid)
            if st is not None and st.finished:
                self.requests.leave(rid)

    # ---- finish, reset, events --------------------------------------------------------------

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self.requests.get(rid)
        if st is None or st.request is not request:
            return False, None
        params = self._handoff_params(st) if st.producer else None
        st.finished = True
        if self.loads.busy(rid):
            # vLLM keeps the blocks of a request aborted mid-load until the workers report
            # the load; it leaves when that report arrives.
            if self.pd.span(rid) is not None:
                self.pd.end(rid, report_missing=False)
            return False, params
        # A lookup reply that lands later finds the request gone and releases its leases.
        self.lookups.decline(st)
        if self.planner.below_min_prefix(st):
            self.planner.restart(rid, st.full_blocks(self.block_tokens))   # none is stored
        if self.backlog.keeps(st) or self.batches.pending(rid):
            st.finishing = True
            return True, params
        self.requests.leave(rid)
        return False, params

    def _handoff_params(self, st: ReqState) -> dict[str, Any]:
        """What a decode instance needs to take this prompt from the pool; shaped like the
        parameters vLLM's disaggregated-serving proxies pass from prefill to decode."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.settings.engine_id, "remote_block_ids": None,
                "remote_host": None, "remote_port": None,
                "kvpool_tokens": st.full_blocks(self.block_tokens) * self.block_tokens,
                "kvpool_tp": self.settings.tp_size}

    def has_pending_push_work(self) -> bool:
        # Remembered blocks (lazy) keep an engine with nothing left to do stepping once more:
        # that step has nothing to compute, so it stores them (the engine is idle, or shutting
        # down cleanly) and the cache outlives the engine as under eager.
        lazy = self.lazy
        return bool(self.batches.by_id or self._free_now or self.lookups.has_work()
                    or self.batches.abort_tickets or self.pd.streams or self.backlog
                    or (lazy is not None and (lazy.num_pending or lazy.num_in_flight)))

    def reset_cache(self) -> bool:
        """Forget every block of this engine's namespaces in the pool, without waiting for the
        daemon's answer (later lookups on this connection see the reset); False if it could
        not be sent (vLLM then reports the reset as failed).

        Stores planned before the reset must never show up after it (a reset often follows a
        weight update): their tickets are given back first, on the same connection, so a store
        that reaches the daemon later finds its ticket gone and commits nothing.
        """
        ok = self.link.pump()
        if ok:
            ok = self.batches.send_reset()
        self.batches.reset()
        self.lookups.fence()
        if self.lazy is not None:
            self.lazy.reset()            # remembered KV is stale after a reset
        for st in self.requests:
            if not self.loads.busy(st.request.request_id):
                self.lookups.decline(st)
            self.planner.restart(st.request.request_id, 0)
        return ok

    def take_events(self) -> Iterable[Any]:
        return self.batches.take_events()

    def shutdown(self) -> None:
        self.losses.maybe_log(final=True)
        self.lookups.send_releases()
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
