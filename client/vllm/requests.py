"""The requests the connector's scheduler side knows: ``ReqState`` each, one way in, one way out.

``ReqState`` is what every part reads of a request and none but ``SchedulerRole`` writes: the
vLLM request, its block keys, whether it hands its prompt over as a P/D producer, and where it
is in its life (``finished``: vLLM called ``request_finished``; ``finishing``: vLLM keeps its
blocks until the role names it in ``free_now``). What a part keeps about a request is its own,
in its own map: the lookup's answer and pins (``lookups.py``), the load in flight
(``loads.py``), the P/D hand-off (``pd_stream.py``), the store cursor (``store_planner.py``),
the backlog's deadline (``backlog.py``), the store batches naming it (``store_batches.py``).

``Requests`` owns the map of request id to ``ReqState``: ``admit`` creates one (and asks the
parts that need it from the start to set up theirs), ``leave`` is the only way out: it drops
the request from the map and asks every part to drop what it keeps for it. Plain data and
bookkeeping: no vLLM import, no daemon calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Iterator, Protocol, Sequence

from kvpool.client.vllm.keys import GroupInfo, RequestKeys

if TYPE_CHECKING:
    from kvpool.client.vllm.pd_stream import PdStream
    from kvpool.client.vllm.store_planner import StorePlanner


@dataclass(eq=False, slots=True)
class ReqState:
    request: Any               # vLLM's Request (or any object with its fields, in tests)
    keys: RequestKeys
    producer: bool = False     # P/D prefill: stores every block (also those it loaded)
    finished: bool = False     # vLLM called request_finished
    finishing: bool = False    # ... and was told to keep its blocks until free_now names it
    # Tokens vLLM's prefix cache gave it when it was last admitted (``get_num_new_matched_tokens``)
    local_hit_tokens: int = 0
    # Its leading blocks it did not compute itself (its prefix cache and pool hits at admission)
    computed_from: int = 0

    @property
    def rid(self) -> str:
        return self.request.request_id

    def full_blocks(self, block_tokens: int) -> int:
        """Blocks whose tokens are all computed."""
        req = self.request
        return min(req.num_computed_tokens, req.num_tokens) // block_tokens


class Part(Protocol):
    """What ``Requests.leave`` asks of every part that keeps per-request state."""

    def forget(self, rid: str) -> None:
        """Drop whatever is kept for ``rid`` (answers nobody waits for go back to the daemon
        as usual); a request not known is no error."""

    def tracked(self) -> Collection[str]:
        """The request ids it keeps anything for (for checks and tests, not the hot path)."""


class Requests:
    """Called from vLLM's scheduler thread only. ``parts`` are asked to forget a request that
    leaves; ``planner`` and ``pd`` set up their state when one is admitted."""

    def __init__(self, groups: list[GroupInfo], block_tokens: int, kv_producer: bool,
                 planner: "StorePlanner", pd: "PdStream", parts: Sequence[Part]) -> None:
        self._groups = groups
        self._block_tokens = block_tokens
        self._kv_producer = kv_producer
        self._planner = planner
        self._pd = pd
        self._parts = parts
        self._by_id: dict[str, ReqState] = {}

    def get(self, rid: str) -> ReqState | None:
        return self._by_id.get(rid)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[ReqState]:
        return iter(list(self._by_id.values()))

    def admit(self, request: Any) -> ReqState:
        """``request`` entered the scheduler (or came back under an id whose earlier request
        is still known: that one leaves first). A P/D producer (``kv_producer`` engine, or
        ``do_remote_decode``) stores every block; a consumer told how many tokens the prefill
        hands over (``kvpool_tokens``, whatever TP size the prefill ran: its ranks stored every
        head) waits for them."""
        rid = request.request_id
        if rid in self._by_id:
            self.leave(rid)
        params = request.kv_transfer_params or {}
        st = ReqState(request, RequestKeys(request, self._groups),
                      producer=self._kv_producer or bool(params.get("do_remote_decode")))
        self._by_id[rid] = st
        self._planner.track(st)
        blocks = int(params.get("kvpool_tokens") or 0) // (self._block_tokens or 1)
        if params.get("do_remote_prefill") and blocks:
            self._pd.expect(st, blocks)
        return st

    def leave(self, rid: str) -> None:
        """The one way out: ``rid`` is forgotten here and by every part."""
        self._by_id.pop(rid, None)
        for part in self._parts:
            part.forget(rid)

    def kept_by(self, rid: str) -> list[str]:
        """The parts (by class name) that keep state for ``rid``; empty once it left."""
        held = ["Requests"] if rid in self._by_id else []
        return held + [type(p).__name__ for p in self._parts if rid in p.tracked()]

    def kept_anywhere(self) -> dict[str, list[str]]:
        """Every request id some part keeps state for, and which parts: empty when every
        request has left (checked at the end of the connector's tests)."""
        out: dict[str, list[str]] = {rid: ["Requests"] for rid in self._by_id}
        for p in self._parts:
            for rid in p.tracked():
                out.setdefault(rid, []).append(type(p).__name__)
        return out
