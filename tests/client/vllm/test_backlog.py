"""The backlog without vLLM: a finished request with unplanned full blocks keeps them until
they are planned or store_wait_s passed (time is the test's clock), or at once gives them up
when the daemon is away or refuses reservations."""

from __future__ import annotations

from .fakes import BT, FakeClient, Rig, request, state


def finished(p: Rig, rid: str, tokens: int, planned_to: int):
    st = state(p, request(rid, list(range(tokens)), computed=tokens))
    p.planner.restart(rid, planned_to)
    st.finished = True
    return st


def test_a_finished_request_waits_in_the_backlog_then_leaves_with_its_blocks_unstored():
    p = Rig(FakeClient(reserving=True), store_wait_s=60.0)
    st = finished(p, "a", 70, 1)                  # 4 full blocks: 0 planned, 1..3 not yet
    assert p.backlog.keeps(st)
    assert p.backlog.holds("a") and list(p.planner.todo) == ["a"]
    p.clock.now += 59.9
    assert p.backlog.end([]) == []                # still in time: stays
    assert p.backlog.holds("a")
    p.clock.now += 0.1                            # waited store_wait_s: gives up
    assert p.backlog.end([]) == ["a"]
    assert not p.backlog and list(p.planner.todo) == []
    assert p.losses.totals["store_wait"] == 3 and p.losses.total == 3


def test_planned_backlog_requests_leave_with_nothing_lost():
    p = Rig(FakeClient(reserving=True), store_wait_s=60.0)
    st = finished(p, "a", 70, 1)
    assert p.backlog.keeps(st)
    p.planner.restart("a", 4)                     # the planner planned the rest
    p.planner.todo.pop("a")
    assert p.backlog.end(["a"]) == ["a"]
    assert not p.backlog and p.losses.total == 0


def test_nothing_to_plan_is_not_kept():
    p = Rig(FakeClient(reserving=True))
    assert not p.backlog.keeps(finished(p, "a", 70, 4))
    assert not p.backlog and p.losses.total == 0


def test_no_daemon_or_refused_reservations_count_a_finished_requests_blocks_at_once():
    p = Rig(FakeClient(reserving=False))
    st = finished(p, "a", 70, 0)
    assert not p.backlog.keeps(st)
    assert p.losses.totals["reserve_refused"] == 4
    p.client.is_reserving = True
    p.link.failed(RuntimeError("down"))
    assert not p.backlog.keeps(st)
    assert p.losses.totals["daemon_unavailable"] == 4
    assert not p.backlog


def test_the_backlog_empties_when_the_daemon_goes_away():
    p = Rig(FakeClient(reserving=True), store_wait_s=60.0)
    for rid in ("a", "b"):
        assert p.backlog.keeps(finished(p, rid, 40, 0))
    p.link.failed(RuntimeError("down"))
    assert p.backlog.end([]) == ["a", "b"]
    assert p.losses.totals["daemon_unavailable"] == 2 * (40 // BT)
    assert not p.backlog and list(p.planner.todo) == []
