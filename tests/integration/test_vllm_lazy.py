"""The lazy store policy and the minimum prefix under vLLM's real Scheduler and AsyncScheduler,
against a real kvpoold: stores nothing while the GPU cache has room, stores what vLLM is about
to evict before it evicts it, everything still cached once the engine goes idle, and P/D
hand-offs and preemption exactly as under eager."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


from bench.vllm_scheduler import BS, Engine  # noqa: E402
from tests.integration.vllm_params import SCHEDULERS, STEP_SPEEDS  # noqa: E402

pytestmark = pytest.mark.vllm

LAZY = {"store_policy": "lazy"}


def prompt(blocks: int, start: int) -> list[int]:
    """``blocks`` full blocks and one more token."""
    return list(range(start, start + blocks * BS + 1))


def finished(e: Engine, *rids: str):
    return lambda: set(rids) <= set(e.stats.finished)


def spy_planned_by_step(role) -> list[tuple[bool, int]]:
    """Per step, as steps run: (the step computed tokens, blocks the role planned to store)."""
    steps: list[tuple[bool, int]] = []
    plan = role.planner.plan

    def spy(so, step_started, preempted, manager):
        specs, finished_reqs = plan(so, step_started, preempted, manager)
        steps.append((bool(so.total_num_scheduled_tokens), sum(len(s.keys) for s in specs)))
        return specs, finished_reqs

    role.planner.plan = spy
    return steps


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_lazy_stores_nothing_while_the_gpu_cache_has_room_and_all_of_it_when_idle(
        make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling, num_blocks=256, extra=LAZY)
    role = e.connector.scheduler
    steps = spy_planned_by_step(role)
    for i in range(4):
        e.add(f"r{i}", prompt(4, 1000 * (i + 1)), max_tokens=2)
    e.run(until=finished(e, "r0", "r1", "r2", "r3"))
    # Every request is done and their 16 blocks sit in vLLM's prefix cache, far from eviction:
    # no step that computed planned a store. (The async scheduler's last step computes
    # nothing, one step before the last request is seen finished: the idle store may start
    # there.)
    busy = [n for computed, n in steps if computed]
    assert sum(busy) == 0, f"lazy stored blocks the GPU cache still held, per busy step: {busy}"
    # The engine has nothing left to compute: the idle step stores what it still holds.
    e.run()
    assert sum(n for computed, n in steps if not computed) == 16
    assert info.info().stored_blocks == 16
    assert role.lazy.num_pending == 0 and role.lazy.num_in_flight == 0
    assert role.lazy.dropped_total == 0 and role.losses.total == 0
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
@pytest.mark.parametrize("step_s", STEP_SPEEDS)
def test_lazy_stores_before_eviction_and_a_later_request_hits_as_under_eager(
        make_engine, info, async_scheduling, step_s):
    # 96 GPU blocks, a step reaches 12 into the free queue (128 tokens, 4 sequences); 14
    # prompts of 8 blocks, one after the other: the later ones evict the earlier ones' cached
    # blocks, while a long decode keeps the engine busy (never idle, so no idle flush).
    e = make_engine(async_scheduling=async_scheduling, num_blocks=96, extra=LAZY,
                    max_num_batched_tokens=128, max_num_seqs=4, step_s=step_s)
    role = e.connector.scheduler
    assert role.lazy.horizon_blocks == 12
    e.add("busy", prompt(1, 90_000), max_tokens=1000)
    firsts = [prompt(8, 1000 * (i + 1)) for i in range(14)]
    for i, p in enumerate(firsts):
        e.add(f"a{i}", p, max_tokens=1)
        e.run(until=finished(e, f"a{i}"), timeout_s=60)
    stored = info.info().stored_blocks
    assert 0 < stored < 112, f"lazy stored {stored} of 112 blocks while the engine was busy"
    assert role.lazy.dropped_total == 0, role.lazy.dropped
    e.abort("busy")
    e.run(timeout_s=60)                      # nothing left to compute: idle stores the rest
    assert role.losses.total == 0 and role.lazy.dropped_total == 0
    assert e.sched.reset_prefix_cache()
    before = e.workers[0].verified_blocks
    for i, p in enumerate(firsts):
        e.add(f"b{i}", p, max_tokens=1)
        e.run(timeout_s=60)
    # Every block of every prompt came back from the pool, bit-exact, as under eager.
    assert e.workers[0].verified_blocks - before == 112
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_pd_producer_stores_eagerly_under_lazy(make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling, num_blocks=256, extra=LAZY,
                    kv_role="kv_producer")
    e.add("p", prompt(5, 5000), max_tokens=1)
    e.run(until=finished(e, "p"))
    e.drain_queue()
    # The hand-off's blocks are stored (vLLM keeps them until they landed), not remembered.
    assert e.connector.scheduler.lazy.num_pending == 0
    e.run()
    assert info.info().stored_blocks == 5
    assert e.stats.params["p"] and e.stats.params["p"]["kvpool_tokens"] == 5 * BS
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_preemption_under_lazy_loses_nothing(make_engine, info, async_scheduling):
    # A GPU cache too small for four requests at once: vLLM preempts, and the free queue is
    # inside the eviction horizon most of the time, so blocks are stored at once then.
    e = make_engine(async_scheduling=async_scheduling, num_blocks=24, extra=LAZY,
                    max_num_batched_tokens=128)
    prompts = {f"p{i}": prompt(5, 300 * (i + 1) + 10_000) for i in range(4)}
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=40)
    e.run(timeout_s=120)
    assert sorted(e.stats.finished) == sorted(prompts)
    assert e.preemptions, "the small GPU cache must have preempted someone"
    role = e.connector.scheduler
    assert role.lazy.dropped_total == 0, role.lazy.dropped
    assert role.losses.total == 0, role.losses.totals
    e.assert_clean(info)
    # Every full block computed (prompt and answer) is in the pool.
    assert info.info().stored_blocks == sum((len(p) + 40 - 1) // BS for p in prompts.values())


@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_requests_shorter_than_the_minimum_prefix_store_nothing(make_engine, info, policy):
    e = make_engine(async_scheduling=False, num_blocks=256,
                    extra={"store_policy": policy, "store_min_prefix_tokens": 4 * BS})
    e.add("short", prompt(3, 20_000), max_tokens=1)       # 49 tokens: under 64
    e.add("long", prompt(5, 30_000), max_tokens=1)        # 81 tokens
    e.run()
    assert info.info().stored_blocks == 5
    assert e.connector.scheduler.losses.total == 0, "a policy skip is not a loss"
    e.assert_clean(info)
