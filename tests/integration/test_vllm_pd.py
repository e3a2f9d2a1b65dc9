"""Several vLLM engines on one kvpoold: sharing, isolation, and P/D hand-off through the pool.

Each engine is a real vLLM scheduler with its own engine id, its own connector clients and its
own fake worker memory; they meet only in the daemon, as separate vLLM instances on one host do.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvpool.client.scheduler import SchedulerClient  # noqa: E402

from .test_vllm_connector import prompt  # noqa: E402
from bench.vllm_scheduler import BS, Engine, run_together  # noqa: E402

pytestmark = pytest.mark.vllm

BOTH_SCHEDULERS = pytest.mark.parametrize("async_scheduling", [False, True],
                                          ids=["Scheduler", "AsyncScheduler"])


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-model-pd")


@pytest.fixture
def engines(model_root):
    made: list[Engine] = []

    def make(daemon, **kw) -> Engine:
        e = Engine(model_root, daemon.socket, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def observer(daemon):
    c = SchedulerClient(daemon.client_config(), name="test observer")
    yield c
    c.close()


@BOTH_SCHEDULERS
def test_second_engine_loads_what_the_first_stored(engines, daemon, observer, async_scheduling):
    a = engines(daemon, engine_id="a", async_scheduling=async_scheduling)
    b = engines(daemon, engine_id="b", async_scheduling=not async_scheduling)
    p = prompt(90)
    a.add("x", p, max_tokens=1)
    a.run()
    b.add("y", p + [5], max_tokens=2)
    b.run()
    assert b.stats.loaded_reqs == {"y"}
    assert b.workers[0].verified_blocks == 5
    a.assert_clean(observer)
    b.assert_clean(observer)


def test_isolation_between_models_and_salts(engines, daemon, observer):
    a = engines(daemon, engine_id="a", async_scheduling=False)
    other_model = engines(daemon, engine_id="m", async_scheduling=False,
                          extra={"model_id": "another/model"})
    b = engines(daemon, engine_id="b", async_scheduling=False)
    p = prompt(70)
    a.add("x", p, max_tokens=1, cache_salt="tenant-1")
    a.run()
    other_model.add("y", p, max_tokens=1, cache_salt="tenant-1")
    other_model.run()
    b.add("no-salt", p, max_tokens=1)
    b.add("salt-2", p, max_tokens=1, cache_salt="tenant-2")
    b.run()
    assert other_model.stats.loaded_reqs == set()
    assert b.stats.loaded_reqs == set()
    b.sched.reset_prefix_cache()
    b.add("salt-1", p, max_tokens=1, cache_salt="tenant-1")
    b.run()
    assert b.stats.loaded_reqs == {"salt-1"}
    # another KV-cache layout is another namespace: it neither sees nor corrupts these blocks
    c = engines(daemon, engine_id="c", async_scheduling=False, block_outermost=True)
    c.add("z", p, max_tokens=1, cache_salt="tenant-1")
    c.run()
    assert c.stats.loaded_reqs == set()
    for e in (a, other_model, b, c):
        e.assert_clean(observer)


def _prefill(p_engine: Engine, rid: str, tokens: list[int]) -> dict:
    """What a disaggregated-serving proxy does first: prefill with max_tokens=1 and
    do_remote_decode, and take kv_transfer_params from the response."""
    p_engine.add(rid, tokens, max_tokens=1,
                 kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None})
    p_engine.run()
    params = p_engine.stats.params[rid]
    assert params and params["do_remote_prefill"] is True
    return params


@BOTH_SCHEDULERS
def test_pd_hand_off_through_the_pool(engines, daemon, observer, async_scheduling):
    pe = engines(daemon, engine_id="prefill", async_scheduling=async_scheduling,
                 kv_role="kv_producer", slow_stores=2)
    de = engines(daemon, engine_id="decode", async_scheduling=async_scheduling,
                 kv_role="kv_consumer")
    shared = prompt(48, 5000)
    # the producer's prefix comes from the pool, and it still hands over every block
    pe.add("warm", shared + [1], max_tokens=1)
    pe.run()
    pe.sched.reset_prefix_cache()
    tokens = shared + prompt(50, 8000)           # 98 tokens: 6 full blocks
    pe.add("r1", tokens, max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    pe.run(until=lambda: "r1" in pe.stats.params)
    params = pe.stats.params["r1"]
    assert params["kvpool_tokens"] == 6 * BS and params["remote_engine_id"] == "prefill"
    assert pe.connector.scheduler.batches.by_id, "its blocks stay allocated until the stores land"
    pe.run()
    de.add("r1", tokens, max_tokens=5, kv_transfer_params=params)
    de.run()
    assert de.stats.loaded_reqs == {"r1"}
    assert de.workers[0].verified_blocks == 6     # the whole prompt but the partial tail
    pe.assert_clean(observer)
    de.assert_clean(observer)


def test_decode_waits_for_a_hand_off_still_landing(engines, daemon, observer):
    """The decode request can reach its instance before the prefill's blocks are in the pool
    (the prefill answers as soon as it finishes); it asks again until the first of them are,
    then loads the rest as the prefill's stores land, over several steps."""
    pe = engines(daemon, engine_id="prefill", async_scheduling=True, kv_role="kv_producer",
                 max_num_batched_tokens=32, late_stores=2)
    de = engines(daemon, engine_id="decode", async_scheduling=True, kv_role="kv_consumer")
    tokens = prompt(98, 6000)
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_engine_id": "prefill", "kvpool_tokens": 6 * BS, "kvpool_tp": 1}
    de.add("r1", tokens, max_tokens=3, kv_transfer_params=params)
    de.run(until=lambda: de.stats.steps >= 6)
    assert de.sched.requests["r1"].num_computed_tokens == 0, "it should wait, not compute"
    pe.add("r1", tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run_together(pe, de)
    assert de.stats.loaded_reqs == {"r1"} and de.workers[0].verified_blocks == 6
    pe.assert_clean(observer)
    de.assert_clean(observer)


def test_pd_block_evicted_before_decode_recomputes(engines, daemon_factory, model_root):
    small = daemon_factory(pool_size="4MiB")      # 2 extents of 64 slots of 4 KiB each
    pe = engines(small, engine_id="prefill", async_scheduling=False, kv_role="kv_producer",
                 num_blocks=512, max_num_batched_tokens=512)
    de = engines(small, engine_id="decode", async_scheduling=False, kv_role="kv_consumer",
                 extra={"pd_wait_s": 0.2})
    tokens = prompt(80, 3000)
    params = _prefill(pe, "r1", tokens)
    for i in range(12):                           # 12 × 48 blocks: the pool turns over
        pe.add(f"fill{i}", prompt(48 * BS, 20000 + 1000 * i), max_tokens=1)
    pe.run(timeout_s=120)
    de.add("r1", tokens, max_tokens=3, kv_transfer_params=params)
    de.run()
    assert de.stats.finished == ["r1"]
    assert de.workers[0].verified_blocks < 4      # some or all of it was recomputed
    c = SchedulerClient(small.client_config())
    try:
        assert c.info().evictions > 0
        pe.assert_clean(c)
        de.assert_clean(c)
    finally:
        c.close()


def test_decode_started_after_prefill_stopped(engines, daemon, observer):
    pe = engines(daemon, engine_id="prefill", async_scheduling=True, kv_role="kv_producer")
    tokens = prompt(64, 4000)
    params = _prefill(pe, "r1", tokens)
    pe.assert_clean(observer)
    pe.close()
    de = engines(daemon, engine_id="decode", async_scheduling=True, kv_role="kv_consumer")
    de.add("r1", tokens, max_tokens=2, kv_transfer_params=params)
    de.run()
    assert de.stats.loaded_reqs == {"r1"}
    assert de.workers[0].verified_blocks == 3     # 64 tokens: the last block is recomputed
    de.assert_clean(observer)


# ---- streaming: the decode loads each chunk as the prefill's stores commit it -----------------

@pytest.fixture
def steady(daemon_factory):
    """A daemon that releases a silent client only after 10 s, and an observer of it. These
    tests count blocks exactly; with the usual 500 ms a heartbeat thread kept from the GIL on a
    loaded machine now and then gets its client released, which (rightly) ends a hand-off early.
    """
    d = daemon_factory(extra=["--peer-timeout-ms", "10000"])
    c = SchedulerClient(d.client_config(), name="test observer")
    yield d, c
    c.close()


def _stream_setup(engines, daemon, async_scheduling: bool, pd_wait_s: float):
    """A prefill whose 6 store jobs (2 blocks each) reach the pool only when the test lets
    them go, and a decode request for the same prompt sent as soon as the prefill answered."""
    pe = engines(daemon, engine_id="prefill", async_scheduling=async_scheduling,
                 kv_role="kv_producer", max_num_batched_tokens=2 * BS, hold_stores=True)
    de = engines(daemon, engine_id="decode", async_scheduling=async_scheduling,
                 kv_role="kv_consumer", extra={"pd_wait_s": pd_wait_s})
    tokens = prompt(12 * BS + 8, 6000)            # 12 full blocks, computed 2 per step
    pe.add("r1", tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    pe.run(until=lambda: "r1" in pe.stats.params)
    params = pe.stats.params["r1"]
    assert params["kvpool_tokens"] == 12 * BS
    held = pe.held[0]
    assert len(held.held) == 6 and not held.sent_blocks, "no store should be in the pool yet"
    de.add("r1", tokens, max_tokens=3, kv_transfer_params=params)
    return pe, de, held


def _loaded(e, rid: str = "r1") -> int:
    """Blocks the engine's workers were told to load for ``rid`` so far."""
    return sum(len(b) for _, b in e.workers[0].load_history.get(rid, []))


def _land_chunks(pe, de, held, n: int) -> None:
    """Let the prefill's next ``n`` store jobs go, one at a time; after each, the decode must
    load that chunk before the next one is even copied."""
    for _ in range(n):
        pe.release_stores(1)
        want = 2 * len(held.sent_blocks)
        run_together(pe, de, until=lambda: _loaded(de) >= want, timeout_s=30)
        assert _loaded(de) == want, (
            f"the decode loaded blocks that were not in the pool: it was told to load "
            f"{de.workers[0].load_history['r1']} while the prefill had copied "
            f"{held.sent_blocks}")


@BOTH_SCHEDULERS
def test_decode_loads_each_chunk_as_the_prefill_stores_it(engines, steady, async_scheduling):
    from vllm.v1.request import RequestStatus

    daemon, observer = steady
    pe, de, held = _stream_setup(engines, daemon, async_scheduling, pd_wait_s=30.0)
    _land_chunks(pe, de, held, 1)
    # its first load job went out while 5 of the prefill's 6 store jobs were not even copied
    assert len(held.held) == 5
    assert de.sched.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _land_chunks(pe, de, held, 5)
    run_together(pe, de)
    # loads as the chunks land (read in the shared-memory index, a chunk's two blocks may be
    # seen one step apart), never ahead of them; every byte is what the prefill computed
    loads = [len(b) for _, b in de.workers[0].load_history["r1"]]
    assert sum(loads) == 12 and max(loads) <= 2 and len(loads) >= 6, loads
    assert de.stats.loaded_reqs == {"r1"} and de.workers[0].verified_blocks == 12
    assert de.stats.finished == ["r1"]
    # the decode computed only the partial tail block and its decode steps
    assert de.stats.scheduled["r1"] == 8 + 2
    pe.assert_clean(observer)
    de.assert_clean(observer)


@BOTH_SCHEDULERS
def test_prefill_dying_mid_hand_off_decode_keeps_what_arrived(engines, steady,
                                                              async_scheduling):
    daemon, observer = steady
    # pd_wait_s is the decode's patience between chunks, also while the first three land: at
    # 2 s a loaded 2-core machine let it run out before one had (2 failures in one loaded run
    # of the suite); the test then waits this long once after the prefill died.
    pe, de, held = _stream_setup(engines, daemon, async_scheduling, pd_wait_s=6.0)
    _land_chunks(pe, de, held, 3)
    pe.fail_stores()                  # the prefill dies: its other 3 store jobs never land
    run_together(pe, de)
    assert de.stats.finished == ["r1"]
    assert de.workers[0].verified_blocks == 6
    # the 6 blocks that arrived are kept; vLLM recomputes from the first missing one
    assert de.stats.scheduled["r1"] == (12 * BS + 8 - 6 * BS) + 2
    pe.assert_clean(observer)
    de.assert_clean(observer)


@BOTH_SCHEDULERS
def test_decode_aborted_while_streaming_leaks_nothing(engines, steady, async_scheduling):
    daemon, observer = steady
    pe, de, held = _stream_setup(engines, daemon, async_scheduling, pd_wait_s=30.0)
    _land_chunks(pe, de, held, 2)
    de.abort("r1")
    de.run(timeout_s=30)              # nothing more to wait for: the stream ends at once
    assert "r1" not in de.stats.finished and _loaded(de) == 4
    de.assert_clean()
    pe.release_stores()               # (the daemon counts the held ones as being written)
    pe.run()
    pe.assert_clean(observer)
    de.assert_clean(observer)


def test_daemon_dying_mid_hand_off_decode_recomputes(engines, steady):
    daemon, _ = steady
    pe, de, held = _stream_setup(engines, daemon, False, pd_wait_s=120.0)
    _land_chunks(pe, de, held, 2)
    daemon.kill()
    pe.release_stores()               # they fail: no daemon to take them
    # long before pd_wait_s: the stream ends on the daemon's absence
    run_together(pe, de, timeout_s=60)
    assert de.stats.finished == ["r1"]
    # the chunks whose loads completed before the daemon died are kept (bit-exact), the
    # rest is recomputed
    kept = 12 * BS + 8 + 2 - de.stats.scheduled["r1"]
    assert kept in (0, 2 * BS, 4 * BS) and kept == de.workers[0].verified_blocks * BS
    pe.assert_clean()
    de.assert_clean()


def test_sliding_window_model_loads_the_hand_off_once_all_landed(engines, steady):
    """A window group keeps only the window ending at the hit, which moves as chunks land:
    such a model does not stream, it waits for the whole hand-off and loads it at once."""
    daemon, observer = steady
    pe = engines(daemon, engine_id="prefill", async_scheduling=False, kv_role="kv_producer",
                 hybrid=True, max_num_batched_tokens=2 * BS, hold_stores=True)
    de = engines(daemon, engine_id="decode", async_scheduling=False, kv_role="kv_consumer",
                 hybrid=True, extra={"pd_wait_s": 30.0})
    tokens = prompt(12 * BS + 8, 6000)
    pe.add("r1", tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    pe.run(until=lambda: "r1" in pe.stats.params)
    de.add("r1", tokens, max_tokens=3, kv_transfer_params=pe.stats.params["r1"])
    held = pe.held[0]
    pe.release_stores(len(held.held) - 1)
    steps = de.stats.steps
    run_together(pe, de, until=lambda: de.stats.steps >= steps + 20)
    assert _loaded(de) == 0 and de.sched.requests["r1"].num_computed_tokens == 0
    pe.release_stores()
    run_together(pe, de)
    assert de.stats.loaded_reqs == {"r1"}
    # one load per group: all 12 full-attention blocks, and the window's 2
    assert sorted((g, len(b)) for g, b in de.workers[0].load_history["r1"]) == [(0, 12), (1, 2)]
    assert de.workers[0].verified_blocks == 14
    pe.assert_clean(observer)
    de.assert_clean(observer)


def test_fail_policy_waits_for_the_whole_hand_off_unless_told_to_stream(engines, daemon):
    """A stalled stream ends in load errors, which vLLM's "fail" policy turns into a failed
    request: with that policy the decode side waits for the whole hand-off by default."""
    keep = {"load_failure_policy": "fail"}    # else the connector switches it to recompute
    fail = engines(daemon, engine_id="f", async_scheduling=False, kv_role="kv_consumer",
                   load_failure_policy="fail", extra=keep)
    forced = engines(daemon, engine_id="s", async_scheduling=False, kv_role="kv_consumer",
                     load_failure_policy="fail", extra={**keep, "pd_stream": True})
    switched = engines(daemon, engine_id="w", async_scheduling=False, kv_role="kv_consumer",
                       load_failure_policy="fail")
    default = engines(daemon, engine_id="d", async_scheduling=False, kv_role="kv_consumer")
    assert not fail.connector.scheduler.pd.can_stream
    assert fail.sched.recompute_kv_load_failures is False
    assert forced.connector.scheduler.pd.can_stream and default.connector.scheduler.pd.can_stream
    assert switched.connector.scheduler.pd.can_stream
    assert switched.sched.recompute_kv_load_failures is True


@BOTH_SCHEDULERS
def test_engines_storing_one_prompt_at_once_store_each_block_once(engines, daemon, observer,
                                                                   async_scheduling):
    a = engines(daemon, engine_id="a", async_scheduling=async_scheduling, slow_stores=2)
    b = engines(daemon, engine_id="b", async_scheduling=not async_scheduling, slow_stores=2)
    p = prompt(100)
    a.add("x", p, max_tokens=3)
    b.add("y", p, max_tokens=3)
    run_together(a, b)
    info = observer.info()
    # Both planned all 6 blocks with their own slots; the daemon kept one copy of each.
    assert info.stored_blocks == 6 and info.slots_writing == 0
    c = engines(daemon, engine_id="c", async_scheduling=False)
    c.add("z", p + [9], max_tokens=1)
    c.run()
    assert c.stats.loaded_reqs == {"z"} and c.workers[0].verified_blocks == 6
    for e in (a, b, c):
        e.assert_clean(observer)
