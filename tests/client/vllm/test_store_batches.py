"""Store batches and the backlog without vLLM: acks from every rank resolve a batch, a failed
rank aborts its tickets, finished requests keep their blocks until stored or given up."""

from __future__ import annotations

from kvpool.client.vllm import store_batches as batches_module

from .fakes import BT, FakeClient, Parts, keys, request, state


def batch_for(p: Parts, st, blocks: list[int], tickets: list[int]):
    """A store batch of ``st``'s first ``len(blocks)`` blocks from GPU ``blocks``."""
    n = len(blocks)
    st.set_cursor(n)
    return p.batches.add(0, [(st, range(n), keys(st.request, 0, n), blocks)], tickets, "g")


def test_a_batch_resolves_only_when_every_rank_acked_it():
    p = Parts(FakeClient(), world_size=2)
    st = state(p.reqs, request("a", list(range(40))))
    spec = batch_for(p, st, [7, 8], [100, 101, 102])
    assert spec.tickets == [100, 101] and spec.batch == 1 and st.batches == {1}
    p.batches.acked({1: 1}, {})
    assert list(p.batches.by_id) == [1] and p.batches.by_id[1].done == 1
    assert p.batches.committed[0] == {}
    p.batches.acked({1: 1}, {})
    assert p.batches.by_id == {} and st.batches == set()
    assert list(p.batches.committed[0]) == keys(st.request, 0, 2)
    assert p.batches.keys_in_flight[0] == {}
    assert p.batches.abort_tickets == [] and p.losses.total == 0
    p.batches.acked({1: 1}, {})                   # a late ack of a resolved batch: ignored
    assert p.batches.by_id == {}


def test_a_failed_rank_aborts_the_tickets_and_counts_the_blocks_lost():
    p = Parts(FakeClient(), world_size=2)
    st = state(p.reqs, request("a", list(range(40))))
    batch_for(p, st, [7, 8], [100, 101])
    p.batches.acked({1: 2}, {1: 1})
    assert p.batches.by_id == {} and p.batches.committed[0] == {}
    assert p.batches.abort_tickets == [100, 101]
    assert p.losses.totals["store_failed"] == 2 and p.losses.total == 2
    p.batches.send_aborts()
    assert p.client.aborted == [[100, 101]] and p.batches.abort_tickets == []


def test_a_finishing_request_is_freed_when_its_last_batch_resolves():
    p = Parts(FakeClient())
    st = state(p.reqs, request("a", list(range(40)), computed=40))
    batch_for(p, st, [7], [100])
    batch_for(p, st, [7, 8], [101, 102])
    assert st.batches == {1, 2}
    st.finished = True
    assert not p.backlog.keeps(st)                # every full block is in a batch
    st.finishing = True
    p.batches.acked({1: 1}, {})
    assert p.backlog.free_ready == [] and "a" in p.reqs
    p.batches.acked({2: 1}, {})
    assert p.backlog.take_free() == ["a"] and p.reqs == {}
    assert p.backlog.free_ready == []


def test_blocks_handed_to_another_request_flush_the_batches_reading_them():
    p = Parts(FakeClient())
    st = state(p.reqs, request("a", list(range(40))))
    batch_for(p, st, [7, 8], [100, 101])
    assert p.batches.reading([8, 9]) == {1}
    assert p.batches.reading([9]) == set()
    p.batches.acked({1: 1}, {})
    assert p.batches.reading([8]) == set()        # resolved: nothing to wait for


def test_remembered_keys_are_bounded_and_the_newest_kept(monkeypatch):
    monkeypatch.setattr(batches_module, "_MAX_REMEMBERED_KEYS", 3)
    p = Parts(FakeClient())
    a = state(p.reqs, request("a", list(range(64))))
    batch_for(p, a, [1, 2, 3, 4], [100, 101, 102, 103])
    p.batches.acked({1: 1}, {})
    assert list(p.batches.committed[0]) == keys(a.request, 1, 4)


def test_a_finished_request_waits_in_the_backlog_then_frees_its_blocks_unstored():
    p = Parts(FakeClient(reserving=True), store_wait_s=60.0)
    st = state(p.reqs, request("a", list(range(70)), computed=70))   # 4 full blocks
    st.set_cursor(1)                              # block 0 stored, 1..3 not yet
    st.finished = True
    assert p.backlog.keeps(st)
    assert list(p.backlog.backlog) == ["a"] and list(p.backlog.todo) == ["a"]
    p.clock.now += 59.9
    p.backlog.end()                               # still in time: stays
    assert list(p.backlog.backlog) == ["a"] and p.backlog.free_ready == []
    p.clock.now += 0.1                            # waited store_wait_s: gives up
    p.backlog.end()
    assert p.backlog.backlog == {} and p.backlog.todo == {}
    assert p.losses.totals["store_wait"] == 3 and p.losses.total == 3
    assert p.backlog.take_free() == ["a"] and p.reqs == {}


def test_a_backlogged_request_with_a_batch_in_flight_waits_for_it():
    p = Parts(FakeClient(reserving=True), store_wait_s=0.0)
    st = state(p.reqs, request("a", list(range(70)), computed=70))
    batch_for(p, st, [1, 2, 3, 4], [100, 101, 102, 103])
    st.finished = True
    st.set_cursor(2)                              # (as if blocks 2, 3 were cut by the stock)
    assert p.backlog.keeps(st)
    st.finishing = True
    p.backlog.end()
    assert p.backlog.backlog == {} and p.losses.totals["store_wait"] == 2
    assert p.backlog.free_ready == [] and "a" in p.reqs      # its batch still reads blocks
    p.batches.acked({1: 1}, {})
    assert p.backlog.take_free() == ["a"] and p.reqs == {}


def test_planned_backlog_requests_leave_at_the_next_step():
    p = Parts(FakeClient(reserving=True), store_wait_s=60.0)
    st = state(p.reqs, request("a", list(range(70)), computed=70))
    st.set_cursor(1)
    st.finished = True
    assert p.backlog.keeps(st)
    st.set_cursor(4)                              # the planner planned the rest
    p.backlog.todo.pop("a")
    p.backlog.planned.append("a")
    p.backlog.end()
    assert p.backlog.backlog == {} and p.losses.total == 0
    assert p.backlog.take_free() == ["a"]


def test_no_daemon_or_refused_reservations_count_a_finished_requests_blocks_at_once():
    p = Parts(FakeClient(reserving=False))
    st = state(p.reqs, request("a", list(range(70)), computed=70))
    st.finished = True
    assert not p.backlog.keeps(st)
    assert p.losses.totals["reserve_refused"] == 4
    p.client.is_reserving = True
    p.link.failed(RuntimeError("down"))
    assert not p.backlog.keeps(st)
    assert p.losses.totals["daemon_unavailable"] == 4
    assert p.backlog.backlog == {}


def test_the_backlog_empties_when_the_daemon_goes_away():
    p = Parts(FakeClient(reserving=True), store_wait_s=60.0)
    sts = [state(p.reqs, request(r, list(range(40)), computed=40)) for r in ("a", "b")]
    for st in sts:
        st.finished = True
        assert p.backlog.keeps(st)
    p.link.failed(RuntimeError("down"))
    p.backlog.end()
    assert p.losses.totals["daemon_unavailable"] == 2 * (40 // BT)
    assert p.backlog.take_free() == ["a", "b"] and p.reqs == {}
