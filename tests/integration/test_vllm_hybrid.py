"""A hybrid model (full attention + sliding window + a recurrent-state group, vLLM's MambaSpec in
``mamba_cache_mode="align"``) under vLLM 0.33's real Scheduler and AsyncScheduler, against a
real kvpoold.

The fake worker (``bench.vllm_hybrid.HybridWorker``) runs a recurrent model on the state group
the way vLLM's align mode drives a real one and checks, at every chunk, that the state it
resumes from is the one its tokens give; every loaded KV block and state is checked against
what the model computed. So a hit that restored attention without the state (or the other way
round) fails these tests instead of passing with garbage.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from types import SimpleNamespace  # noqa: E402

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from kvpool.client.vllm.keys import RequestKeys  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

from bench.vllm_hybrid import HybridWorker, hybrid_groups  # noqa: E402
from bench.vllm_scheduler import BS, fake_token  # noqa: E402
from tests.integration.test_vllm_connector import prompt, seed  # noqa: E402
from tests.integration.vllm_params import SCHEDULERS  # noqa: E402

pytestmark = pytest.mark.vllm

STATE = 2       # the state group's position (full attention, window, state)


@pytest.fixture
def hybrid(make_engine):
    def make(**kw):
        return make_engine(groups=hybrid_groups(), worker_cls=HybridWorker, **kw)
    return make


def answers(e, role=None) -> list:
    """What get_num_new_matched_tokens answers vLLM (appended as it is asked)."""
    role = role or e.connector.scheduler
    seen: list = []
    original = role.get_num_new_matched_tokens

    def spy(request, num_computed):
        seen.append(original(request, num_computed))
        return seen[-1]

    role.get_num_new_matched_tokens = spy
    return seen


def loaded_groups(e, rid: str) -> dict[int, int]:
    """Blocks loaded for ``rid`` per group position."""
    out: dict[int, int] = {}
    for g, bids in e.workers[0].load_history.get(rid, []):
        out[g] = out.get(g, 0) + len(bids)
    return out


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_multi_turn_loads_every_group_and_the_state_at_the_hits_end(hybrid, info,
                                                                     async_scheduling):
    e = hybrid(async_scheduling=async_scheduling)
    assert [g.kind for g in e.connector.scheduler.groups] == ["full", "window", "state"]
    turn1 = prompt(100)
    e.add("t1", turn1, max_tokens=20)
    e.run()
    assert e.sched.reset_prefix_cache()             # GPU cache only: the pool keeps it
    said = [fake_token(len(turn1) + i) for i in range(20)]
    turn2 = turn1 + said + prompt(30, 7000)
    e.add("t2", turn2, max_tokens=4)
    e.run()
    assert e.stats.loaded_reqs == {"t2"}
    # Turn 1 kept states at 64, 96 and 112 tokens (its chunk ends and the block its decode
    # filled) and stored 7 attention blocks: the hit is 112 tokens, all groups at once.
    assert loaded_groups(e, "t2") == {0: 7, 1: 2, 2: 1}
    assert e.workers[0].verified_states == 1
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_shared_prefix_is_loaded_once_and_resumed_from_by_all(hybrid, info, async_scheduling):
    e = hybrid(async_scheduling=async_scheduling)
    shared = prompt(100)                            # states kept at 64 and 96 tokens
    seed(e, shared + [1])
    for i, extra in enumerate((10, 25, 40)):
        e.add(f"r{i}", shared + [2000 + i] * extra, max_tokens=2)
    e.run()
    # One loads the 6 shared blocks and the state after them; the others resume there from
    # vLLM's own prefix cache (the fake model checks the state each resumed from).
    [loader] = e.stats.loaded_reqs
    assert loaded_groups(e, loader)[0] == 6 and e.workers[0].verified_states == 1
    assert sorted(e.stats.finished[-3:]) == ["r0", "r1", "r2"]
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_state_that_misses_while_attention_hits_gives_no_external_tokens(
        hybrid, daemon, info, async_scheduling):
    e = hybrid(async_scheduling=async_scheduling)
    p = prompt(100)
    seed(e, p)
    groups = e.connector.scheduler.groups
    req = SimpleNamespace(all_token_ids=p, cache_salt=None, lora_request=None, mm_features=[],
                          prompt_embeds=None)
    # The pool loses the state group's blocks only: attention would hit 6 blocks.
    c = SchedulerClient(daemon.client_config(), name="test")
    try:
        assert c.reset(groups[STATE].namespace) >= 1
        assert c.lookup(groups[0].namespace, [RequestKeys(req, groups).keys(req, 0, 6)]).hits \
            == [6]
    finally:
        c.close()
    seen = answers(e)
    e.add("b", p + [7] * 10, max_tokens=3)
    e.run()
    assert seen and all(n in (None, 0) for n, _ in seen), seen
    assert e.stats.loaded_reqs == set() and e.stats.finished[-1] == "b"
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_failed_state_load_recomputes_the_whole_request(hybrid, info, async_scheduling):
    e = hybrid(async_scheduling=async_scheduling)
    p = prompt(100)
    seed(e, p)

    def break_state_loads(meta):
        """Point only the state group's load at a slot of another tenancy: it fails while the
        attention loads beside it succeed (its keys go too: the daemon would find it by
        key)."""
        for spec in meta.loads:
            if spec.group == STATE and spec.slots:
                spec.slots = [s ^ (0x7FFF << 32) for s in spec.slots]
                spec.keys = []
                e._bad_loads.add(spec.req_id)

    e._break_loads = break_state_loads
    e.fail_next_loads = 1
    seen = answers(e)
    e.add("b", p + [7] * 10, max_tokens=3)
    e.run()
    assert "b" in e.stats.failed_loads and e.stats.finished[-1] == "b", (
        f"lookup answers {seen}, {info.info().stored_blocks} blocks stored, {e.stats}")
    # vLLM recomputed b from token 0 (never resumed on the attention that did load): the fake
    # model checked every state b resumed from.
    assert e.stats.scheduled["b"] >= len(p) + 10
    assert e.workers[0].verified_states == 0
    e.assert_clean(info)
    # The pool still serves the prefix afterwards.
    assert e.sched.reset_prefix_cache()
    e.add("c", p + [8], max_tokens=1)
    e.run()
    assert "c" in e.stats.loaded_reqs and e.workers[0].verified_states == 1
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_preempted_requests_resume_from_the_pool_with_their_state(hybrid, info,
                                                                  async_scheduling):
    # 24 GPU blocks for 8 requests that need 9 attention blocks, a window and a state each:
    # requests are preempted, wait while the others churn the GPU cache, and resume from
    # the pool (what the GPU no longer holds) with the state at the hit's end.
    e = hybrid(async_scheduling=async_scheduling, num_blocks=24, max_num_batched_tokens=128,
               slow_stores=3)
    prompts = {f"p{i}": prompt(90, 300 * i) for i in range(8)}
    for rid, p in prompts.items():
        e.add(rid, p, max_tokens=60)
    e.run(timeout_s=120)
    assert sorted(e.stats.finished) == sorted(prompts)
    assert any(r in e.preemptions for r in prompts), "the small GPU cache preempted nobody"
    assert e.stats.loaded_reqs, "a preempted request should have resumed from the pool"
    assert e.workers[0].verified_states >= 1
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_pd_hand_off_carries_the_state(make_engine, info, async_scheduling):
    pe = make_engine(groups=hybrid_groups(), worker_cls=HybridWorker, engine_id="prefill",
                     async_scheduling=async_scheduling, kv_role="kv_producer", slow_stores=2)
    de = make_engine(groups=hybrid_groups(), worker_cls=HybridWorker, engine_id="decode",
                     async_scheduling=async_scheduling, kv_role="kv_consumer")
    tokens = prompt(98, 8000)                       # 6 full blocks; states at 64 and 96
    pe.add("r1", tokens, max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    pe.run(until=lambda: "r1" in pe.stats.params)
    params = pe.stats.params["r1"]
    assert params["kvpool_tokens"] == 6 * BS
    pe.run()
    de.add("r1", tokens, max_tokens=5, kv_transfer_params=params)
    de.run()
    assert de.stats.loaded_reqs == {"r1"}
    # The whole prompt but its partial tail: 6 attention blocks, the window's 2 (+1 the
    # window reaches into), the state after 96 tokens.
    assert loaded_groups(de, "r1")[STATE] == 1 and loaded_groups(de, "r1")[0] == 6
    assert de.workers[0].verified_states == 1
    pe.assert_clean(info)
    de.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_daemon_restart_keeps_states_and_a_new_engine_resumes_on_them(
        hybrid, daemon, async_scheduling):
    a = hybrid(async_scheduling=async_scheduling, engine_id="a")
    p = prompt(100)
    a.add("seed", p, max_tokens=20)
    a.run()
    c = SchedulerClient(daemon.client_config(), name="test observer")
    try:
        wait_for(lambda: c.info().stored_blocks >= 7 + 3, 30, "turn 1's blocks and states")
    finally:
        c.close()
    daemon.kill()
    daemon.restart()                                # adopts the pool: the states are there
    b = hybrid(async_scheduling=not async_scheduling, engine_id="b")
    turn2 = p + [fake_token(len(p) + i) for i in range(20)] + prompt(20, 5000)
    b.add("t2", turn2, max_tokens=3)
    b.run()
    assert b.stats.loaded_reqs == {"t2"}
    assert b.workers[0].verified_states == 1 and loaded_groups(b, "t2")[0] == 7
    c = SchedulerClient(daemon.client_config(), name="test observer")
    try:
        b.assert_clean(c)
    finally:
        c.close()


def test_tp2_states_are_stored_and_loaded_per_rank(hybrid, info):
    e = hybrid(async_scheduling=False, tp=2)
    p = prompt(100)
    seed(e, p)
    e.add("b", p + [3] * 20, max_tokens=2)
    e.run()
    assert e.stats.loaded_reqs == {"b"}
    assert [w.verified_states for w in e.workers] == [1, 1]
    e.assert_clean(info)
