"""Loads: a pool hit turned into load specs once vLLM allocated its blocks, until reported done.

Owns the loads in flight: the keys being loaded (so a second request wanting them waits for
the first and then takes them from vLLM's GPU prefix cache instead of loading them twice), and
what a load's report (``finished_recving``, failed loads and invalid blocks) does to a request:
its leases go to ``lookups.release``; a failed load is never offered again and its blocks are
stored again once recomputed. A hit's slots and leases come from ``lookups.py``; a P/D
hand-off still landing streams its other chunks through ``pd_stream.py``. Never calls the
daemon and never waits.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Any, Iterable

from kvpool.client.vllm.hybrid import MISSING
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import LoadSpec

if TYPE_CHECKING:
    from kvpool.client.vllm.lookups import Lookups


class Loads:
    """Called from vLLM's scheduler thread only; specs go to ``step_loads``, the list the
    scheduler hands over in the step's metadata."""

    def __init__(self, groups: list[Any], block_tokens: int, reqs: dict[str, ReqState],
                 step_loads: list[LoadSpec], lookups: "Lookups") -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self._reqs = reqs
        self._step_loads = step_loads
        self._lookups = lookups
        # Group-0 keys of loads in flight -> the request loading them. One loader per key (the
        # others wait for it, see waits_for), so marks are set and cleared per request with
        # C-level dict operations.
        self.loading_keys: dict[bytes, str] = {}

    def waits_for(self, st: ReqState, num_computed_tokens: int, end: int) -> bool:
        """Another request is loading some of ``st``'s blocks before ``end``: wait for it and
        take them from the GPU prefix cache then, instead of loading them twice."""
        if not self.loading_keys:
            return False
        first = num_computed_tokens // self.block_tokens
        return not self.loading_keys.keys().isdisjoint(
            st.keys.range(st.request, 0, first, end))

    def start(self, st: ReqState, table: Any, num_external_tokens: int
              ) -> tuple[int, int, list[LoadSpec]]:
        """vLLM accepted ``num_external_tokens`` of ``st``'s hit and allocated GPU blocks
        (``table``: per vLLM group, block ids): queue the specs of the blocks the pool holds
        now. Returns (end of the external blocks, first block not in the pool, the specs)."""
        request = st.request
        bt = self.block_tokens
        local_blocks = st.local_tokens // bt
        end = (st.local_tokens + num_external_tokens) // bt
        assert end <= max(st.hit, st.stream_to), "vLLM accepted more external tokens than offered"
        hit = min(end, st.hit)          # blocks in the pool now; the rest of a hand-off streams
        loads = []
        unloadable = False
        for gi, g in enumerate(self.groups):
            ids = table[g.index]
            slots, bids = [], []
            for i in range(local_blocks, hit):
                if i >= len(ids) or ids[i] == 0:     # a null block: outside the window
                    continue
                k = i - st.hit_start[gi]
                if not 0 <= k < len(st.slots[gi]) or st.slots[gi][k] == MISSING:
                    # vLLM keeps more of the window (or of a state group) than the pool
                    # offered: never leave a block it counts as computed unwritten; fail the
                    # whole load and let it recompute.
                    unloadable = True
                    continue
                slots.append(st.slots[gi][k])
                bids.append(ids[i])
            if slots:
                loads.append(LoadSpec(request.request_id, gi, slots, bids))
        if unloadable:
            loads = [LoadSpec(request.request_id, 0, [], [b for spec in loads
                                                          for b in spec.block_ids],
                              failed=True)]
        st.loading = True
        st.pooled = 0 if unloadable else hit
        st.load_blocks = [b for spec in loads for b in spec.block_ids]
        st.load_keys = st.keys.range(request, 0, local_blocks, end)
        self.loading_keys.update(dict.fromkeys(st.load_keys, request.request_id))
        self._step_loads.extend(loads)
        return end, max(hit, local_blocks), loads

    def nothing_to_copy(self, st: ReqState) -> None:
        """All needed blocks were local: the workers still report the request as received so
        vLLM leaves WAITING_FOR_REMOTE_KVS."""
        self._step_loads.append(LoadSpec(st.request.request_id, 0, [], []))

    def finished(self, finished_recving: Iterable[str] | None,
                 failed_recving: Iterable[str] | None, invalid_block_ids: set[int] | None
                 ) -> None:
        """The workers reported these loads done (``KVConnectorOutput``'s fields): their
        leases go; a failed one is stored again once recomputed, and never loaded again."""
        failed = set(failed_recving or ())
        invalid = invalid_block_ids or set()
        for rid in finished_recving or ():
            st = self._reqs.get(rid)
            if st is None or not st.loading:
                continue
            st.loading = False
            deque(map(self.loading_keys.pop, st.load_keys, repeat(None)), maxlen=0)
            st.load_keys = []
            self._lookups.release.extend(st.leases)
            st.leases, st.hit = [], None
            if rid in failed or (invalid and not invalid.isdisjoint(st.load_blocks)):
                st.set_cursor(0)    # recomputed blocks get stored again
                st.pooled = 0
                st.load_failed = True
            st.load_blocks = []
            if st.finished:
                self._reqs.pop(rid, None)
