"""SchedulerRole over its real parts (wired by build_parts) with a fake daemon client and fake
vLLM objects: a request leaves through one exit, after which no part keeps anything for it,
whether it finished with stores in flight, waited in the backlog, was aborted mid-load,
preempted, or replaced under its id. Time is the test's clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvpool.client.vllm.meta import WorkerAcks  # noqa: E402
from kvpool.client.vllm.parts import RoleSettings  # noqa: E402
from kvpool.client.vllm.scheduler import SchedulerRole  # noqa: E402

from .fakes import (GROUP, Clock, FakeClient, FakeManager, budgets,  # noqa: E402
                    request, step_output)

pytestmark = pytest.mark.vllm


class Engine:
    """The role as the connector builds it, on fakes."""

    def __init__(self, tickets: int = 20, reserving: bool = True, **seconds: float) -> None:
        self.client = FakeClient(tickets, reserving)
        self.clock = Clock()
        self.role = SchedulerRole(self.client, RoleSettings(
            [GROUP], budgets(self.clock, **seconds), events_enabled=False))
        self.manager = FakeManager()
        self.role.bind_kv_cache_manager(self.manager)

    def step(self, **kw) -> object:
        return self.role.build_connector_meta(step_output(**kw))

    def looked_up(self, req, hits: int, slots: list[int], lease: int) -> tuple:
        """vLLM asks about ``req`` (new, nothing on the GPU), the step's lookup goes out and
        is answered ``hits``; what vLLM is told then."""
        role = self.role
        role.on_new_request(req)
        assert role.get_num_new_matched_tokens(req, 0) == (None, False)
        self.step()
        self.client.calls[-1].answer([hits], [slots], [lease])
        return role.get_num_new_matched_tokens(req, 0)

    def left(self, rid: str) -> bool:
        return self.role.requests.kept_by(rid) == []


def alloc(ids: list[int]) -> SimpleNamespace:
    """vLLM's ``KVCacheBlocks`` for one group."""
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def output(done: dict[int, int] | None = None, recv: set[str] | None = None,
           failed: set[str] | None = None) -> SimpleNamespace:
    """vLLM's ``KVConnectorOutput``: store batches acked, loads reported."""
    return SimpleNamespace(kv_connector_worker_meta=WorkerAcks(done or {}, {}),
                           finished_recving=recv, failed_recving=failed,
                           invalid_block_ids=set())


def prefilled(e: Engine, rid: str = "a") -> tuple:
    """A 70-token request that missed the pool, computed in one step; its store batch."""
    req = request(rid, list(range(70)))
    assert e.looked_up(req, 0, [], 0) == (0, False)
    e.role.update_state_after_alloc(req, alloc([11, 12, 13, 14, 15]), 0)
    e.manager.tables[rid] = [11, 12, 13, 14, 15]
    meta = e.step(new={rid: 70})
    req.num_computed_tokens = 70
    [spec] = meta.stores
    return req, spec


def test_a_finished_request_with_stores_in_flight_is_freed_once_they_resolve_then_leaves():
    e = Engine()
    req, spec = prefilled(e)
    assert e.role.request_finished(req) == (True, None)
    assert e.role.requests.kept_by("a") == ["Requests", "Lookups", "StorePlanner",
                                             "StoreBatches"]
    e.role.update_connector_output(output(done={spec.batch: 1}))
    assert e.left("a")
    assert e.step().free_now == ["a"] and e.step().free_now == []
    assert e.role.requests.kept_anywhere() == {}


def test_a_finished_request_with_nothing_in_flight_leaves_at_once():
    e = Engine()
    req = request("a", list(range(70)), computed=70)
    assert e.looked_up(req, 0, [], 0) == (0, False)
    e.role.update_state_after_alloc(req, alloc([11, 12, 13, 14, 15]), 0)
    e.role.planner.restart("a", 4)                 # (as if its blocks were stored)
    assert e.role.request_finished(req) == (False, None)
    assert e.left("a") and e.role.requests.kept_anywhere() == {}


def test_a_backlogged_request_leaves_after_store_wait_and_is_freed():
    e = Engine(tickets=0, store_wait_s=5.0)         # no ticket in hand, more coming
    req = request("a", list(range(70)))
    assert e.looked_up(req, 0, [], 0) == (0, False)
    e.role.update_state_after_alloc(req, alloc([11, 12, 13, 14, 15]), 0)
    e.manager.tables["a"] = [11, 12, 13, 14, 15]
    assert e.step(new={"a": 70}).stores == []
    req.num_computed_tokens = 70
    assert e.role.request_finished(req) == (True, None)
    assert "Backlog" in e.role.requests.kept_by("a")
    e.clock.now += 4.9
    assert e.step().free_now == [] and e.step().free_now == []
    e.clock.now += 0.1
    e.step()                                       # it leaves the backlog...
    assert e.left("a") and e.step().free_now == ["a"]    # ...and vLLM may free its blocks
    assert e.role.losses.totals["store_wait"] == 4
    assert e.role.requests.kept_anywhere() == {}


def loading(e: Engine):
    """A 70-token request whose 4 full blocks the pool holds (slots 30-33, lease 9), its load
    started into GPU blocks 5-8."""
    req = request("a", list(range(70)))
    assert e.looked_up(req, 4, [30, 31, 32, 33], 9) == (64, True)
    e.role.update_state_after_alloc(req, alloc([5, 6, 7, 8, 9]), 64)
    return req


def test_a_request_aborted_mid_load_leaves_when_the_load_is_reported():
    e = Engine()
    req = loading(e)
    [load] = e.step().loads
    assert load.slots == [30, 31, 32, 33] and load.block_ids == [5, 6, 7, 8]
    assert e.role.request_finished(req) == (False, None)   # vLLM keeps its blocks meanwhile
    assert "Loads" in e.role.requests.kept_by("a") and e.client.released == []
    e.role.update_connector_output(output(recv={"a"}))
    assert e.left("a")
    e.step()
    assert e.client.released == [[9]]                      # its pins went back
    assert e.role.requests.kept_anywhere() == {}


def test_a_failed_load_is_stored_again_and_never_offered_again():
    e = Engine()
    req = loading(e)
    assert e.role.planner.cursor("a").cursor == [4]
    e.step()
    e.role.update_connector_output(output(recv={"a"}, failed={"a"}))
    assert e.role.planner.cursor("a").cursor == [0]
    assert e.role.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not e.left("a")                                 # it runs on, recomputing


def test_a_preempted_request_flushes_its_stores_and_restarts_its_cursor():
    e = Engine()
    req, spec = prefilled(e)
    req.num_computed_tokens = 0                            # vLLM preempted it
    meta = e.step(preempted=("a",))
    assert meta.flush_batches == [spec.batch]
    assert e.role.planner.cursor("a").cursor == [0]
    e.role.update_connector_output(output(done={spec.batch: 1}))
    assert e.role.request_finished(req) == (False, None)
    assert e.left("a") and e.role.requests.kept_anywhere() == {}


def test_a_request_replaced_under_its_id_lets_the_old_one_go():
    e = Engine()
    old = request("a", list(range(70)))
    assert e.looked_up(old, 4, [30, 31, 32, 33], 9) == (64, True)
    new = request("a", list(range(500, 570)))
    e.role.on_new_request(new)
    assert e.role.requests.get("a").request is new
    assert e.role.lookups.release == [9]                   # the old answer's pins go back


def test_a_daemon_that_is_down_costs_no_request_its_exit():
    e = Engine()
    req, spec = prefilled(e)
    e.client.up = False
    assert e.role.request_finished(req) == (True, None)    # its batch is still in flight
    e.role.update_connector_output(output(done={spec.batch: 1}))
    assert e.step().free_now == ["a"] and e.left("a")
    assert e.role.requests.kept_anywhere() == {}
