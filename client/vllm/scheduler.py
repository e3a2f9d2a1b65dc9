"""The connector's scheduler role: decides what to load and store, never moves bytes.

Runs inside vLLM's scheduler (engine core) process, on its one thread. ``SchedulerRole`` owns
the map of request id to ``ReqState`` (``requests.py``) and forwards each call vLLM makes to
the parts that do the work, in order:

- ``daemon_link.py``: the daemon connection behind a circuit breaker;
- ``lookups.py``: batched lookups, their hits and leases;
- ``loads.py``: a hit turned into load specs once vLLM allocated its blocks, until reported;
- ``pd_stream.py``: P/D consumers loading a prefill's hand-off chunk by chunk;
- ``store_planner.py``: which full blocks are stored each step (the life of one store is
  described there);
- ``tickets.py``: store tickets until every rank acked them, KV events, and the backlog of
  finished requests keeping their blocks for their stores;
- ``store_losses.py``: full blocks not stored, by reason.

No method vLLM calls here waits on the daemon: lookups go out at the end of a step and are
answered at the start of the next (``None`` meanwhile: "ask again next step"), stores take
slots from the client's stock, and releases, aborts and resets are sent without waiting. A
daemon that is missing or slow turns into zero hits and skipped stores (``DaemonUnavailable``
is caught by the parts, never raised to vLLM).

Lifecycle of a request, as vLLM drives it:
``get_num_new_matched_tokens`` (queue a lookup, answer ``None`` until it lands, then the hit)
→ ``update_state_after_alloc`` (turn the hit into load specs, or release the lease)
→ ``build_connector_meta`` each step (stores of newly full blocks)
→ ``update_connector_output`` (load done: release the lease; store tickets acked by every rank)
→ ``request_finished`` (keep the blocks while tickets are in flight; free them via ``free_now``).

This module is the only part that imports vLLM's types (``StepMeta``, ``WorkerAcks``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.loads import Loads
from kvpool.client.vllm.lookups import Lookups
from kvpool.client.vllm.pd_stream import PdStream
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import LoadSpec
from kvpool.client.vllm.store_losses import StoreLosses
from kvpool.client.vllm.lazy_store import LazyStore
from kvpool.client.vllm.store_planner import StorePlanner, handed_blocks
from kvpool.client.vllm.tickets import Backlog, Tickets
from kvpool.client.vllm.keys import GroupInfo, RequestKeys
from kvpool.client.vllm.meta import StepMeta, WorkerAcks
from kvpool.shared.errors import DaemonUnavailable

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpool.vllm")


class SchedulerRole:
    """See the module docstring. Public methods mirror ``KVConnectorBase_V1``'s scheduler side
    and are called only from vLLM's scheduler thread."""

    def __init__(self, groups: list[GroupInfo], world_size: int, client: Any,
                 backoff_s: float = 0.2, backoff_max_s: float = 5.0, *,
                 kv_producer: bool = False, engine_id: str = "", tp_size: int = 1,
                 pd_wait_s: float = 3.0, pd_stream: bool = True,
                 store_wait_s: float = 2.0, events_enabled: bool = True,
                 store_policy: str = "eager", store_min_prefix_tokens: int = 0,
                 horizon_blocks: int = 0, refusal: str = "") -> None:
        self.groups = groups
        self.world_size = world_size
        self.kv_producer = kv_producer
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.pd_wait_s = pd_wait_s
        self.client = client
        sizes = {g.block_tokens for g in groups}
        # One token→block grid for every group, and every group of the model pooled
        # (groups.py; ``refusal`` says why not): anything else is served by recompute rather
        # than guessed at.
        self.enabled = bool(groups) and len(sizes) == 1 and not refusal
        if not self.enabled:
            logger.warning("kvpool: stores and hits are off for this model: %s",
                           refusal or f"KV-cache groups {[g.identity for g in groups]}")
        self.block_tokens = bt = next(iter(sizes)) if sizes else 0
        self._steps = 0                   # build_connector_meta calls so far
        self._reqs: dict[str, ReqState] = {}
        # The step's load specs: loads and the P/D stream add to them, build_connector_meta
        # hands them over (the list is shared with them: emptied, never rebound).
        self._step_loads: list[LoadSpec] = []
        # Full blocks given up without being stored, by reason.
        self.losses = StoreLosses()
        namespaces = [g.namespace for g in groups]
        self.link = DaemonLink(client, backoff_s, backoff_max_s)
        self.backlog = Backlog(bt, client, self.link, self._reqs, namespaces, self.losses,
                               store_wait_s)
        self.tickets = Tickets(groups, bt, world_size, client, self.link, self.backlog,
                               self.losses, events_enabled)
        self.pd = PdStream(groups, bt, self._reqs, self._step_loads, pd_wait_s, pd_stream)
        self.lookups = Lookups(groups, bt, client, self.link, self._reqs, self.pd,
                               self.tickets.committed)
        self.loads = Loads(groups, bt, self._reqs, self._step_loads, self.lookups)
        # store_policy "lazy": blocks are remembered, and stored when vLLM's prefix cache is
        # about to evict them (store_planner.py says how); horizon_blocks is how far one
        # schedule() reaches into vLLM's free queue (lazy_store.horizon_for; 0: unknown), which
        # also tells the eager planner when preemption is near.
        if store_policy not in ("eager", "lazy"):
            raise ValueError(f"store_policy must be eager or lazy, not {store_policy!r}")
        self.lazy = LazyStore(max(1, horizon_blocks)) if store_policy == "lazy" else None
        self.planner = StorePlanner(groups, bt, client, self.link, self._reqs, self.tickets,
                                    self.backlog, self.losses, self.lazy,
                                    store_min_prefix_tokens, horizon_blocks)
        # Benchmarks only (connector timing on): told (wall time, tokens scheduled, blocks
        # planned) of each step that planned stores.
        self.store_log: Callable[[float, int, int], None] | None = None
        if self.enabled:
            # Connect and start stocking slots now (start-up, not a step: this may wait up to
            # timeout_ms once), so the first steps find them.
            for g in groups:
                self.client.keep_stock(g.namespace)
            connect = getattr(self.client, "connect", None)
            if connect is not None and not connect():
                self.link.failed(DaemonUnavailable("kvpoold not reachable at start"))
            self.link.pump()

    @property
    def kv_cache_manager(self) -> "KVCacheManager | None":
        return self.planner.kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, manager: "KVCacheManager | None") -> None:
        self.planner.kv_cache_manager = manager

    @property
    def unstored_total(self) -> int:
        return self.losses.total

    # ---- requests --------------------------------------------------------------------------

    def _state(self, request: "Request") -> ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = ReqState(request, RequestKeys(request, self.groups),
                          cursor=[0] * len(self.groups))
            self._reqs[request.request_id] = st
            params = request.kv_transfer_params or {}
            st.producer = self.kv_producer or bool(params.get("do_remote_decode"))
            # A P/D hand-off stores every block as soon as it fills: the decode side streams.
            st.store_run = 1 if st.producer else self.planner.store_run
            if params.get("do_remote_prefill") and params.get("kvpool_tokens"):
                # Whatever TP size the prefill ran (kvpool_tp): its ranks stored every head.
                st.expect_blocks = int(params["kvpool_tokens"]) // self.block_tokens
                st.wait_until = time.monotonic() + self.pd_wait_s
        return st

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
        if not st.keys.cacheable or request.skip_reading_prefix_cache or st.load_failed:
            return 0, False
        st.local_tokens = num_computed_tokens
        end = self.lookups.match(st, num_computed_tokens, self._steps)
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
        st = self._reqs.get(request.request_id)
        if st is None or st.loading:
            return
        if num_external_tokens == 0 or st.hit is None:
            # Blocks the pool already holds need no store (those a load brought in, when vLLM
            # schedules the request after it); the GPU-cached ones past them do.
            st.set_cursor(0 if st.producer else max(st.hit or 0, st.pooled))
            self.lookups.consume(st, keep_leases=False)
            return
        table = blocks.get_block_ids()
        end, first, loads = self.loads.start(st, table, num_external_tokens)
        self.lookups.consume(st, keep_leases=True)
        if end > first:
            # A P/D hand-off still landing: these specs are its first chunk, not its last;
            # the rest is asked for in this step's batch.
            self.pd.start(st, table, first, end, loads)
            self.lookups.ask(st)
        elif not loads:
            self.loads.nothing_to_copy(st)
        st.set_cursor(0 if st.producer else end)

    # ---- per step: stores, flushes, releases -------------------------------------------------

    def build_connector_meta(self, so: "SchedulerOutput") -> StepMeta:
        meta = StepMeta()
        if not self.enabled:
            return meta
        started = time.perf_counter()
        self.link.pump()
        self.lookups.poll(self._steps)
        if self.pd.streams:
            self.pd.expire()
        # Stores still reading blocks that are handed to a request this step must finish
        # first (preempted requests' blocks; sliding-window blocks freed and reused).
        flush: set[int] = set()
        if self.tickets.by_id:
            handed = handed_blocks(so)
            if handed:
                flush = self.tickets.reading(handed)
        preempted = [st for st in map(self._reqs.get, so.preempted_req_ids or ())
                     if st is not None]
        for st in preempted:
            flush.update(st.tickets)
            self.lookups.consume(st, keep_leases=False)
        meta.flush_tickets = sorted(flush)
        # The step's messages go before store planning, whose budget runs from the step's
        # start: planning gets what they left of it, so a step that sends a lookup batch
        # does not also plan for the full budget.
        self.tickets.send_aborts()
        self.lookups.send_releases()
        self.lookups.send()
        meta.stores = self.planner.plan(so, started, preempted)
        if self.store_log is not None and meta.stores:
            self.store_log(time.time(), so.total_num_scheduled_tokens,
                           sum(len(s.slots) for s in meta.stores))
        for st in preempted:
            st.set_cursor(0)        # it resumes from token 0 (keys stored now are skipped)
        meta.free_now = self.backlog.take_free()
        if self.backlog.backlog:
            self.backlog.end()
        # Last: polling, deadlines and a failed send above may all have added load specs.
        meta.loads = self._step_loads[:]
        self._step_loads.clear()
        self._steps += 1
        return meta

    # ---- completions ---------------------------------------------------------------------------

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        acks = out.kv_connector_worker_meta
        if isinstance(acks, WorkerAcks):
            self.tickets.acked(acks.done, acks.failed)
        self.loads.finished(out.finished_recving, out.failed_recving, out.invalid_block_ids)

    # ---- finish, reset, events --------------------------------------------------------------

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            return False, None
        params = self._handoff_params(st) if st.producer else None
        st.finished = True
        if st.loading:
            # vLLM keeps the blocks of a request aborted mid-load until the workers report
            # the load; the lease goes when that report arrives.
            if st.stream_end:
                self.pd.end(st, report_missing=False)
            return False, params
        # A lookup reply that lands later finds the request gone and releases its leases.
        self.lookups.consume(st, keep_leases=False)
        if self.planner.below_min_prefix(st):
            st.set_cursor(st.full_blocks(self.block_tokens))    # nothing of it is stored
        if self.backlog.keeps(st) or st.tickets:
            st.finishing = True
            return True, params
        self._reqs.pop(request.request_id, None)
        return False, params

    def _handoff_params(self, st: ReqState) -> dict[str, Any]:
        """What a decode instance needs to take this prompt from the pool; shaped like the
        parameters vLLM's disaggregated-serving proxies pass from prefill to decode."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_block_ids": None,
                "remote_host": None, "remote_port": None,
                "kvpool_tokens": st.full_blocks(self.block_tokens) * self.block_tokens,
                "kvpool_tp": self.tp_size}

    def has_pending_push_work(self) -> bool:
        # Remembered blocks (lazy) keep an engine with nothing left to do stepping once more:
        # that step has nothing to compute, so it stores them (the engine is idle, or shutting
        # down cleanly) and the cache outlives the engine as under eager.
        lazy = self.lazy
        return bool(self.tickets.by_id or self.backlog.free_ready or self.lookups.release
                    or self.tickets.abort_slots or self.lookups.retry or self.pd.streams
                    or self.backlog.backlog
                    or (lazy is not None and (lazy.num_pending or lazy.num_in_flight)))

    def reset_cache(self) -> bool:
        """Forget every block of this engine's namespaces in the pool, without waiting for the
        daemon's answer (later lookups on this connection see the reset); False if it could
        not be sent (vLLM then reports the reset as failed).

        Stores planned before the reset must never show up after it (a reset often follows a
        weight update): their slots are given back first, on the same connection, so a store
        that reaches the daemon later finds its slot gone and commits nothing.
        """
        ok = self.link.pump()
        if ok:
            ok = self.tickets.send_reset()
        self.tickets.reset()
        if self.lazy is not None:
            self.lazy.reset()            # remembered KV is stale after a reset
        for st in self._reqs.values():
            if not st.loading:
                self.lookups.consume(st, keep_leases=False)
            st.set_cursor(0)
        return ok

    def take_events(self) -> Iterable[Any]:
        return self.tickets.take_events()

    def shutdown(self) -> None:
        self.losses.maybe_log(final=True)
        self.lookups.send_releases()
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
