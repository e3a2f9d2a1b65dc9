"""Every computed block is stored while the pool has room: the connector's store guarantees
under vLLM's real Scheduler and AsyncScheduler, against a real kvpoold.

Each scenario runs at several step speeds (empty steps at once, 5 ms and 50 ms compute steps),
from a fresh engine built in vLLM's order (workers register, then the scheduler) with no
warm-up or priming, with bursts larger than an eighth of the pool (the share one client could
hold before reservations became tickets), and with the daemon restarted under an idle engine.
"""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("vllm")

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

from bench.vllm_scheduler import BS, Engine  # noqa: E402
from tests.integration.vllm_params import SCHEDULERS, STEP_SPEEDS  # noqa: E402

pytestmark = pytest.mark.vllm

# The harness's blocks are 4 KiB (2 layers x K,V x 16 tokens x 2 heads x 16 x fp16): a 2 MiB
# pool of 256 KiB extents holds 192 of them once its tables are taken, and one client's old
# reservation share was 1/8 of the pool, 32 blocks.
SMALL_POOL = dict(pool_size="2MiB", extra=["--extent-size", "256KiB"])


def prompts(n: int, blocks: int) -> list[list[int]]:
    """``n`` prompts sharing nothing, each of ``blocks`` full blocks plus one token."""
    return [list(range(10_000 * (i + 1), 10_000 * (i + 1) + blocks * BS + 1)) for i in range(n)]


def stored(daemon) -> int:
    c = SchedulerClient(daemon.client_config(), name="test observer")
    try:
        return c.info().stored_blocks
    finally:
        c.close()


def preempting_engine(make_engine, async_scheduling: bool, step_s: float,
                      pressure_budget_us: int) -> Engine:
    """Store planning starved to one late piece (8 blocks) a step, except for the pressure
    budget; 4 prompts of 12 full blocks + 15 tokens added: one decode token fills a 13th
    block, the next needs a 14th, and 53 GPU blocks hold 4 x 13 + 1, so vLLM preempts a
    request two steps after the prefill."""
    e = make_engine(async_scheduling=async_scheduling, step_s=step_s, num_blocks=54,
                    max_num_batched_tokens=1024,
                    extra={"store_plan_budget_us": 0, "store_step_budget_us": 0,
                           "store_overdue_after_s": 60,
                           "store_pressure_budget_us": pressure_budget_us})
    for i, p in enumerate(prompts(4, 13)):
        e.add(f"r{i}", p[:12 * BS + 15], max_tokens=40)
    return e


def run_all_and_reload(e: Engine, batch: list[list[int]], tag: str) -> None:
    """Run ``batch`` to the end (one token each), empty the GPU prefix cache, run it again:
    the second round loads every full block from the pool, bit-exact."""
    for i, p in enumerate(batch):
        e.add(f"{tag}{i}", p, max_tokens=1)
    e.run(timeout_s=90)
    assert e.sched.reset_prefix_cache()
    before = e.workers[0].verified_blocks
    for i, p in enumerate(batch):
        e.add(f"{tag}{i}-again", p, max_tokens=1)
    e.run(timeout_s=90)
    full = sum((len(p) - 1) // BS for p in batch)
    assert e.workers[0].verified_blocks - before == full, (
        f"{e.workers[0].verified_blocks - before} of {full} blocks came back from the pool; "
        f"unstored by reason: {e.connector.scheduler.losses.totals}")


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_a_burst_larger_than_an_eighth_of_the_pool_is_stored_whole(
        make_engine, daemon_factory, async_scheduling, step_s):
    d = daemon_factory(**SMALL_POOL)
    e = make_engine(socket=d.socket, async_scheduling=async_scheduling, step_s=step_s,
                max_num_batched_tokens=2048, num_blocks=512)
    batch = prompts(6, 11)                      # 66 blocks: twice the old share of 32
    run_all_and_reload(e, batch, "burst")
    assert stored(d) == 66
    assert e.connector.scheduler.losses.total == 0, e.connector.scheduler.losses.totals


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_a_scheduler_built_before_its_workers_registered_stores_the_first_request_whole(
        make_engine, daemon, async_scheduling, step_s):
    e = make_engine(async_scheduling=async_scheduling, step_s=step_s,
                scheduler_first=True)
    run_all_and_reload(e, prompts(1, 7), "first")
    assert stored(daemon) == 7


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_daemon_restarted_under_an_idle_engine_stores_the_next_burst_whole(
        make_engine, daemon_factory, async_scheduling, step_s):
    d = daemon_factory(**SMALL_POOL)
    e = make_engine(socket=d.socket, async_scheduling=async_scheduling, step_s=step_s,
                max_num_batched_tokens=2048, num_blocks=512)
    role = e.connector.scheduler
    # Idle: the engine core steps with nothing scheduled while the daemon goes and comes back.
    old = d.proc.pid
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(timeout=10)
    d.restart()
    assert d.proc.pid != old

    def reconnected() -> bool:
        e.step()
        return role.link.pumped and all(w.conn.worker.client.is_registered(reg)
                                           for w in e.workers
                                           for reg in w.conn.worker._regs.values())

    wait_for(reconnected, timeout_s=30, what="the idle engine's scheduler and workers to "
                                            "reconnect to the restarted daemon")
    run_all_and_reload(e, prompts(6, 11), "after-restart")
    assert stored(d) == 66


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_a_preempted_requests_blocks_are_stored_though_planning_lagged(
        make_engine, daemon, info, async_scheduling, step_s):
    # Planning starved: when vLLM preempts a request two steps after the prefill, most
    # prompts' blocks were never planned, and vLLM frees the
    # preempted one's blocks inside schedule(), before the connector hears of it. It resumes
    # from token 0, so what is not stored then is recomputed (the real CPU engine lost every
    # resumed hit this way on a slow host).
    e = preempting_engine(make_engine, async_scheduling, step_s, 0)
    role = e.connector.scheduler
    pool = e.sched.kv_cache_manager.block_pool
    held: dict[str, list[bytes]] = {}     # preempted request -> keys of blocks vLLM still held
    build = role.build_connector_meta

    def spy(so):
        for rid in so.preempted_req_ids or ():
            req = e.sched.requests[rid]
            if rid in held or req.num_preemptions > 1:
                continue
            keys = role.requests.get(rid).keys.range(req, 0, 0, len(req.block_hashes))
            held[rid] = [k for k, h in zip(keys, req.block_hashes)
                         if pool.get_cached_block(h, [0])]
        return build(so)

    role.build_connector_meta = spy
    e.run(until=lambda: bool(held) and not role.batches.by_id, timeout_s=60)
    resumed = [rid for rid in held if e.sched.requests[rid].num_computed_tokens]
    assert not resumed, f"{resumed} resumed before the check: the test proves nothing"
    ns = role.groups[0].namespace
    for rid, keys in held.items():
        assert len(keys) >= 8, f"{rid}: vLLM held only {len(keys)} of its blocks"
        hits = info.lookup(ns, [[k] for k in keys]).hits
        assert sum(hits) == len(keys), (
            f"{rid}: {sum(hits)} of the {len(keys)} blocks vLLM still held at its preemption "
            f"are in the pool (unstored by reason: {role.losses.totals})")
    e.run(timeout_s=90)
    assert sorted(e.stats.finished) == [f"r{i}" for i in range(4)]


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_under_memory_pressure_prompt_blocks_are_planned_before_a_preemption(
        make_engine, daemon, async_scheduling, step_s):
    # The same starved planning as above, but vLLM's free blocks are fewer than one schedule()
    # can take from the first step on: the planner spends its pressure budget, so a request
    # preempted two steps after its prefill had every prompt block planned already, including
    # those vLLM hands to another request inside the preempting schedule().
    e = preempting_engine(make_engine, async_scheduling, step_s, 1_000_000)
    role = e.connector.scheduler
    planned_at_preemption: dict[str, int] = {}
    preemptions = 0
    build = role.build_connector_meta

    def spy(so):
        nonlocal preemptions
        for rid in so.preempted_req_ids or ():
            planned_at_preemption.setdefault(rid, role.planner.cursor(rid).cursor[0])
            preemptions += 1
        return build(so)

    role.build_connector_meta = spy
    e.run(timeout_s=90)
    assert planned_at_preemption, "nothing was preempted: the test proves nothing"
    assert all(n >= 12 for n in planned_at_preemption.values()), (
        f"prompt blocks planned when vLLM preempted (of 12): {planned_at_preemption}")
    # At most the block its last decode filled (planned once vLLM gives the request its next
    # block, which the preemption took instead) is gone with each preemption.
    assert role.losses.totals["preempted"] <= preemptions, (role.losses.totals, preemptions)
    assert sorted(e.stats.finished) == [f"r{i}" for i in range(4)]
