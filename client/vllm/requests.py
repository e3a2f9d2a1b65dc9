"""What the connector's scheduler side keeps about one vLLM request: ``ReqState``.

Owns the per-request fields and the few questions asked of them (full blocks, blocks not yet
stored, the store cursor); every part of the scheduler side reads and writes them, each its own
fields as noted. ``SchedulerRole`` owns the map of request id to ``ReqState`` and creates them;
parts look requests up in that map and drop a request from it when it is done with. Plain
data: no vLLM import, no daemon calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.client.vllm.keys import RequestKeys


@dataclass(eq=False)
class ReqState:
    request: Any               # vLLM's Request (or any object with its fields, in tests)
    keys: "RequestKeys"
    # lookups.py: IDLE → QUEUED → SENT → hit is not None (a result, with leases until consumed)
    state: str = "idle"
    target: int = 0            # block count the lookup asked for (the hit cannot exceed it)
    rounds: int = 0
    hit: int | None = None     # blocks available from the pool, from block 0
    answered_at: float = 0.0   # when the hit came: monotonic time and the step that took it
    answered_step: int = 0     # in (lookups._stale)
    hit_start: list[int] = field(default_factory=list)  # per group: block index of slots[g][0]
    slots: list[list[int]] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    local_tokens: int = 0      # GPU prefix hit seen by the last get_num_new_matched_tokens
    # loads.py
    loading: bool = False
    load_blocks: list[int] = field(default_factory=list)
    load_keys: list[bytes] = field(default_factory=list)
    # store_planner.py
    cursor: list[int] = field(default_factory=list)     # per group: next block to store
    lo: int = 0                # min(cursor): a request with no block past it has none to store
    pooled: int = 0            # leading blocks this request loaded from the pool (held there)
    store_run: int = 1         # blocks a running request's store waits to gather (1: producer)
    # store_batches.py
    batches: set[int] = field(default_factory=set)
    finishing: bool = False    # request_finished returned True: free via free_now
    finished: bool = False
    backlog_until: float = 0.0  # finished, blocks kept for stores waiting on tickets until then
    # P/D: a producer stores every block (also those it loaded) and hands the prompt over; a
    # consumer waits (bounded) for the producer's blocks to land before taking its hit.
    producer: bool = False
    load_failed: bool = False  # a load from the pool failed: recompute, never offer it again
    expect_blocks: int = 0
    wait_until: float = 0.0    # a hand-off making no progress until then is given up on
    # pd_stream.py: blocks [stream_next, stream_end) are allocated, not yet in the pool.
    stream_to: int = 0         # offered to vLLM beyond the hit (until the allocation)
    stream_next: int = 0
    stream_end: int = 0        # 0: not streaming
    stream_ids: list[list[int]] = field(default_factory=list)   # per group: GPU block ids

    def set_cursor(self, block: int) -> None:
        """Store from ``block`` on in every group (blocks before it need no store)."""
        self.cursor = [block] * len(self.cursor)
        self.lo = block

    def full_blocks(self, block_tokens: int) -> int:
        """Blocks whose tokens are all computed."""
        req = self.request
        return min(req.num_computed_tokens, req.num_tokens) // block_tokens

    def has_unstored_blocks(self, block_tokens: int) -> bool:
        return min(self.cursor) < self.full_blocks(block_tokens)
