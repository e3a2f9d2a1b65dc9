"""Rules between engines that share one kvpoold: per-namespace quotas, and engines of different
TP sizes sharing blocks and handing prompts off to each other (each rank moves its own KV heads
of one slot). Real vLLM schedulers, real daemon."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .test_vllm_connector import prompt  # noqa: E402
# the same engines, one daemon, as the P/D tests
from .test_vllm_pd import engines, model_root, observer  # noqa: E402,F401
from bench.vllm_scheduler import BS, run_together  # noqa: E402

pytestmark = pytest.mark.vllm


def _usage(observer) -> dict[str, tuple[int, int, int]]:
    """description → (blocks, used bytes, quota) per namespace."""
    return {n.description: (n.blocks, n.used_bytes, n.quota_bytes)
            for n in observer.info().namespace_usage}


def test_quota_keeps_a_model_within_its_bytes_and_never_evicts_another_model(
        engines, daemon, observer):
    a = engines(daemon, engine_id="a", async_scheduling=False)
    kept = prompt(5 * BS + 3, 100)
    a.add("a1", kept, max_tokens=1)
    a.run()
    (blocks, used, quota), = _usage(observer).values()
    assert (blocks, quota) == (5, 0)
    slot = used // blocks
    q = engines(daemon, engine_id="q", async_scheduling=False,
                extra={"model_id": "tenant/capped-model", "quota": str(4 * slot)})
    for i in range(3):                               # 9 blocks through a 4-block quota
        q.add(f"q{i}", prompt(3 * BS + 1, 10_000 * (i + 1)), max_tokens=1)
        q.run()
    info = observer.info()
    capped = [n for n in info.namespace_usage if n.quota_bytes]
    assert len(capped) == 1 and capped[0].quota_bytes == 4 * slot
    assert capped[0].used_bytes <= 4 * slot and capped[0].blocks == 4
    assert info.evictions == 5
    # every block of the uncapped model is still there: a fresh engine loads all of it
    b = engines(daemon, engine_id="b", async_scheduling=False)
    b.add("b1", kept + [7], max_tokens=1)
    b.run()
    assert b.stats.loaded_reqs == {"b1"} and b.workers[0].verified_blocks == 5
    for e in (a, q, b):
        e.assert_clean(observer)


def test_a_bad_quota_is_a_config_error(engines, daemon):
    from kvpool.shared.errors import ConfigError
    with pytest.raises(ConfigError, match=r"quota='lots': expected a size such as 20GiB"):
        engines(daemon, engine_id="bad", async_scheduling=False, extra={"quota": "lots"})
    with pytest.raises(ConfigError, match="pd_handoff"):
        engines(daemon, engine_id="bad", async_scheduling=False, extra={"pd_handoff": "maybe"})


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_tp_cross_pd_hand_off_between_tp_sizes(engines, daemon, observer, prefill_tp,
                                               decode_tp):
    """A prefill at one TP size hands a prompt to a decode at another: every decode rank loads
    its own heads of every block the prefill's ranks stored, verified against the pattern."""
    pe = engines(daemon, engine_id="prefill", async_scheduling=False, kv_role="kv_producer",
                 tp=prefill_tp, slow_stores=1)
    de = engines(daemon, engine_id="decode", async_scheduling=True, kv_role="kv_consumer",
                 tp=decode_tp)
    tokens = prompt(6 * BS + 2, 3000)
    pe.add("r1", tokens, max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    pe.run(until=lambda: "r1" in pe.stats.params)
    params = pe.stats.params["r1"]
    assert params["kvpool_tokens"] == 6 * BS and params["kvpool_tp"] == prefill_tp
    de.add("r1", tokens, max_tokens=3, kv_transfer_params=params)
    run_together(pe, de)
    assert de.stats.loaded_reqs == {"r1"} and de.stats.finished == ["r1"]
    assert [w.verified_blocks for w in de.workers] == [6] * decode_tp
    usage = observer.info().namespace_usage
    assert len(usage) == 1 and usage[0].blocks == 6       # one copy, one namespace
    pe.assert_clean(observer)
    de.assert_clean(observer)


def test_tp_cross_engines_of_every_tp_size_share_prefixes(engines, daemon, observer):
    """TP=1, TP=2 and TP=4 replicas of one model (2 KV heads: TP=4 replicates them) share one
    namespace: each gets the others' prefixes from the pool, byte-exact on every rank."""
    one = engines(daemon, engine_id="tp1", async_scheduling=False)
    four = engines(daemon, engine_id="tp4", async_scheduling=True, tp=4)
    two = engines(daemon, engine_id="tp2", async_scheduling=False, tp=2)
    p = prompt(5 * BS + 3, 500)
    one.add("a", p, max_tokens=1)
    one.run()
    four.add("b", p + [9], max_tokens=2)
    four.run()
    assert four.stats.loaded_reqs == {"b"}
    assert [w.verified_blocks for w in four.workers] == [5] * 4
    q = prompt(4 * BS + 1, 9000)
    four.add("c", q, max_tokens=1)                 # stored by the TP=4 primaries only
    four.run()
    two.add("d", p + [7], max_tokens=1)
    two.add("e", q + [7], max_tokens=1)
    two.run()
    assert two.stats.loaded_reqs == {"d", "e"}
    assert [w.verified_blocks for w in two.workers] == [9, 9]
    info = observer.info()
    assert len(info.namespace_usage) == 1 and info.namespace_usage[0].blocks == 9
    regs = [c.registrations for c in info.clients if c.role.name == "WORKER"]
    assert regs == [1] * 7, regs                   # nobody refused
    for e in (one, four, two):
        e.assert_clean(observer)
