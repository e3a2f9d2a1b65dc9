"""Loads: a pool hit turned into load specs once vLLM allocated its blocks, until reported done.

Owns the loads in flight: the GPU blocks each one writes (a reported invalid block among them
fails it) and the keys being loaded (so a second request wanting them waits for the first and
then takes them from vLLM's GPU prefix cache instead of loading them twice). ``start`` turns the
hit ``lookups.py`` hands over into load specs and returns them; ``finished`` reads a step's
load reports (``finished_recving``, failed loads, invalid blocks) and returns which loads ended
and whether they failed, for the role to tell the lookups (pins go, a failed hit is never
offered again) and the store planner (recomputed blocks are stored again). A P/D hand-off still
landing streams its other chunks through ``pd_stream.py``. Never calls the daemon and never
waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any, Collection, Iterable, NamedTuple

from kvpool.client.vllm.hybrid import MISSING
from kvpool.client.vllm.requests import ReqState
from kvpool.client.vllm.specs import LoadSpec

if TYPE_CHECKING:
    from kvpool.client.vllm.lookups import Hit


class LoadPlan(NamedTuple):
    """What ``Loads.start`` made of a hit vLLM accepted."""

    end: int                   # end of the external blocks (a hand-off may stream up to it)
    first: int                 # first block not in the pool yet (== end unless streaming)
    specs: list[LoadSpec]      # for this step's metadata
    pooled: int                # leading blocks the load brings in from the pool


@dataclass(eq=False, slots=True)
class _Load:
    blocks: list[int]          # GPU blocks it writes
    keys: list[bytes]          # group-0 keys it loads (others wanting them wait)


class Loads:
    """Called from vLLM's scheduler thread only."""

    def __init__(self, groups: list[Any], block_tokens: int) -> None:
        self.groups = groups
        self.block_tokens = block_tokens
        self._loads: dict[str, _Load] = {}
        # Group-0 keys of loads in flight -> the request loading them. One loader per key (the
        # others wait for it, see waits_for), so marks are set and cleared per request with
        # C-level dict operations.
        self.loading_keys: dict[bytes, str] = {}

    def busy(self, rid: str) -> bool:
        """``rid``'s load is in flight (vLLM holds it in WAITING_FOR_REMOTE_KVS)."""
        return rid in self._loads

    def waits_for(self, st: ReqState, num_computed_tokens: int, end: int) -> bool:
        """Another request is loading some of ``st``'s blocks before ``end``: wait for it and
        take them from the GPU prefix cache then, instead of loading them twice."""
        if not self.loading_keys:
            return False
        first = num_computed_tokens // self.block_tokens
        return not self.loading_keys.keys().isdisjoint(
            st.keys.range(st.request, 0, first, end))

    def start(self, st: ReqState, hit: "Hit", table: Any,
              num_external_tokens: int) -> LoadPlan:
        """vLLM accepted ``num_external_tokens`` of ``hit`` and allocated GPU blocks
        (``table``: per vLLM group, block ids): the specs of the blocks the pool holds now (not
        final when the rest of a hand-off streams in later), or one that loads nothing, so the
        workers still report the request received and vLLM lets it go on."""
        request = st.request
        rid = request.request_id
        bt = self.block_tokens
        local_blocks = hit.local_tokens // bt
        end = (hit.local_tokens + num_external_tokens) // bt
        assert end <= hit.offered, "vLLM accepted more external tokens than offered"
        pooled = min(end, hit.blocks)   # blocks in the pool now; the rest of a hand-off streams
        first = max(pooled, local_blocks)
        streams = end > first
        specs = []
        unloadable = False
        for gi, g in enumerate(self.groups):
            ids = table[g.index]
            slots, bids, keys = [], [], []
            known = hit.keys[gi] if gi < len(hit.keys) else []
            for i in range(local_blocks, pooled):
                if i >= len(ids) or ids[i] == 0:     # a null block: outside the window
                    continue
                k = i - hit.starts[gi]
                if not 0 <= k < len(hit.slots[gi]) or hit.slots[gi][k] == MISSING:
                    # vLLM keeps more of the window (or of a state group) than the pool
                    # offered: never leave a block it counts as computed unwritten; fail the
                    # whole load and let it recompute.
                    unloadable = True
                    continue
                slots.append(hit.slots[gi][k])
                bids.append(ids[i])
                if k < len(known):
                    keys.append(known[k])
            if slots:
                specs.append(LoadSpec(rid, gi, slots, bids, final=not streams,
                                      keys=keys if len(keys) == len(slots) else []))
        if unloadable:
            specs = [LoadSpec(rid, 0, [], [b for spec in specs for b in spec.block_ids],
                              failed=True, final=not streams)]
        blocks = [b for spec in specs for b in spec.block_ids]
        if streams:
            for g in self.groups:
                blocks.extend(table[g.index][first:end])
        elif not specs:
            specs = [LoadSpec(rid, 0, [], [])]
        keys = st.keys.range(request, 0, local_blocks, end)
        self._loads[rid] = _Load(blocks, keys)
        self.loading_keys.update(dict.fromkeys(keys, rid))
        return LoadPlan(end, first, specs, 0 if unloadable else pooled)

    def finished(self, finished_recving: Iterable[str] | None,
                 failed_recving: Iterable[str] | None, invalid_block_ids: set[int] | None
                 ) -> list[tuple[str, bool]]:
        """The workers reported these loads done (``KVConnectorOutput``'s fields): (request
        id, whether its load failed) for each load of ours that ended."""
        failed = set(failed_recving or ())
        invalid = invalid_block_ids or set()
        out = []
        for rid in finished_recving or ():
            load = self._loads.pop(rid, None)
            if load is None:
                continue
            deque(map(self.loading_keys.pop, load.keys, repeat(None)), maxlen=0)
            out.append((rid, rid in failed
                        or bool(invalid and not invalid.isdisjoint(load.blocks))))
        return out

    def forget(self, rid: str) -> None:
        load = self._loads.pop(rid, None)
        if load is not None:
            deque(map(self.loading_keys.pop, load.keys, repeat(None)), maxlen=0)

    def tracked(self) -> Collection[str]:
        return self._loads.keys()
