"""Rules between engines that share one kvpoold: per-namespace quotas, and P/D engines whose
TP sizes differ being refused at registration. Real vLLM schedulers, real daemon."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from .test_vllm_connector import prompt  # noqa: E402
# the same engines, one daemon, as the P/D tests
from .test_vllm_pd import engines, model_root, observer  # noqa: E402,F401
from .vllm_harness import BS  # noqa: E402

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
    with pytest.raises(ConfigError, match="not a size"):
        engines(daemon, engine_id="bad", async_scheduling=False, extra={"quota": "lots"})
    with pytest.raises(ConfigError, match="pd_handoff"):
        engines(daemon, engine_id="bad", async_scheduling=False, extra={"pd_handoff": "maybe"})


def test_decode_with_another_tp_size_is_refused_at_registration(engines, daemon, observer,
                                                                 caplog):
    pe = engines(daemon, engine_id="prefill", async_scheduling=False, kv_role="kv_producer")
    tokens = prompt(4 * BS + 2, 3000)
    pe.add("r1", tokens, max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    pe.run()
    params = pe.stats.params["r1"]
    with caplog.at_level(logging.ERROR, logger="kvpool.vllm"):
        de = engines(daemon, engine_id="decode", async_scheduling=False, kv_role="kv_consumer",
                     tp=2)
    refusals = [r.getMessage() for r in caplog.records
                if "P/D hand-off across TP sizes is not supported" in r.getMessage()]
    assert len(refusals) == 2, caplog.text                    # one per decode rank
    assert "tensor_parallel_size=2" in refusals[0] and "tensor_parallel_size=1" in refusals[0]
    regs = {c.name: c.registrations for c in observer.info().clients
            if c.engine_id == "decode" and c.role.name == "WORKER"}
    assert regs and not any(regs.values()), regs
    # the engine still serves: its P/D request is recomputed, nothing leaks
    de.add("r1", tokens, max_tokens=2, kv_transfer_params=params)
    de.run()
    assert de.stats.finished == ["r1"] and de.stats.loaded_reqs == set()
    pe.assert_clean(observer)
    de.assert_clean(observer)


def test_other_tp_sizes_may_share_a_host_when_not_doing_pd(engines, daemon, observer, caplog):
    """Replicas of one model at TP 1 and TP 2 without P/D roles: each keeps its own namespace,
    nobody is refused."""
    one = engines(daemon, engine_id="tp1", async_scheduling=False, kv_role="kv_producer")
    with caplog.at_level(logging.ERROR, logger="kvpool.vllm"):
        two = engines(daemon, engine_id="tp2", async_scheduling=False, tp=2)
    assert "refused" not in caplog.text
    two.add("x", prompt(3 * BS + 1, 500), max_tokens=1)
    two.run()
    regs = [c.registrations for c in observer.info().clients
            if c.engine_id == "tp2" and c.role.name == "WORKER"]
    assert regs == [1, 1]
    for e in (one, two):
        e.assert_clean(observer)
