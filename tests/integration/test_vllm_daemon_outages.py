"""KVPoolConnector under vLLM's real Scheduler and AsyncScheduler while its daemon goes away:
killed or frozen mid-run, every request finishes, the engine degrades to computing and comes
back to the pool, and no scheduler call waits for the daemon meanwhile."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvpool.client.scheduler import SchedulerClient  # noqa: E402
from tests.conftest import stop_process, wait_for  # noqa: E402
from tests.integration.test_vllm_connector import prompt, seed  # noqa: E402
from tests.integration.vllm_params import SCHEDULERS  # noqa: E402

pytestmark = pytest.mark.vllm


# ---- the daemon going away ----------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_daemon_killed_mid_run_every_request_finishes(make_engine, daemon, async_scheduling):
    e = make_engine(async_scheduling=async_scheduling)
    for i in range(6):
        e.add(f"r{i}", prompt(70, 1000 * i), max_tokens=20)
    e.run(until=lambda: e.stats.steps >= 4)
    daemon.kill()
    e.run(timeout_s=90)
    assert sorted(e.stats.finished) == sorted(f"r{i}" for i in range(6))
    e.assert_clean()
    # the daemon comes back: the connector reconnects by itself and pools again (once the
    # scheduler's and the workers' backoffs after the failures have passed: before that they
    # rightly skip the pool, so requests keep coming until one is stored)
    daemon.restart()
    c = SchedulerClient(daemon.client_config())
    k = 0

    def stored_again() -> bool:
        nonlocal k
        k += 1
        e.add(f"after{k}", prompt(50, 9000 + 100 * k), max_tokens=1)
        e.run(timeout_s=60)
        return c.info().stored_blocks >= 3

    wait_for(stored_again, 30, "the reconnected connector to store a request's blocks")
    e.sched.reset_prefix_cache()
    e.add("again", prompt(50, 9000 + 100 * k) + [1], max_tokens=1)
    e.run(timeout_s=60)
    assert "again" in e.stats.loaded_reqs
    try:
        e.assert_clean(c)
    finally:
        c.close()


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_daemon_frozen_mid_run_degrades_then_recovers(make_engine, daemon, async_scheduling):
    import signal
    import time

    e = make_engine(async_scheduling=async_scheduling,
                    extra={"timeout_ms": 300, "reconnect_backoff_max_ms": 500})
    for i in range(4):
        e.add(f"r{i}", prompt(70, 1000 * i), max_tokens=30)
    e.run(until=lambda: e.stats.steps >= 4)
    stop_process(daemon.proc.pid)          # alive but answering nothing
    try:
        t0 = time.monotonic()
        e.run(timeout_s=60)
        assert sorted(e.stats.finished) == [f"r{i}" for i in range(4)]
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert time.monotonic() - t0 < 30
    e.assert_clean()
    # It comes back by itself within a few backoff periods: a prompt stored now hits later.
    deadline = time.monotonic() + 20
    for k in range(1000):
        e.add(f"after{k}", prompt(50, 9000 + 100 * k), max_tokens=1)
        e.run(timeout_s=60)
        e.sched.reset_prefix_cache()
        e.add(f"again{k}", prompt(50, 9000 + 100 * k) + [1], max_tokens=1)
        e.run(timeout_s=60)
        if f"again{k}" in e.stats.loaded_reqs:
            break
        assert time.monotonic() < deadline, "the connector did not come back to the daemon"
    c = SchedulerClient(daemon.client_config())
    try:
        e.assert_clean(c)
    finally:
        c.close()


# ---- the scheduler never waits for the daemon ------------------------------------------------

@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_no_scheduler_call_waits_while_the_daemon_is_frozen(make_engine, daemon,
                                                           async_scheduling):
    import signal
    import time

    # timeout_ms 5 s: a call that waited for an answer would take that long.
    e = make_engine(async_scheduling=async_scheduling, extra={"timeout_ms": 5000})
    conn = e.connector
    slowest: dict[str, float] = {}
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                 "build_connector_meta", "update_connector_output", "request_finished",
                 "request_finished_all_groups", "reset_cache"):
        fn = getattr(conn, name)

        def timed(*a, __fn=fn, __name=name, **kw):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **kw)
            finally:
                slowest[__name] = max(slowest.get(__name, 0.0), time.perf_counter() - t0)

        setattr(conn, name, timed)
    seed(e, prompt(70))
    for i in range(4):
        e.add(f"r{i}", prompt(70) + prompt(40, 5000 + 100 * i), max_tokens=30)
    e.run(until=lambda: e.stats.steps >= 4)
    stop_process(daemon.proc.pid)          # alive, answering nothing
    try:
        t0 = time.monotonic()
        e.run(until=lambda: e.stats.steps >= 40 or time.monotonic() - t0 > 3)
        e.sched.reset_prefix_cache(reset_connector=True)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    e.run(timeout_s=60)
    assert sorted(e.stats.finished) == sorted(["seed"] + [f"r{i}" for i in range(4)])
    # Generous for a loaded 2-core host, and far below the 5 s a round trip would wait.
    assert max(slowest.values()) < 0.5, slowest
    e.assert_clean()
