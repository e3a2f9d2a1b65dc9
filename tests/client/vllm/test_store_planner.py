"""The store planner without vLLM: which full blocks a step stores, in budgets and pieces,
with tickets from a fake client's stock. Time is the parts' clock, which moves only when a test
moves it: a budget of 0 is spent at once, any other never is."""

from __future__ import annotations

from kvpool.client.vllm import store_planner

from .fakes import BT, NS, FakeClient, Rig, keys, request, state, step_output


def plan(rig: Rig, so) -> list:
    return rig.plan(so)


def test_a_prefill_stores_its_full_blocks_in_one_batch_with_tickets_from_the_stock():
    p = Rig(FakeClient(tickets=10))
    req = request("a", list(range(70)))           # 4 full blocks, 6 tokens over
    st = state(p, req)
    p.manager.tables["a"] = [11, 12, 13, 14, 15]
    [spec] = plan(p, step_output(new={"a": 70}))
    assert (spec.batch, spec.group, spec.granted_by) == (1, 0, "daemon-1")
    assert spec.tickets == [100, 101, 102, 103]
    assert spec.block_ids == [11, 12, 13, 14]
    assert spec.keys == keys(req, 0, 4)
    assert p.client.taken == [(NS, 4)]
    assert p.cursor("a") == [4] and p.planner.cursor("a").lo == 4
    assert p.batches.of("a") == {1}
    assert p.batches.keys_in_flight[0] == dict.fromkeys(keys(req, 0, 4), 1)
    assert p.batches.block_reader == {11: 1, 12: 1, 13: 1, 14: 1}
    # The next step has nothing new to store.
    req.num_computed_tokens = 70
    assert plan(p, step_output(cached={"a": 1})) == []


def test_keys_in_flight_or_committed_are_not_planned_again():
    p = Rig(FakeClient(tickets=10))
    tokens = list(range(40))                       # 2 full blocks
    state(p, request("a", tokens))
    p.manager.tables["a"] = [1, 2, 3]
    assert len(plan(p, step_output(new={"a": 40}))) == 1
    # b computed the same blocks while a's store is in flight: nothing to plan.
    state(p, request("b", tokens + [7] * 20))  # 3 full blocks: only the third is new
    p.manager.tables["b"] = [4, 5, 6, 7]
    [spec] = plan(p, step_output(new={"b": 60}))
    assert spec.block_ids == [6] and spec.keys == keys(request("b", tokens + [7] * 20), 2, 3)
    # Once committed (every rank acked), a third copy is not planned either.
    p.batches.acked({1: 1, 2: 1}, {})
    state(p, request("c", tokens + [7] * 20))
    p.manager.tables["c"] = [8, 9, 10, 11]
    assert plan(p, step_output(new={"c": 60})) == []
    assert p.client.tickets[NS] == list(range(103, 110))


def test_a_long_prefill_is_planned_in_pieces_within_the_budget(monkeypatch):
    monkeypatch.setattr(store_planner, "STORE_LATE_PIECE_BLOCKS", 3)
    p = Rig(FakeClient(tickets=20), plan_s=0.0)          # every step is late
    long = state(p, request("long", list(range(170))))      # 10 full blocks
    p.manager.tables["long"] = list(range(1, 12))
    per_step = [sum(len(s.keys) for s in plan(p, step_output(new={"long": 170})))]
    long.request.num_computed_tokens = 170
    for _ in range(4):
        per_step.append(sum(len(s.keys) for s in plan(p, step_output())))
    assert per_step == [3, 3, 3, 1, 0]
    assert list(p.planner.queue) == []


def test_pieces_of_an_ample_budget_plan_the_whole_prefill_in_one_step(monkeypatch):
    monkeypatch.setattr(store_planner, "STORE_PIECE_BLOCKS", 3)
    p = Rig(FakeClient(tickets=20))
    state(p, request("long", list(range(170))))
    p.manager.tables["long"] = list(range(1, 12))
    [spec] = plan(p, step_output(new={"long": 170}))
    assert spec.block_ids == list(range(1, 11))


def test_a_short_stock_cuts_the_runs_and_plans_the_rest_when_tickets_come():
    p = Rig(FakeClient(tickets=3, reserving=True))
    a = state(p, request("a", list(range(40))))           # 2 full blocks each
    b = state(p, request("b", list(range(500, 540))))
    p.manager.tables.update(a=[1, 2, 3], b=[4, 5, 6])
    [spec] = plan(p, step_output(new={"a": 40, "b": 40}))
    assert spec.block_ids == [1, 2, 4] and spec.tickets == [100, 101, 102]
    assert p.cursor("b") == [1] and p.planner.cursor("b").lo == 1
    assert list(p.planner.queue) == ["b"] and p.cursor("a") == [2]
    a.request.num_computed_tokens = b.request.num_computed_tokens = 40
    assert p.losses.total == 0
    # No ticket in hand, more coming: the queue waits (asking for tickets).
    assert plan(p, step_output()) == [] and p.client.taken[-1] == (NS, 0)
    p.client.tickets[NS] = [200]
    [spec] = plan(p, step_output())
    assert spec.block_ids == [5] and spec.tickets == [200] and spec.batch == 2


def test_a_short_stock_with_reservations_refused_counts_the_rest_lost():
    p = Rig(FakeClient(tickets=3, reserving=False))
    state(p, request("a", list(range(40))))
    b = state(p, request("b", list(range(500, 540))))
    p.manager.tables.update(a=[1, 2, 3], b=[4, 5, 6])
    [spec] = plan(p, step_output(new={"a": 40, "b": 40}))
    assert spec.block_ids == [1, 2, 4]
    assert p.losses.totals["reserve_refused"] == 1
    assert p.cursor("b") == [2] and list(p.planner.queue) == []


def test_the_policy_gathers_a_decode_run_and_stores_a_prefill_at_once():
    p = Rig(FakeClient())
    state(p, request("p", list(range(70)), computed=16))
    decode = state(p, request("d", list(range(100)), computed=99, prompt=70))
    p.planner.restart("d", 4)                     # its prompt's blocks are planned
    assert p.planner.blocks_to_gather("p") == 1
    assert p.planner.blocks_to_gather("d") == 8
    decode.finished = True
    assert p.planner.blocks_to_gather("d") == 1
    assert p.planner.store_run == 128 // BT


def test_a_decode_waits_for_its_run_of_blocks():
    p = Rig(FakeClient(tickets=20))
    st = state(p, request("d", list(range(70 + 50)), computed=70 + 49, prompt=70))
    p.planner.restart("d", 4)
    p.manager.tables["d"] = list(range(1, 9))
    assert plan(p, step_output(cached={"d": 1})) == []          # 7 full blocks: 3 new
    st.request.all_token_ids += list(range(80))
    st.request.num_tokens, st.request.num_computed_tokens = 200, 199
    p.manager.tables["d"] = list(range(1, 14))
    [spec] = plan(p, step_output(cached={"d": 1}))              # 12 full blocks: 8 new
    assert spec.block_ids == list(range(5, 13))


def test_nothing_is_planned_while_the_daemon_backs_off():
    p = Rig(FakeClient(tickets=10))
    state(p, request("a", list(range(40))))
    p.manager.tables["a"] = [1, 2, 3]
    p.link.failed(RuntimeError("down"))
    assert plan(p, step_output(new={"a": 40})) == []
    assert p.client.taken == []


def preempt(p: Rig, req, cached: dict[int, int]):
    """vLLM preempted ``req`` in this step's schedule(): its blocks are freed (its table gone,
    its computed tokens 0); ``cached`` maps its block indexes to the GPU blocks still in the
    prefix cache. Returns the step's ``SchedulerOutput``."""
    req.block_hashes = [f"h{req.request_id}{j}" for j in range(req.num_tokens // BT)]
    req.num_computed_tokens = 0
    p.manager.tables.pop(req.request_id, None)
    p.manager.block_pool.cached.update(
        {req.block_hashes[j]: bid for j, bid in cached.items()})
    return step_output()


def test_a_preempted_requests_unplanned_blocks_are_stored_from_the_prefix_cache():
    p = Rig(FakeClient(tickets=10), plan_s=0.0, step_s=0.0)
    a = request("a", list(range(50)), prompt=49)   # 3 full blocks: decoding
    a.num_output_tokens = 1
    st = state(p, a)
    p.planner.restart("a", 1)                     # block 0 was planned in an earlier step
    # Block 1 went to another request in the step that preempted a; blocks 2 and 0 are cached.
    so = preempt(p, a, {0: 10, 2: 13})
    [spec] = p.plan(so, [st])
    assert spec.block_ids == [13] and spec.keys == keys(a, 2, 3)
    assert p.losses.totals["preempted"] == 1      # block 1: reused before it was planned
    assert p.batches.of("a") == {spec.batch}


def test_a_preempted_request_with_no_ticket_in_hand_counts_its_blocks_lost():
    p = Rig(FakeClient(tickets=1, reserving=True))
    a = request("a", list(range(50)), prompt=49)
    a.num_output_tokens = 1
    st = state(p, a)
    so = preempt(p, a, {0: 10, 1: 11, 2: 12})
    [spec] = p.plan(so, [st])
    # Its blocks are free in vLLM: they cannot wait in the queue for the next step's slots.
    assert spec.block_ids == [10]
    assert p.losses.totals["preempted"] == 2 and not p.planner.queue


def test_under_memory_pressure_a_step_plans_the_whole_queue():
    # Budgets spent before planning starts: normally one late piece of one request a step.
    spent = dict(plan_s=0.0, step_s=0.0)

    def burst(p: Rig) -> list:
        for r in "abcd":
            state(p, request(r, [ord(r)] * 33))      # 2 full blocks each
            p.manager.tables[r] = [10 * ord(r), 10 * ord(r) + 1, 10 * ord(r) + 2]
        return plan(p, step_output(new=dict.fromkeys("abcd", 33)))

    calm = Rig(FakeClient(tickets=20), horizon_blocks=8, **spent)
    [spec] = burst(calm)
    assert len(spec.block_ids) == 2 and len(calm.planner.queue) == 3
    # Fewer free GPU blocks than one schedule() may take: a preemption may come next step.
    tight = Rig(FakeClient(tickets=20), horizon_blocks=8, **spent)
    tight.manager.block_pool.free = 7
    [spec] = burst(tight)
    assert len(spec.block_ids) == 8 and not tight.planner.queue


def test_a_state_group_stores_the_states_vllm_kept_from_its_table_or_its_prefix_cache():
    # A state group: block i holds the state after i + 1 blocks where vLLM kept one. The table
    # still holds the state after 2 blocks (block 21); vLLM already let go of the one after 1
    # (block 20: null in the table, still cached under its hash); it kept none after 3 or 4.
    from dataclasses import replace

    from .fakes import GROUP

    p = Rig(FakeClient(tickets=10), groups=(replace(GROUP, state=True),))
    assert p.planner.store_run == 1     # a decode's states go the step they fill
    req = request("a", list(range(70)))
    req.block_hashes = [f"h{i}" for i in range(4)]
    state(p, req)
    p.manager.tables["a"] = [0, 0, 21, 0, 0]
    p.manager.block_pool.cached["h1"] = 20
    [spec] = plan(p, step_output(new={"a": 70}))
    assert spec.block_ids == [20, 21] and spec.keys == keys(req, 1, 3)
    assert p.cursor("a") == [4]
