"""Store batches until every rank acked them, and the keys this engine's stores committed.

The end of the store path described in ``store_planner.py``: a *store batch* is one group's
stores planned in one step (the connector's unit of acknowledgement; the daemon never sees it).
``StoreBatches`` owns the batches in flight and the worker acks that resolve them (done when
every rank reported it; committed only if none failed, else its tickets are aborted and its
blocks counted lost), the batches each request is in (a request keeps its GPU blocks until
they resolve: ``acked`` returns the requests whose last one did), the keys in flight, which
batch last read each GPU block (a block handed to another request must be flushed first), and
the KV events built from committed batches when vLLM asks for them. ``CommittedKeys`` owns the
keys remembered as committed (so none is planned again; a lookup that misses one forgets it).

Never waits, and never calls vLLM's code except to build its KV event structs, imported only
when events are asked for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice, repeat
from typing import Any, Collection, Iterable, Iterator, Sequence

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import StoreSpec
from kvpool.client.vllm.store_losses import STORE_FAILED, StoreLosses

# Keys remembered as committed: to report BlockRemoved on reset, and to plan no store of a key
# the pool holds (a GPU prefix hit, a recomputed preempted request). Bounded so a long-lived
# engine does not grow without limit; the daemon is the source of truth for presence (it
# dedups what this misses) and a lookup that misses a remembered key forgets it.
_MAX_REMEMBERED_KEYS = 1 << 20

# A run: (request, block indices, keys, GPU block ids), as the store planner cuts them.
Run = tuple[ReqState, Sequence[int], list[bytes], list[int]]


@dataclass(eq=False)
class _Run:
    """The blocks of one request in a batch."""

    req: ReqState
    indices: Sequence[int]     # block positions in the request (a range when contiguous)
    keys: list[bytes]


@dataclass(eq=False)
class StoreBatch:
    """One store batch: the blocks of one group planned in one step, for every request (the
    workers copy them in one job per group and step anyway, so finer batches would buy
    nothing)."""

    group: int
    runs: list[_Run]
    keys: list[bytes]
    tickets: list[int]         # the daemon's tickets the keys are stored through
    block_ids: list[int]
    done: int = 0              # ranks that reported it
    failed: int = 0            # ranks that reported a failure
    stale: bool = False        # a cache reset happened since: never counts as committed


class CommittedKeys:
    """Per group, the keys this engine's stores committed, oldest first, at most
    ``_MAX_REMEMBERED_KEYS`` of them. Read by the store planner (a key the pool holds is not
    stored again) and lookups; only the methods here change it."""

    def __init__(self, num_groups: int) -> None:
        self._per_group: list[dict[bytes, None]] = [{} for _ in range(num_groups)]

    def __getitem__(self, gi: int) -> dict[bytes, None]:
        return self._per_group[gi]

    def __iter__(self) -> Iterator[dict[bytes, None]]:
        return iter(self._per_group)

    def add(self, gi: int, keys: list[bytes]) -> None:
        remembered = self._per_group[gi]
        remembered.update(dict.fromkeys(keys))
        excess = len(remembered) - _MAX_REMEMBERED_KEYS
        if excess > 0:      # the oldest first (a dict keeps insertion order)
            for key in list(islice(remembered, excess)):
                del remembered[key]

    def forget(self, gi: int, key: bytes) -> None:
        """A lookup missed ``key``: the pool let it go, and it may be stored again."""
        self._per_group[gi].pop(key, None)

    def take_all(self) -> list[list[bytes]]:
        """Every key, per group, forgotten here (the pool forgot them: a reset)."""
        out = [list(keys) for keys in self._per_group]
        for keys in self._per_group:
            keys.clear()
        return out


class StoreBatches:
    """Store batches in flight and what their resolution leaves behind. Called from vLLM's
    scheduler thread only."""

    def __init__(self, groups: list[Any], block_tokens: int, world_size: int, client: Any,
                 link: DaemonLink, losses: StoreLosses, committed: CommittedKeys,
                 events_enabled: bool = True) -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self.world_size = world_size
        self.client = client
        self._link = link
        self._losses = losses
        self.committed = committed
        self.by_id: dict[int, StoreBatch] = {}
        self._next_batch = 1
        self._of: dict[str, set[int]] = {}     # request id -> its batches in flight
        # Per group: key -> batch storing it. Per GPU block: the batch that last read it
        # (entries of resolved batches stay, and are ignored: the map is bounded by the number
        # of GPU blocks, and nothing is deleted per block on the hot path).
        self.keys_in_flight: list[dict[bytes, int]] = [{} for _ in groups]
        self.block_reader: dict[int, int] = {}
        self.abort_tickets: list[int] = []  # tickets of failed batches, aborted next step
        # KV events are built only if vLLM publishes them, and only when it asks for them
        # (take_events), from the batches that committed.
        self.events_enabled = events_enabled
        self._stored: list[StoreBatch] = []
        self._events: list[Any] = []

    def add(self, gi: int, runs: list[Run], tickets: list[int],
            granted_by: str) -> StoreSpec:
        """A batch for group ``gi``'s ``runs``, stored through the daemon's ``tickets`` (at
        least as many as the runs' keys; ``granted_by``: the daemon life whose grant they came
        from); its spec for the workers."""
        batch_id = self._next_batch
        self._next_batch += 1
        all_keys: list[bytes] = []
        all_bids: list[int] = []
        parts = []
        of = self._of
        for st, index, keys, bids in runs:
            all_keys += keys
            all_bids += bids
            parts.append(_Run(st, index, keys))
            mine = of.get(st.request.request_id)
            if mine is None:
                mine = of[st.request.request_id] = set()
            mine.add(batch_id)
        tickets = tickets[:len(all_keys)]
        self.by_id[batch_id] = StoreBatch(gi, parts, all_keys, tickets, all_bids)
        self.keys_in_flight[gi].update(dict.fromkeys(all_keys, batch_id))
        self.block_reader.update(dict.fromkeys(all_bids, batch_id))
        return StoreSpec(batch_id, gi, tickets, all_bids, all_keys, granted_by)

    def reading(self, handed: Iterable[int]) -> set[int]:
        """Batches in flight still reading any of the GPU blocks ``handed`` to a request this
        step (preempted requests' blocks; sliding-window blocks freed and reused): the workers
        must finish them before the step's forward runs."""
        flush: set[int] = set()
        batches, last = self.by_id, self.block_reader
        for b in last.keys() & handed:
            if last[b] in batches:
                flush.add(last[b])
        return flush

    def of(self, rid: str) -> Collection[int]:
        """The batches in flight that store blocks of ``rid``."""
        return self._of.get(rid, ())

    def pending(self, rid: str) -> bool:
        """``rid`` has blocks in a batch in flight (its GPU blocks must stay until it
        resolves)."""
        return rid in self._of

    def acked(self, done: dict[int, int], failed: dict[int, int]) -> list[ReqState]:
        """Workers reported these batches (``WorkerAcks``, summed over the ranks that
        reported this step): a batch every rank reported is resolved. Returns the requests
        whose last batch in flight resolved."""
        settled: list[ReqState] = []
        for batch_id, n in done.items():
            t = self.by_id.get(batch_id)
            if t is None:
                continue
            t.done += n
            t.failed += failed.get(batch_id, 0)
            if t.done >= self.world_size:
                self._resolve(batch_id, t, settled)
        return settled

    def _resolve(self, batch_id: int, t: StoreBatch, settled: list[ReqState]) -> None:
        del self.by_id[batch_id]
        if not t.stale:     # (a reset emptied the in-flight map; others may use it since)
            deque(map(self.keys_in_flight[t.group].pop, t.keys, repeat(None)), maxlen=0)
        if t.failed:
            self.abort_tickets.extend(t.tickets)
            if not t.stale:
                self._losses.add(STORE_FAILED, len(t.keys))
        elif not t.stale:
            self.committed.add(t.group, t.keys)
            if self.events_enabled:
                self._stored.append(t)
        of = self._of
        for run in t.runs:
            rid = run.req.request.request_id
            mine = of.get(rid)
            if mine is not None and batch_id in mine:
                mine.discard(batch_id)
                if not mine:
                    del of[rid]
                    settled.append(run.req)

    def send_aborts(self) -> None:
        if self.abort_tickets:
            tickets, self.abort_tickets = self.abort_tickets, []
            self._link.nowait(self.client.abort_nowait, tickets)

    def send_reset(self) -> bool:
        """Give back the tickets of every batch in flight, then forget every block of this
        engine's namespaces in the pool, on one connection and without waiting, so a store
        that reaches the daemon later finds its ticket gone and commits nothing; False if
        either could not be sent."""
        ok = True
        stale = [ref for t in self.by_id.values() for ref in t.tickets]
        if stale:
            ok = self._link.nowait(self.client.abort_nowait, stale)
        for g in self.groups:
            ok = ok and self._link.nowait(self.client.reset_nowait, g.namespace)
        return ok

    def reset(self) -> None:
        """The pool forgot this engine's blocks: batches in flight never count as committed,
        no key is in flight or remembered any more, and vLLM hears of every remembered key's
        removal (after the stores it has not heard of yet)."""
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved

        self._build_events()
        for t in self.by_id.values():
            t.stale = True
        for inflight in self.keys_in_flight:
            inflight.clear()
        for gi, removed in enumerate(self.committed.take_all()):
            if removed:
                self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_CPU,
                                                 group_idx=self.groups[gi].index))

    def forget(self, rid: str) -> None:
        """``rid`` left: its batches still in flight resolve as usual (their KV events read
        its tokens), but nobody hears that its last one did."""
        self._of.pop(rid, None)

    def tracked(self) -> Collection[str]:
        return self._of.keys()

    def take_events(self) -> list[Any]:
        if self._stored:
            self._build_events()
        events, self._events = self._events, []
        return events

    def _build_events(self) -> None:
        stored, self._stored = self._stored, []
        for t in stored:
            for run in t.runs:
                self._committed_event(t, run)

    def _committed_event(self, t: StoreBatch, run: _Run) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored

        st = run.req
        if not run.indices:
            return
        g = self.groups[t.group]
        bt = self.block_tokens
        first = run.indices[0]
        chain = st.keys.range(st.request, t.group, max(first - 1, 0), run.indices[-1] + 1)
        base = max(first - 1, 0)
        for i, key in zip(run.indices, run.keys):
            parent = chain[i - 1 - base] if i else None
            lora = st.request.lora_request
            self._events.append(BlockStored(
                block_hashes=[key], parent_block_hash=parent,
                token_ids=list(st.request.all_token_ids[i * bt:(i + 1) * bt]), block_size=bt,
                lora_id=None, medium=MEDIUM_CPU,
                lora_name=getattr(lora, "lora_name", None) if lora else None,
                group_idx=g.index))
