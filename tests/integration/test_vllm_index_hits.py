"""Hits read from the daemon's shared-memory index under vLLM's real scheduler, against a real
kvpoold: a pooled prefix is scheduled with its hit in the step it arrives, a block gone
between the offer and the load is recomputed (never read from a reused slot), the hits read
reach the daemon, and without an index the round trip still serves the hit a step later."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from kvpool.client.index_reader import IndexReader  # noqa: E402
from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

from bench.vllm_scheduler import BS  # noqa: E402
from tests.integration.vllm_params import SCHEDULERS  # noqa: E402

pytestmark = pytest.mark.vllm


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def seed(e, tokens: list[int]) -> None:
    """Store ``tokens``' blocks in the pool, then empty the GPU prefix cache."""
    e.add("seed", tokens, max_tokens=1)
    e.run()
    assert e.sched.reset_prefix_cache()


def spy_offers(role, then=None) -> list:
    """(request id, answer) of each get_num_new_matched_tokens call; ``then(rid, answer)``
    runs after each."""
    seen: list = []
    original = role.get_num_new_matched_tokens

    def spy(request, num_computed):
        out = original(request, num_computed)
        seen.append((request.request_id, out[0]))
        if then is not None:
            then(request.request_id, out[0])
        return out

    role.get_num_new_matched_tokens = spy
    return seen


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_pooled_prefix_is_scheduled_with_its_hit_in_the_step_it_arrives(
        make_engine, info, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(70)
    seed(e, p)
    hits_before = info.info().hit_blocks
    seen = spy_offers(e.connector.scheduler)
    e.add("b", p + [1, 2, 3], max_tokens=4)
    e.run()
    answers = [n for rid, n in seen if rid == "b"]
    assert answers and answers[0] == 4 * BS, f"offers of b: {answers}"   # no step with None
    assert e.stats.loaded_reqs == {"b"} and e.workers[0].verified_blocks == 4
    # The hits read reach the daemon (a touch, counted like a lookup's hits).
    wait_for(lambda: info.info().hit_blocks >= hits_before + 4, timeout_s=10,
             what="the daemon counted the hits read in the index")
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_block_gone_between_offer_and_load_is_recomputed(make_engine, info,
                                                           async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(70)
    seed(e, p)
    role = e.connector.scheduler
    namespace = role.lookups.groups[0].namespace
    stale_before = info.info().load_stale_blocks
    removed: list[int] = []

    def evict(rid, answer):
        # Offered from the index (no pin): the pool lets the blocks go before the load.
        if rid == "b" and answer and not removed:
            removed.append(info.reset(namespace))

    spy_offers(role, then=evict)
    e.add("b", p + [1, 2, 3], max_tokens=4)
    e.run()
    assert removed and removed[0] >= 4
    assert e.stats.finished[-1] == "b"
    # The slots were never read as b's blocks: none verified (a slot's bytes would not match
    # b's tokens), all recomputed, and counted stale by the daemon.
    assert e.workers[0].verified_blocks == 0
    assert info.info().load_stale_blocks >= stale_before + 4
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_without_an_index_the_round_trip_serves_the_hit_a_step_later(
        make_engine, info, async_scheduling, monkeypatch, caplog):
    def refuse(segment):
        raise PermissionError("mapped by another user")

    monkeypatch.setattr(IndexReader, "open", staticmethod(refuse))
    e = make_engine(async_scheduling=async_scheduling)
    p = prompt(70)
    seed(e, p)
    seen = spy_offers(e.connector.scheduler)
    with caplog.at_level(logging.WARNING):
        e.add("b", p + [1, 2, 3], max_tokens=4)
        e.run()
        e.sched.reset_prefix_cache()
        e.add("c", p + [4], max_tokens=1)
        e.run()
    answers = [n for rid, n in seen if rid == "b"]
    assert answers[0] is None and 4 * BS in answers
    assert {"b", "c"} <= e.stats.loaded_reqs
    logged = [r for r in caplog.records if "shared-memory index" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    e.assert_clean(info)


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_a_block_evicted_between_offer_and_load_is_recomputed(make_engine, daemon_factory,
                                                              async_scheduling):
    # 4 MiB: 2 extents of 64 slots; another engine's stores turn the pool over while the
    # offer waits for its load (a silent client is kept 10 s: the filler runs inside a step).
    small = daemon_factory(pool_size="4MiB", extra=["--peer-timeout-ms", "10000"])
    observer = SchedulerClient(small.client_config(), name="test observer")
    try:
        e = make_engine(socket=small.socket, async_scheduling=async_scheduling)
        filler = make_engine(socket=small.socket, engine_id="filler", async_scheduling=False,
                             num_blocks=512, max_num_batched_tokens=512)
        p = prompt(70)
        seed(e, p)
        before = observer.info()
        filled: list[bool] = []

        def evict(rid, answer):
            if rid == "b" and answer and not filled:
                filled.append(True)
                for i in range(12):                   # 12 x 48 blocks
                    filler.add(f"fill{i}", prompt(48 * BS, 20000 + 1000 * i), max_tokens=1)
                filler.run(timeout_s=120)

        seen = spy_offers(e.connector.scheduler, then=evict)
        e.add("b", p + [1, 2, 3], max_tokens=4)
        e.run()
        assert [n for rid, n in seen if rid == "b"][0] == 4 * BS
        assert filled and e.stats.finished[-1] == "b"
        after = observer.info()
        assert after.evictions > before.evictions
        # Never read from a reused slot: no block verified as b's (the fake model's check
        # would fail on another request's bytes), all 4 recomputed, counted stale.
        assert e.workers[0].verified_blocks == 0
        assert after.load_stale_blocks >= before.load_stale_blocks + 4
        e.assert_clean(observer)
        filler.assert_clean(observer)
    finally:
        observer.close()
