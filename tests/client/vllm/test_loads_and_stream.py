"""Loads and the P/D stream without vLLM: a hit becomes load specs once blocks are allocated,
a load's report releases its leases, and a hand-off still landing streams in chunks."""

from __future__ import annotations

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.loads import Loads
from kvpool.client.vllm.lookups import Lookups
from kvpool.client.vllm.pd_stream import PdStream
from kvpool.client.vllm.specs import LoadSpec

from .fakes import BT, GROUP, Clock, FakeClient, budgets, keys, request, state


class Wired:
    def __init__(self, pd_wait_s: float = 3.0) -> None:
        self.client = FakeClient()
        self.clock = Clock()
        b = budgets(self.clock, pd_wait_s=pd_wait_s)
        self.reqs: dict = {}
        self.step_loads: list[LoadSpec] = []
        link = DaemonLink(self.client, b)
        self.pd = PdStream([GROUP], BT, self.reqs, self.step_loads, b)
        self.lookups = Lookups([GROUP], BT, self.client, link, self.reqs, self.pd, [{}], b)
        self.loads = Loads([GROUP], BT, self.reqs, self.step_loads, self.lookups)


def hit(st, n: int, slots: list[int], lease: int) -> None:
    st.hit, st.hit_start, st.slots, st.leases = n, [0], [slots], [lease]


def test_a_hit_becomes_load_specs_and_its_report_releases_the_lease():
    w = Wired()
    st = state(w.reqs, request("a", list(range(70))))
    hit(st, 4, [30, 31, 32, 33], 9)
    st.local_tokens = 16                          # block 0 is in the GPU prefix cache
    end, first, loads = w.loads.start(st, ([5, 6, 7, 8, 9],), 3 * BT)
    assert (end, first) == (4, 4)
    assert w.step_loads == loads == [LoadSpec("a", 0, [31, 32, 33], [6, 7, 8])]
    assert st.loading and st.pooled == 4 and st.load_blocks == [6, 7, 8]
    assert list(w.loads.loading_keys) == keys(st.request, 1, 4)
    # Another request wanting those blocks waits for this load.
    b = state(w.reqs, request("b", list(range(70)) + [1]))
    assert w.loads.waits_for(b, 0, 4) and not w.loads.waits_for(b, 64, 4)
    w.loads.finished(["a"], None, None)
    assert not st.loading and w.loads.loading_keys == {}
    assert w.lookups.release == [9] and st.leases == [] and not st.load_failed


def test_a_failed_load_is_stored_again_and_never_offered_again():
    w = Wired()
    st = state(w.reqs, request("a", list(range(70))))
    hit(st, 4, [30, 31, 32, 33], 9)
    w.loads.start(st, ([5, 6, 7, 8],), 4 * BT)
    st.set_cursor(4)
    st.finished = True
    w.loads.finished(["a"], None, {7})            # one block came back invalid
    assert st.load_failed and st.cursor == [0] and st.pooled == 0
    assert w.reqs == {}                           # finished meanwhile: forgotten


def test_a_hand_off_streams_its_chunks_as_they_commit():
    w = Wired()
    st = state(w.reqs, request("d", list(range(70)), do_remote_prefill=True,
                               kvpool_tokens=64))
    st.expect_blocks, st.wait_until = 4, w.clock() + 3
    # One block landed: a consumer that can stream takes the whole hand-off.
    assert not w.pd.keeps_waiting(st, 1) and st.stream_to == 4
    assert w.pd.keeps_waiting(st, 0)              # nothing landed: ask again
    hit(st, 1, [40], 9)
    end, first, loads = w.loads.start(st, ([5, 6, 7, 8],), 4 * BT)
    assert (end, first) == (4, 1)
    w.pd.start(st, ([5, 6, 7, 8],), first, end, loads)
    assert [s.final for s in w.step_loads] == [False] and w.pd.streams == {"d"}
    assert (st.stream_next, st.stream_end, st.stream_ids) == (1, 4, [[5, 6, 7, 8]])
    assert w.pd.answer(st, [(1, 2, [41, 42], 0)])           # blocks 1, 2 came
    assert w.step_loads[-1] == LoadSpec("d", 0, [41, 42], [6, 7], final=False)
    assert not w.pd.answer(st, [(3, 1, [43], 0)])           # the last one
    assert w.step_loads[-1] == LoadSpec("d", 0, [43], [8], final=True)
    assert w.pd.streams == set() and st.stream_end == 0


def test_a_stalled_hand_off_reports_its_missing_blocks_as_load_errors():
    w = Wired(pd_wait_s=0.0)
    st = state(w.reqs, request("d", list(range(70))))
    st.expect_blocks, st.stream_to = 4, 4      # (as keeps_waiting leaves it)
    hit(st, 1, [40], 9)
    end, first, loads = w.loads.start(st, ([5, 6, 7, 8],), 4 * BT)
    w.pd.start(st, ([5, 6, 7, 8],), first, end, loads)
    w.pd.expire()
    assert w.step_loads[-1] == LoadSpec("d", 0, [], [6, 7, 8], failed=True)
    assert w.pd.streams == set() and st.stream_end == 0
