"""Every block a real CPU engine computed is stored while the pool has room: a burst far larger
than one client's old reservation share, into pools of several sizes with a disk tier, then
kill -9 of the daemon, a restart, and a second engine on the same prompts: started after the
restart, or started before the kill and idle across it (the engine a restarted daemon must
answer at once: its loop once stalled 2-3.4 s importing torch, issue 36)."""

import pytest

from tests.conftest import wait_for
from tests.engine.conftest import BLOCK, assert_same_outputs, prompts

pytestmark = pytest.mark.timeout(900)

# The test model's KV per block: 2 layers x (K, V) x 2 KV heads x 32 x fp32 x 128 tokens.
BLOCK_BYTES = 128 << 10
PROMPT_BLOCKS = 11
P = prompts(6, seed=11, tokens=PROMPT_BLOCKS * BLOCK + 40)   # 66 full blocks in one burst


def gen(ps, max_tokens=1):
    return {"op": "generate", "prompts": ps, "max_tokens": max_tokens}


def settled(observer, stored: int):
    """Nothing being written, and the disk tier done with all ``stored`` blocks: written down,
    or counted missed (left the pool before the disk could take them)."""
    info = observer.info()
    disk = info.tiers[0] if info.tiers else None
    return info.slots_writing == 0 and disk is not None \
        and disk.blocks + disk.missed_blocks >= stored


def burst_then_restart(daemon, engines, observer, tmp_path, waves: int,
                       b_idle_across_restart: bool = False) -> tuple[int, dict]:
    """Engine a computes P in one burst; the daemon is SIGKILLed once its disk tier has taken
    what the pool stored, and restarted; engine b runs P again, ``waves`` prompts at a time,
    started after the restart or (``b_idle_across_restart``) before the kill, registered with
    the first daemon and idle until after the restart. Returns (blocks stored by engine a,
    engine b's outputs)."""
    step = len(P) // waves
    b_steps = [gen(P[i:i + step]) for i in range(0, len(P), step)]
    a = engines(daemon.socket, [gen(P)], name="a", max_num_batched_tokens=2048)
    a.wait_ready()
    a.next()
    a.finish()
    # The engine answers before its last stores land (a held store waits up to a hold for the
    # disk to make room): the kill comes once the burst is stored whole.
    total = len(P) * PROMPT_BLOCKS
    wait_for(lambda: observer.info().stored_blocks >= total, 60,
             lambda: f"engine a's {total} blocks to be stored: {observer.info()}")
    stored = observer.info().stored_blocks
    wait_for(lambda: settled(observer, stored), 60,
             lambda: f"the disk tier to take the {stored} stored blocks: {observer.info().tiers}")
    b = None
    if b_idle_across_restart:
        # (not beside engine a: two engine start-ups and a's burst on two cores starved a's
        # scheduler of its heartbeats past the test daemon's 2 s peer timeout)
        b = engines(daemon.socket, [{"op": "wait", "name": "restarted"}] + b_steps, name="b",
                    max_num_batched_tokens=2048)
        b.wait_ready()              # registered with this daemon, now idle
        assert b.next()["waiting"] == "restarted"
    daemon.kill()
    daemon.restart()
    if b is None:
        b = engines(daemon.socket, b_steps, name="b", max_num_batched_tokens=2048)
        b.wait_ready()
    else:
        b.go()
    outs = [b.next() for _ in range(waves)]
    b.finish()
    return stored, {"tokens": [t for o in outs for t in o["tokens"]],
                    "logprobs": [lp for o in outs for lp in o["logprobs"]]}


def test_a_burst_larger_than_an_eighth_of_the_pool_is_stored_whole(
        daemon_factory, engines, observer_of, tmp_path, baseline_outputs):
    want = baseline_outputs(P, 1)      # started now, beside the test's engines
    # 32 MiB: ~250 blocks of 128 KiB; one client's share used to be 1/8 of it, ~31 blocks.
    d = daemon_factory(pool_size="32MiB", extra=["--extent-size", "1MiB", "--disk-path",
                                                 str(tmp_path / "disk"), "--disk-size", "64MiB"])
    observer = observer_of(d)
    stored, out = burst_then_restart(d, engines, observer, tmp_path, waves=1)
    assert stored == len(P) * PROMPT_BLOCKS, f"stored {stored} of {len(P) * PROMPT_BLOCKS}"
    assert observer.info().loaded_blocks == len(P) * PROMPT_BLOCKS, observer.info()
    assert_same_outputs(out, want, "after kill -9 and restart")


def test_a_working_set_of_2_4_pools_mostly_loads_after_kill_and_restart(
        daemon_factory, engines, observer_of, tmp_path, baseline_outputs):
    want = baseline_outputs(P, 1)
    # 4 MiB in 1 MiB extents: 24 slots once the pool's tables are taken; 66 blocks are 2.75x.
    # A 10 s peer timeout (the test daemons' is 2 s): on a 2-core host under load every client
    # process here once went silent past 2 s at the same moment, the daemon's loop never
    # held over 38 ms, and engine a lost its registration before b existed. What this test
    # checks is the restart under an idle engine, not the release of silent clients.
    d = daemon_factory(pool_size="4MiB", extra=["--extent-size", "1MiB", "--disk-path",
                                                str(tmp_path / "disk"), "--disk-size", "64MiB",
                                                "--peer-timeout-ms", "10000"])
    observer = observer_of(d)
    slots = observer.info().free_bytes // BLOCK_BYTES
    total = len(P) * PROMPT_BLOCKS
    assert total >= 2.4 * slots, f"the pool holds {slots} blocks: the working set is too small"
    # Engine b takes all six prompts in one batch: their loads (66 blocks) come up from disk
    # into the 24-slot pool window by window, in turn (each load holding its pool hits while
    # another staged its fills loaded 48 of 66 two prompts at a time).
    # Engine b idles across the restart: its batch finds the new daemon at once.
    stored, out = burst_then_restart(d, engines, observer, tmp_path, waves=1,
                                     b_idle_across_restart=True)
    info = observer.info()
    assert info.loaded_blocks >= 0.9 * total, (
        f"{info.loaded_blocks} of {total} blocks loaded after the restart (engine a stored "
        f"{stored}); disk tier: {info.tiers}")
    assert_same_outputs(out, want, "after kill -9 and restart")
