"""Loads and the P/D stream without vLLM: a hit becomes load specs once blocks are allocated,
a load's report says which loads ended and whether they failed, and a hand-off still landing
streams in chunks (time is the test's clock)."""

from __future__ import annotations

from kvpool.client.vllm.lookups import Hit
from kvpool.client.vllm.specs import LoadSpec

from .fakes import BT, FakeClient, Rig, keys, request, state


def hit(n: int, slots: list[int], local_tokens: int = 0, offered: int = 0) -> Hit:
    return Hit(n, max(n, offered), local_tokens, [0], [slots])


def consumer(w: Rig, rid: str = "d"):
    """A P/D decode request told the prefill hands over 4 blocks."""
    return state(w, request(rid, list(range(70)), do_remote_prefill=True, kvpool_tokens=64))


def test_a_hit_becomes_load_specs_and_its_report_ends_the_load():
    w = Rig(FakeClient())
    st = state(w, request("a", list(range(70))))
    # block 0 is in the GPU prefix cache
    load = w.loads.start(st, hit(4, [30, 31, 32, 33], local_tokens=16), ([5, 6, 7, 8, 9],),
                         3 * BT)
    assert (load.end, load.first, load.pooled) == (4, 4, 4)
    assert load.specs == [LoadSpec("a", 0, [31, 32, 33], [6, 7, 8])]
    assert w.loads.busy("a") and list(w.loads.loading_keys) == keys(st.request, 1, 4)
    # Another request wanting those blocks waits for this load.
    b = state(w, request("b", list(range(70)) + [1]))
    assert w.loads.waits_for(b, 0, 4) and not w.loads.waits_for(b, 64, 4)
    assert w.loads.finished(["a"], None, None) == [("a", False)]
    assert not w.loads.busy("a") and w.loads.loading_keys == {}
    assert w.loads.finished(["a"], None, None) == []      # reported once


def test_a_load_with_an_invalid_block_failed():
    w = Rig(FakeClient())
    st = state(w, request("a", list(range(70))))
    w.loads.start(st, hit(4, [30, 31, 32, 33]), ([5, 6, 7, 8],), 4 * BT)
    assert w.loads.finished(["a"], None, {7}) == [("a", True)]   # one block came back invalid
    state(w, request("b", list(range(70))))
    w.loads.start(w.requests.get("b"), hit(4, [30, 31, 32, 33]), ([1, 2, 3, 4],), 4 * BT)
    assert w.loads.finished(["b"], ["b"], None) == [("b", True)]


def test_all_blocks_local_still_sends_a_spec_so_the_request_is_reported():
    w = Rig(FakeClient())
    st = state(w, request("a", list(range(70))))
    load = w.loads.start(st, hit(2, [30, 31], local_tokens=32), ([5, 6, 7],), 0)
    assert load.specs == [LoadSpec("a", 0, [], [])] and (load.end, load.first) == (2, 2)


def test_a_hand_off_streams_its_chunks_as_they_commit():
    w = Rig(FakeClient())
    st = consumer(w)
    # One block landed: a consumer that can stream takes the whole hand-off.
    assert w.pd.admit(st, 1) == 4
    assert w.pd.admit(st, 0) is None              # nothing landed: ask again
    load = w.loads.start(st, hit(1, [40], offered=4), ([5, 6, 7, 8],), 4 * BT)
    assert (load.end, load.first) == (4, 1)
    assert [s.final for s in load.specs] == [False]
    w.pd.start(st, ([5, 6, 7, 8],), load.first, load.end)
    assert w.pd.streams == {"d"} and w.pd.span("d") == (1, 4)
    # blocks 1, 2 came (block 2 from a lower tier: ref 0, loaded by its key)
    assert w.pd.answer("d", [(1, 2, [41, 0], 0)], [[b"k1", b"k2", b"k3"]])
    assert w.pd.take_specs() == [LoadSpec("d", 0, [41, 0], [6, 7], final=False,
                                          keys=[b"k1", b"k2"])]
    assert not w.pd.answer("d", [(3, 1, [43], 0)], [[b"k3"]])     # the last one
    assert w.pd.take_specs() == [LoadSpec("d", 0, [43], [8], final=True, keys=[b"k3"])]
    assert w.pd.streams == set() and w.pd.span("d") is None


def test_a_stalled_hand_off_reports_its_missing_blocks_as_load_errors():
    w = Rig(FakeClient(), pd_wait_s=1.0)
    st = consumer(w)
    assert w.pd.admit(st, 1) == 4
    load = w.loads.start(st, hit(1, [40], offered=4), ([5, 6, 7, 8],), 4 * BT)
    w.pd.start(st, ([5, 6, 7, 8],), load.first, load.end)
    w.clock.now += 0.9
    w.pd.expire()                                 # still in time
    assert w.pd.take_specs() == [] and w.pd.span("d") == (1, 4)
    w.clock.now += 0.1
    w.pd.expire()
    assert w.pd.take_specs() == [LoadSpec("d", 0, [], [6, 7, 8], failed=True)]
    assert w.pd.streams == set() and w.pd.span("d") is None


def test_a_consumer_past_its_wait_takes_what_it_found():
    w = Rig(FakeClient(), pd_wait_s=1.0)
    st = consumer(w)
    assert w.pd.admit(st, 0) is None
    w.clock.now += 1.0
    assert w.pd.admit(st, 0) == 0                  # gives up waiting: recompute
