"""Store batches without vLLM: acks from every rank resolve a batch, a failed rank aborts its
tickets, and a request whose last batch resolved is handed back to the role."""

from __future__ import annotations

from kvpool.client.vllm import store_batches as batches_module

from .fakes import FakeClient, Rig, keys, request, state


def batch_for(p: Rig, st, blocks: list[int], tickets: list[int]):
    """A store batch of ``st``'s first ``len(blocks)`` blocks from GPU ``blocks``."""
    n = len(blocks)
    p.planner.restart(st.request.request_id, n)
    return p.batches.add(0, [(st, range(n), keys(st.request, 0, n), blocks)], tickets, "g")


def test_a_batch_resolves_only_when_every_rank_acked_it():
    p = Rig(FakeClient(), world_size=2)
    st = state(p, request("a", list(range(40))))
    spec = batch_for(p, st, [7, 8], [100, 101, 102])
    assert spec.tickets == [100, 101] and spec.batch == 1 and p.batches.of("a") == {1}
    assert p.batches.acked({1: 1}, {}) == []
    assert list(p.batches.by_id) == [1] and p.batches.by_id[1].done == 1
    assert p.batches.committed[0] == {}
    assert p.batches.acked({1: 1}, {}) == [st]     # its last batch resolved
    assert p.batches.by_id == {} and not p.batches.pending("a")
    assert list(p.batches.committed[0]) == keys(st.request, 0, 2)
    assert p.batches.keys_in_flight[0] == {}
    assert p.batches.abort_tickets == [] and p.losses.total == 0
    assert p.batches.acked({1: 1}, {}) == []       # a late ack of a resolved batch: ignored
    assert p.batches.by_id == {}


def test_a_failed_rank_aborts_the_tickets_and_counts_the_blocks_lost():
    p = Rig(FakeClient(), world_size=2)
    st = state(p, request("a", list(range(40))))
    batch_for(p, st, [7, 8], [100, 101])
    assert p.batches.acked({1: 2}, {1: 1}) == [st]
    assert p.batches.by_id == {} and p.batches.committed[0] == {}
    assert p.batches.abort_tickets == [100, 101]
    assert p.losses.totals["store_failed"] == 2 and p.losses.total == 2
    p.batches.send_aborts()
    assert p.client.aborted == [[100, 101]] and p.batches.abort_tickets == []


def test_a_request_settles_once_its_last_batch_resolves():
    p = Rig(FakeClient())
    st = state(p, request("a", list(range(40)), computed=40))
    batch_for(p, st, [7], [100])
    batch_for(p, st, [7, 8], [101, 102])
    assert p.batches.of("a") == {1, 2}
    assert p.batches.acked({1: 1}, {}) == [] and p.batches.pending("a")
    assert p.batches.acked({2: 1}, {}) == [st] and not p.batches.pending("a")


def test_a_request_that_left_is_not_settled_but_its_batch_still_resolves():
    p = Rig(FakeClient())
    st = state(p, request("a", list(range(40)), computed=40))
    batch_for(p, st, [7, 8], [100, 101])
    p.requests.leave("a")
    assert "a" not in p.batches.tracked() and p.batches.by_id
    assert p.batches.acked({1: 1}, {}) == [] and p.batches.by_id == {}
    assert list(p.batches.committed[0]) == keys(st.request, 0, 2)


def test_blocks_handed_to_another_request_flush_the_batches_reading_them():
    p = Rig(FakeClient())
    st = state(p, request("a", list(range(40))))
    batch_for(p, st, [7, 8], [100, 101])
    assert p.batches.reading([8, 9]) == {1}
    assert p.batches.reading([9]) == set()
    p.batches.acked({1: 1}, {})
    assert p.batches.reading([8]) == set()        # resolved: nothing to wait for


def test_remembered_keys_are_bounded_and_the_newest_kept(monkeypatch):
    monkeypatch.setattr(batches_module, "_MAX_REMEMBERED_KEYS", 3)
    p = Rig(FakeClient())
    a = state(p, request("a", list(range(64))))
    batch_for(p, a, [1, 2, 3, 4], [100, 101, 102, 103])
    p.batches.acked({1: 1}, {})
    assert list(p.batches.committed[0]) == keys(a.request, 1, 4)
