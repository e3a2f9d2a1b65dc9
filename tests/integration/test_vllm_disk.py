"""The disk tier under vLLM's real scheduler: an engine whose working set is far bigger than the
pool still gets its prompts back, bit-exact, after the daemon restarts with its pool gone."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

from bench.vllm_scheduler import BS, Engine  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS, BLOCKS, WAVE = 16, 32, 4       # 512 blocks of 4 KiB against a pool of 192 slots


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-model")


def prompt(i: int) -> list[int]:
    return [100 + i * 1000 + t for t in range(BLOCKS * BS)]


def run_in_waves(e: Engine, tag: str, after_wave=lambda done: None) -> None:
    """Every prompt once, WAVE at a time (a wave's promotions fit the pool)."""
    for w in range(0, PROMPTS, WAVE):
        for i in range(w, w + WAVE):
            e.add(f"{tag}{i}", prompt(i), max_tokens=1)
        e.run(timeout_s=120)
        after_wave(w + WAVE)


def test_working_set_beyond_the_pool_hits_from_disk_after_a_restart(model_root, daemon_factory,
                                                                      tmp_path):
    # 2 MiB pool in 256 KiB extents: 3 extents of 64 slots once the pool's tables are taken.
    d = daemon_factory(pool_size="2MiB", extra=["--extent-size", "256KiB", "--disk-path",
                                                str(tmp_path / "disk"), "--disk-size", "64MiB"])
    info = SchedulerClient(d.client_config(timeout_ms=10000), name="test observer")
    engine_kw = dict(async_scheduling=False, num_blocks=256, max_num_batched_tokens=256)
    e = Engine(model_root, d.socket, engine_id="engine-a", **engine_kw)
    try:
        # The disk keeps up with this engine easily; waiting makes "nothing missed" exact.
        run_in_waves(e, "a", lambda done: wait_for(
            lambda: info.info().tiers[0].blocks >= done * BLOCKS, 30,
            f"the first {done * BLOCKS} blocks on disk: {info.info().tiers[0]}"))
        first = info.info()
        assert first.slots_committed < PROMPTS * BLOCKS / 2, "the pool was not far smaller"
        assert first.evictions > 0 and first.tiers[0].missed_blocks == 0
    finally:
        e.close()
    info.close()

    d.kill()                               # a reboot: the daemon and its pool are gone
    import posix_ipc
    posix_ipc.unlink_shared_memory("/" + d.pool_name)
    d.restart()
    info = SchedulerClient(d.client_config(timeout_ms=10000), name="test observer")
    assert info.info().tiers[0].adopted_blocks == PROMPTS * BLOCKS
    e = Engine(model_root, d.socket, engine_id="engine-b", **engine_kw)
    try:
        run_in_waves(e, "b")
        assert e.stats.loaded_reqs == {f"b{i}" for i in range(PROMPTS)}
        assert not e.stats.failed_loads
        # Every prompt but its last block (one token is always recomputed) came from disk,
        # and the fake workers checked each loaded block against what the first engine wrote.
        assert e.workers[0].verified_blocks == PROMPTS * (BLOCKS - 1)
        t = info.info().tiers[0]
        assert t.promoted_blocks >= PROMPTS * (BLOCKS - 1) and t.verify_failures == 0, t
        e.assert_clean(info)
    finally:
        e.close()
        info.close()
