"""KVPoolConnector under vLLM's real Scheduler and AsyncScheduler, against a real kvpoold.

Every test drives the engine through ``bench.vllm_scheduler.Engine`` (real scheduler, fake workers on
host shm tensors) and ends with ``assert_clean``: no request left, no GPU block leaked, no
connector state, and no lease or transfer left in the daemon for the engine.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.client.vllm.meta import WorkerAcks  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

from bench.vllm_scheduler import BS, Engine, fake_token  # noqa: E402
from tests.integration.vllm_params import SCHEDULERS, STEP_SPEEDS  # noqa: E402

pytestmark = pytest.mark.vllm

# Budgets that leave store planning one late piece a step (no overdue budget either).
NO_PLANNING_TIME = {"store_plan_budget_us": 0, "store_pressure_budget_us": 0,
                    "store_overdue_after_s": 60}


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def seed(e: Engine, tokens: list[int], rid: str = "seed", max_tokens: int = 1) -> None:
    """Run one request to the end, then empty the GPU prefix cache (the pool keeps it)."""
    e.add(rid, tokens, max_tokens=max_tokens)
    e.run()
    assert e.sched.reset_prefix_cache()


def spy_planned_blocks(role) -> list[int]:
    """Blocks the scheduler role plans to store, per step (appended as steps run)."""
    planned: list[int] = []
    plan = role.planner.plan

    def spy(so, step_started, preempted, manager):
        specs, finished = plan(so, step_started, preempted, manager)
        planned.append(sum(len(s.keys) for s in specs))
        return specs, finished

    role.planner.plan = spy
    return planned


def window_group(role) -> int:
    """The index of the hybrid model's sliding-window KV cache group."""
    return next(g.index for g in role.groups if g.window_blocks)


def reuse_every_free_block(manager) -> None:
    """Take every free GPU block and give it back, as an allocation would: blocks freed but
    still in vLLM's prefix cache lose their hashes."""
    pool = manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))


def spy_finished_answers(role) -> list:
    """What the scheduler role's request_finished answers vLLM (appended as requests end)."""
    answers: list = []
    finished = role.request_finished

    def spy(request):
        answers.append(finished(request))
        return answers[-1]

    role.request_finished = spy
    return answers


# ---- lifecycle ---------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_lifecycle_stores_full_blocks_and_frees_after_they_land(make_engine, info,
                                                                 async_scheduling):
    e = make_engine(async_scheduling=async_scheduling, slow_stores=2)
    role = e.connector.scheduler
    answers = spy_finished_answers(role)
    e.add("a", prompt(70), max_tokens=12)          # 82 tokens → 5 full blocks
    e.run()
    # its last stores were still in flight: vLLM kept the blocks until they landed
    assert answers == [(True, None)]
    assert e.stats.finished == ["a"]
    e.assert_clean(info)
    assert info.info().stored_blocks == 5
    events = e.events
    assert len(events) == 5 and all(ev.medium == "CPU" for ev in events)
    assert [ev.token_ids for ev in events][0] == prompt(70)[:BS]


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_multi_turn_hits_pool_after_gpu_cache_reset(make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling, block_outermost=async_scheduling)
    turn1 = prompt(60)
    e.add("t1", turn1, max_tokens=8)
    e.run()
    assert e.sched.reset_prefix_cache()            # GPU cache only: the pool keeps it
    answer = [fake_token(len(turn1) + i) for i in range(8)]   # what the fake model said
    turn2 = turn1 + answer + prompt(30, 7000)
    e.add("t2", turn2, max_tokens=4)
    e.run()
    assert e.stats.loaded_reqs == {"t2"}
    # turn 1 stored 4 full blocks (68 tokens): all of them come back, bit-exact
    assert e.workers[0].verified_blocks == 4
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_full_prompt_hit_recomputes_last_token(make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(4 * BS)
    seed(e, p, max_tokens=2)
    seen = []
    role = e.connector.scheduler
    original = role.get_num_new_matched_tokens

    def spy(request, num_computed):
        out = original(request, num_computed)
        seen.append(out)
        return out

    role.get_num_new_matched_tokens = spy
    e.add("b", p, max_tokens=2)
    e.run()
    # 4 blocks are pooled but one token must be recomputed: 3 blocks are offered
    assert (3 * BS, True) in seen and all(n is None or n <= 3 * BS for n, _ in seen)
    assert e.stats.finished[-1] == "b"
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_concurrent_requests_sharing_a_prefix_load_it_once(make_engine, info,
                                                           async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    shared = prompt(64)
    seed(e, shared + [1])
    for i in range(3):
        e.add(f"r{i}", shared + [2000 + i] * 10, max_tokens=3)
    e.run()
    # one of them loads the 4 shared blocks; the others find them in the GPU prefix cache
    assert len(e.stats.loaded_reqs) == 1
    assert e.workers[0].verified_blocks == 4
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_gpu_prefix_hit_covers_the_pool_hit_and_releases_the_lease(make_engine, info,
                                                                   async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(70)
    e.add("a", p, max_tokens=1)
    e.run()
    role = e.connector.scheduler
    offers = []
    original = role.lookups.offer

    def spy(st, num_computed_tokens, step):
        offers.append(original(st, num_computed_tokens, step))
        return offers[-1]

    role.lookups.offer = spy
    # The GPU prefix cache still holds a's 4 blocks; the pool has the same 4 and no more:
    # the index offers them (pinning nothing), vLLM's own hit covers them, nothing loads.
    e.add("b", p + [1] * 40, max_tokens=1)
    e.run()
    assert 4 in offers, f"the pool hit should have been offered: {offers}"
    assert e.stats.loaded_reqs == set()
    e.assert_clean(info)


# ---- preemption, abort, failure -----------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_preemption_during_stores_and_loads(make_engine, info, async_scheduling):
    # Store completions arrive forty steps late: the prompts' stores are still in flight when
    # the decodes have filled the 24 GPU blocks and vLLM preempts (at step 25). Twelve steps
    # late, every one had arrived by then, and a flush came only from a later preemption that
    # met a later store (a run in two beside three busy processes had none).
    e = make_engine(async_scheduling=async_scheduling, num_blocks=24,
                    max_num_batched_tokens=128, slow_stores=40)
    prompts = {f"p{i}": prompt(90, 300 * i) for i in range(4)}
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=40)
    e.run(timeout_s=90)
    assert sorted(e.stats.finished) == sorted(prompts)
    preempted = [r for r in e.stats.finished if r in e.preemptions]
    assert preempted, "the small GPU cache must have preempted someone"
    assert e.flushed_batches, "a preempted request's stores should have been in flight"
    assert e.stats.loaded_reqs, "a preempted request should have resumed from the pool"
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_abort_while_loading_releases_everything(make_engine, info, async_scheduling):
    from vllm.v1.request import RequestStatus

    e = make_engine(async_scheduling=async_scheduling)
    seed(e, prompt(80))
    e.add("b", prompt(80) + [9, 9], max_tokens=5)
    e.run(until=lambda: "b" in e.sched.requests
          and e.sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    e.abort("b")                                    # its load is in flight
    e.run()
    assert "b" not in e.stats.finished
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_load_failure_recomputes(make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(70)
    seed(e, p)
    e.fail_next_loads = 1
    e.add("b", p + [1, 2, 3], max_tokens=6)
    e.run()
    assert "b" in e.stats.failed_loads and e.stats.finished[-1] == "b"
    assert e.workers[0].verified_blocks == 0
    e.assert_clean(info)
    # the pool still serves the prefix afterwards
    e.sched.reset_prefix_cache()
    e.add("c", p + [4], max_tokens=1)
    e.run()
    assert "c" in e.stats.loaded_reqs and e.workers[0].verified_blocks == 4
    e.assert_clean(info)


# ---- reset, events ------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_reset_cache_makes_later_lookups_miss(make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(70)
    e.add("a", p, max_tokens=1)
    e.run()
    e.events.clear()
    assert e.sched.reset_prefix_cache(reset_connector=True)
    removed = list(e.connector.take_events())
    assert removed and type(removed[0]).__name__ == "BlockRemoved"
    assert sum(len(ev.block_hashes) for ev in removed) == 4
    e.add("b", p + [1], max_tokens=1)
    e.run()
    assert e.stats.loaded_reqs == set()
    e.assert_clean(info)


# ---- hybrid models ------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_fresh_engine_stores_its_first_chunk_in_its_first_step(make_engine, info,
                                                                  async_scheduling):
    # The scheduler side waits for its first tickets as it starts: on a loaded host the grant
    # came after the first step, whose stores waited a step, and the window group's blocks that
    # left the window meanwhile were never stored (a hybrid test loaded nothing after that).
    e = make_engine(async_scheduling=async_scheduling, hybrid=True)
    role = e.connector.scheduler
    assert all(role.client.stock(g.namespace) for g in role.groups), \
        "no ticket in stock once the engine is built"
    planned = spy_planned_blocks(role)
    e.add("a", prompt(100), max_tokens=1)     # a 64-token chunk, then 36 tokens
    e.step()
    assert planned == [8], f"blocks planned in the first step (4 per group): {planned}"
    e.run()
    assert info.info().stored_blocks == 12, "every block of both groups stored"
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("reused", [False, True], ids=["still_cached", "reused"])
def test_window_blocks_freed_while_their_store_waited(make_engine, info, async_scheduling,
                                                      reused):
    # The stores get no ticket (as when the grant comes late on a loaded host) until vLLM has
    # freed the window group's first blocks (they left its 32-token window). Still in vLLM's
    # prefix cache, they are found there by their hashes and stored; handed to another
    # request meanwhile (here every free block is taken and given back, as an allocation
    # would), they are counted lost (window_freed), not dropped unseen.
    e = make_engine(async_scheduling=async_scheduling, hybrid=True)
    role = e.connector.scheduler
    window = window_group(role)
    take, plan = role.client.take_slots, role.planner.plan
    planned: list[int] = []
    freed: list[int] = []       # null blocks in the window group's table when the wait ended

    def plan_once_window_blocks_are_freed(so, started, preempted, manager):
        table = manager.get_block_ids("a")[window] if not freed else []
        if not freed and table and table[0] == 0:
            freed.append(table.count(0))
            if reused:
                reuse_every_free_block(manager)
        role.client.take_slots = take if freed else (lambda ns, n: ([], ""))
        specs, finished = plan(so, started, preempted, manager)
        planned.append(sum(len(sp.keys) for sp in specs))
        return specs, finished

    role.planner.plan = plan_once_window_blocks_are_freed
    e.add("a", prompt(200), max_tokens=1)     # 64-token chunks: 12 full blocks per group
    e.run()
    assert freed and freed[0] >= 2, f"vLLM freed no window block while the stores waited"
    lost = freed[0] if reused else 0
    assert planned[0] == 0 and sum(planned) == 24 - lost, planned
    assert role.losses.totals["window_freed"] == lost, role.losses.totals
    assert info.info().stored_blocks == 24 - lost
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_window_blocks_a_prefix_hit_never_held_are_not_counted_lost(make_engine, info,
                                                                    async_scheduling):
    # b's hit in vLLM's own prefix cache keeps only the window group's last blocks: the others
    # are null in b's table from the start. The pool emptied, b stores from block 0; those
    # nulls were never b's, so they count as no loss even once vLLM has handed them out.
    e = make_engine(async_scheduling=async_scheduling, hybrid=True)
    role = e.connector.scheduler
    window = window_group(role)
    p = prompt(200)
    e.add("a", p, max_tokens=1)
    e.run()
    assert e.connector.reset_cache()        # the pool forgets a; vLLM's prefix cache keeps it
    plan = role.planner.plan
    nulls: list[int] = []

    def plan_after_evicting(so, started, preempted, manager):
        # once b holds its hit (not before: that would evict the hit itself)
        if "b" in manager.coordinator.single_type_managers[0].req_to_blocks:
            if not nulls:
                nulls.append(manager.get_block_ids("b")[window].count(0))
            reuse_every_free_block(manager)
        return plan(so, started, preempted, manager)

    role.planner.plan = plan_after_evicting
    e.add("b", p + [3] * 20, max_tokens=1)
    e.run()
    assert nulls and nulls[0] >= 2, f"b's prefix hit left no null window block: {nulls}"
    assert role.losses.totals["window_freed"] == 0, role.losses.totals
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_sliding_window_and_full_attention_groups(make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling, hybrid=True)
    role = e.connector.scheduler
    assert [g.window_blocks for g in role.groups] == [None, 3]
    p = prompt(100)
    seed(e, p)
    e.add("b", p + [3] * 20, max_tokens=3)
    e.run()
    assert e.stats.loaded_reqs == {"b"}
    loads = [(g, len(b)) for g, b in e.workers[0].load_history["b"]]
    # Full attention loads all 6 blocks; the window group only what vLLM keeps of the window
    # (token 96 sees tokens 65..96: blocks 4 and 5; the rest of the group's table is null).
    assert sorted(loads) == [(0, 6), (1, 2)]
    assert e.workers[0].verified_blocks == 8
    e.assert_clean(info)


# ---- tensor parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_tp2_stores_commit_only_after_every_rank(make_engine, info, async_scheduling):
    # Both ranks' stores are held back until the ack below is checked: a rank whose store
    # landed and reported within the step that made the batch (fast stores, a quiet machine)
    # had already acked it once, and the test's ack then resolved it (a CI run saw that).
    e = make_engine(async_scheduling=async_scheduling, tp=2, hold_stores=True)
    role = e.connector.scheduler
    # A batch reported by one rank stays in flight; the second rank's report resolves it.
    e.add("a", prompt(40), max_tokens=1)
    e.run(until=lambda: role.batches.by_id and all(h.held for h in e.held))
    from vllm.v1.outputs import KVConnectorOutput
    batch = next(iter(role.batches.by_id))
    held = role.batches.by_id[batch]
    assert held.done == 0, "a rank reported a store that was held back"
    role.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=WorkerAcks({batch: 1})))
    assert batch in role.batches.by_id and held.done == 1
    held.done = 0                                   # give the real acks their say
    e.release_stores(from_now_on=True)
    e.run()
    assert e.stats.finished == ["a"]
    e.sched.reset_prefix_cache()
    e.add("b", prompt(40) + [1], max_tokens=1)
    e.run()
    assert e.stats.loaded_reqs == {"b"}
    assert [w.verified_blocks for w in e.workers] == [2, 2]   # each rank gets its own shard
    e.assert_clean(info)


def test_tp2_a_failed_rank_commits_nothing(make_engine, info):
    e = make_engine(async_scheduling=False, tp=2)
    w1 = e.workers[1].conn.worker
    w1.client.unregister(w1._regs[0])               # rank 1's stores now fail
    e.add("a", prompt(40), max_tokens=1)
    e.run()
    assert info.info().stored_blocks == 0
    e.assert_clean(info)


# ---- dedup ------------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_in_flight_stores_are_not_planned_twice(make_engine, info, async_scheduling):
    # a's stores are held back from the daemon until b has run: they stay in flight however
    # fast this host steps (let go at once, they could be planned, copied and reported inside
    # one step, and a wait for "in flight" never saw them: a loaded 2-core host, 2 runs in 6)
    e = make_engine(async_scheduling=async_scheduling, max_num_batched_tokens=256,
                    hold_stores=True)
    role = e.connector.scheduler
    planned: list[bytes] = []
    original = role.build_connector_meta

    b_first_step: list[bool] = []       # whether a's keys were in flight as b was scheduled

    def spy(so):
        if any(r.req_id == "b" for r in so.scheduled_new_reqs):
            b_first_step.append(any(role.batches.keys_in_flight))
        meta = original(so)
        planned.extend(k for spec in meta.stores for k in spec.keys)
        return meta

    role.build_connector_meta = spy
    shared = prompt(64)
    e.add("a", shared + [1] * 5, max_tokens=2)
    e.run(until=lambda: any(role.batches.keys_in_flight))   # a's 4 blocks planned, in flight
    e.add("b", shared + [2] * 5, max_tokens=2)
    e.run(until=lambda: "b" in e.stats.finished)
    assert b_first_step == [True], "b was not scheduled while a's stores were in flight"
    e.release_stores(from_now_on=True)
    e.run()
    assert len(planned) == len(set(planned)), "a key was planned twice"
    assert info.info().stored_blocks == 4
    # b computed the same 4 blocks again (vLLM shares them only once cached): the keys this
    # engine stored are known, so nothing went to the daemon as a duplicate either
    assert info.info().duplicate_blocks == 0
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_stores_planned_before_a_reset_never_show_up_after_it(make_engine, info,
                                                               async_scheduling):
    # A reset often follows a weight update: KV computed before it must not be served after.
    e = make_engine(async_scheduling=async_scheduling, hold_stores=True)
    p = prompt(70)
    e.add("a", p, max_tokens=1)
    e.run(until=lambda: "a" in e.stats.finished and e.held[0].held)
    # vLLM's own reset waits for a's blocks (held for its stores): reset the pool's now.
    assert e.connector.reset_cache()
    e.release_stores(from_now_on=True)  # the copies reach the daemon after the reset
    e.run()
    assert e.sched.reset_prefix_cache()
    # Nothing of a's is held or visible. (Its stores may still have committed *before* the
    # reset, then been forgotten by it: they go on the worker's connection and the reset on
    # the scheduler's, and the daemon's one socket does not order two connections. A loaded
    # 2-core host showed it: 4 stored, 0 held, 0 in the index.)
    now = info.info()
    assert (now.slots_committed, now.slots_writing, now.used_bytes, now.index_keys) == \
        (0, 0, 0, 0), now
    e.add("b", p + [1], max_tokens=1)
    e.run()
    assert e.stats.loaded_reqs == set()
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_burst_of_requests_is_looked_up_over_several_steps(
        make_engine, info, monkeypatch, async_scheduling):
    from kvpool.client.vllm import lookups

    # A bound far below the burst: 8 requests of 4 full blocks each arrive at once. The bound
    # is the round trip's (no shared-memory index: the lookups go to the daemon).
    monkeypatch.setattr(lookups, "LOOKUP_BLOCKS_PER_STEP", 6)
    monkeypatch.setattr(SchedulerClient, "index", lambda self: None)
    e = make_engine(async_scheduling=async_scheduling)
    role = e.connector.scheduler
    looked_up: list[int] = []
    lookup_start = role.client.lookup_start

    def spy_lookup(namespace, key_lists, pin=False):
        looked_up.append(sum(len(k) for k in key_lists))
        return lookup_start(namespace, key_lists, pin)

    role.client.lookup_start = spy_lookup
    prompts = {f"s{i}": prompt(70, 1000 * (i + 1)) for i in range(8)}
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=1)
    e.run()
    wait_for(lambda: info.info().stored_blocks == 32, 10, "all 32 blocks committed")
    assert e.sched.reset_prefix_cache()
    looked_up.clear()
    for rid, p in prompts.items():
        e.add(f"again-{rid}", p + [1], max_tokens=1)
    e.run()
    assert e.stats.loaded_reqs == {f"again-{rid}" for rid in prompts}
    # Each lookup asks for at most the bound plus one request's blocks (a request goes whole).
    assert len(looked_up) >= 3 and max(looked_up) <= 6 + 4 - 1, looked_up
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("max_tokens", [1, 8], ids=["finish-at-once", "keep-running"])
def test_a_burst_of_stores_is_planned_over_several_steps(
        make_engine, info, async_scheduling, max_tokens):
    # No time for planning at all: one request per step. 8 requests of 4 full blocks each
    # fill them in one step. (No overdue budget either: on a loaded 2-core machine a step can
    # take over store_overdue_after_s, and that budget then plans more requests in a step.)
    e = make_engine(async_scheduling=async_scheduling, max_num_batched_tokens=1024,
                    extra=NO_PLANNING_TIME)
    role = e.connector.scheduler
    planned = spy_planned_blocks(role)
    for i in range(8):
        e.add(f"s{i}", prompt(70, 1000 * (i + 1)), max_tokens=max_tokens)
    e.run()
    # Nothing is lost: requests that finished before their turn kept their blocks meanwhile.
    wait_for(lambda: info.info().stored_blocks == 32, 10, "all 32 blocks committed")
    steps = [n for n in planned if n]
    assert sum(steps) == 32, planned
    if max_tokens == 1:
        # Finished at their first step: the backlog plans the others, one a step (plus one
        # still running, under async scheduling).
        assert steps[0] == 4 and max(steps) <= 8 and len(steps) >= 4, planned
    else:
        assert steps[:4] == [4, 4, 4, 4], planned
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("max_tokens", [1, 8], ids=["finish-at-once", "keep-running"])
def test_a_long_prompt_is_planned_in_pieces_over_several_steps(
        make_engine, info, monkeypatch, async_scheduling, max_tokens):
    from kvpool.client.vllm import store_planner

    # No time for planning: each step plans one late piece, of 3 blocks (not a full piece of
    # 6). One prefill fills 10 blocks.
    monkeypatch.setattr(store_planner, "STORE_PIECE_BLOCKS", 6)
    monkeypatch.setattr(store_planner, "STORE_LATE_PIECE_BLOCKS", 3)
    e = make_engine(async_scheduling=async_scheduling, max_num_batched_tokens=1024,
                    extra=NO_PLANNING_TIME)
    role = e.connector.scheduler
    planned = spy_planned_blocks(role)
    e.add("long", prompt(170), max_tokens=max_tokens)
    e.run()
    full = 10 if max_tokens == 1 else 11        # the 8 decoded tokens fill block 10
    wait_for(lambda: info.info().stored_blocks == full, 10,
             f"all {full} blocks committed (planned per step: {planned})")
    # The prompt's pieces in consecutive steps, also once the request decodes (they are not
    # held back as a decode run); block 10 then waits for the request's end.
    steps = [n for n in planned if n]
    assert steps == [3, 3, 3, 1] + [1] * (full - 10), planned
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("overdue_budget_us", [1_000_000, 0], ids=["ample", "none"])
def test_a_store_deferred_too_long_gets_a_second_bounded_budget(
        make_engine, info, async_scheduling, overdue_budget_us):
    # No time for planning, and every wait too long: the overdue budget alone decides. With
    # none, a step plans the queue's forced piece and one overdue piece (a request of 4 blocks
    # each), never all 8 requests at once.
    e = make_engine(async_scheduling=async_scheduling, max_num_batched_tokens=1024,
                    extra={**NO_PLANNING_TIME, "store_overdue_after_s": 0,
                           "store_overdue_budget_us": overdue_budget_us})
    role = e.connector.scheduler
    planned = spy_planned_blocks(role)
    for i in range(8):
        e.add(f"s{i}", prompt(70, 1000 * (i + 1)), max_tokens=8)
    e.run()
    wait_for(lambda: info.info().stored_blocks == 32, 10, "all 32 blocks committed")
    steps = [n for n in planned if n]
    if overdue_budget_us:
        assert steps == [32], planned
    else:
        assert sum(steps) == 32 and max(steps) <= 8 and len(steps) >= 4, planned
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_decode_blocks_are_stored_in_runs_and_the_rest_when_the_request_ends(
        make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    role = e.connector.scheduler
    assert role.planner.store_run == 8          # STORE_RUN_TOKENS 128 / 16-token blocks
    planned = spy_planned_blocks(role)
    answers = spy_finished_answers(role)
    # 70 + 140 tokens: the prompt's 4 full blocks as the prefill fills them, then decode
    # fills blocks 4..11 (one run of 8), then block 12 fills before the end: kept by vLLM
    # until the backlog stored it.
    e.add("a", prompt(70), max_tokens=140)
    e.run()
    assert [n for n in planned if n] == [4, 8, 1], planned
    assert answers == [(True, None)]
    wait_for(lambda: info.info().stored_blocks == 13, 10, "all 13 blocks committed")
    e.assert_clean(info)


def test_remembered_keys_are_bounded_and_the_newest_kept(make_engine, info, monkeypatch):
    from kvpool.client.vllm import store_batches

    monkeypatch.setattr(store_batches, "_MAX_REMEMBERED_KEYS", 3)
    e = make_engine(async_scheduling=False)
    role = e.connector.scheduler
    e.add("a", prompt(70), max_tokens=1)                 # 4 full blocks, one batch
    e.run()
    wait_for(lambda: info.info().stored_blocks == 4, 10, "4 blocks committed")
    e.add("b", prompt(40, 5000), max_tokens=1)           # 2 more
    e.run()
    wait_for(lambda: info.info().stored_blocks == 6, 10, "6 blocks committed")
    from kvpool.client.vllm.keys import RequestKeys

    class _Req:      # what RequestKeys reads of a request
        def __init__(self, tokens):
            self.all_token_ids, self.cache_salt, self.lora_request = tokens, None, None
            self.mm_features, self.prompt_embeds = None, None

    a = RequestKeys(_Req(prompt(70)), role.groups)
    b = RequestKeys(_Req(prompt(40, 5000)), role.groups)
    newest = a.keys(_Req(prompt(70)), 0, 4)[3:] + b.keys(_Req(prompt(40, 5000)), 0, 2)
    assert list(role.batches.committed[0]) == newest
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_finished_requests_waiting_past_store_wait_free_their_blocks_unstored(
        make_engine, info, caplog, async_scheduling):
    # One request planned a step, and a finished request waits for no planning at all.
    e = make_engine(async_scheduling=async_scheduling, max_num_batched_tokens=1024,
                    extra={**NO_PLANNING_TIME, "store_wait_s": 0})
    role = e.connector.scheduler
    # The loss needs tickets in hand while the requests finish (no stock means no planning at
    # all): step the idle engine until its first reservation is in.
    ns = role.groups[0].namespace
    wait_for(lambda: e.step() or role.client.stock(ns), 10, "the first tickets")
    for i in range(8):
        e.add(f"s{i}", prompt(70, 1000 * (i + 1)), max_tokens=1)
    e.run()
    assert sorted(e.stats.finished) == [f"s{i}" for i in range(8)]
    e.assert_clean(info)             # every block freed, nothing held in the backlog
    stored = info.info().stored_blocks
    assert 4 <= stored < 32, stored
    # The loss is reported, with what was lost.
    assert role.unstored_total == 32 - stored, (role.unstored_total, stored)
    assert role.losses.totals["store_wait"] == 32 - stored, role.losses.totals
    assert any("not stored" in r.message and "store_wait" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_queued_turns_hit_what_the_turns_ahead_of_them_stored_meanwhile(
        make_engine, async_scheduling, step_s):
    # Two turns of 8 conversations queued at once, the second turn of each behind every
    # first turn: vLLM looks them all up in its first step, when the pool holds nothing, and
    # schedules the second turns after the first turns' 6-block prefixes are stored and gone
    # from a GPU cache of 48 blocks that runs 2 at a time.
    e = make_engine(async_scheduling=async_scheduling, num_blocks=48, max_num_seqs=2,
                    max_num_batched_tokens=256, step_s=step_s)
    turns = {(c, t): list(range(100_000 * (c + 1), 100_000 * (c + 1) + 6 * (t + 1) * BS + 1))
             for t in range(2) for c in range(8)}
    for (c, t), p in turns.items():
        e.add(f"c{c}t{t}", p, max_tokens=4)
    e.run(timeout_s=120)
    # Each second turn computed at most what its first turn had not: its first 6 blocks came
    # from vLLM's cache or the pool (the first lookup of each missed everything).
    recomputed = {c: e.stats.scheduled[f"c{c}t1"] - (len(turns[c, 1]) - 6 * BS)
                  for c in range(8)}
    assert all(n <= 4 for n in recomputed.values()), (
        f"tokens recomputed past the second half of each prompt: {recomputed}; "
        f"loaded: {sorted(e.stats.loaded_reqs)}")
    assert len(e.stats.loaded_reqs) >= 4, sorted(e.stats.loaded_reqs)
