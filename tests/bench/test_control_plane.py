"""bench/control_plane.py at a tiny size against a real daemon: the CPU accounting per thread that
``round_trip_cpu_us`` is read from; the lookups read in the shared-memory index (all 256 hits
while idle, the index moving under a writer in the busy phase); the round trips kept beside
them; the connector arm next to vLLM's own offload connector (hits from its CPU cache, both timed
the same way); and one whole run's JSON. No timing is asserted: only that each figure is there
and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from bench.control_plane import lookup_setup
from bench.control_plane_lookups import (LOOKUP_KEYS, busy_index_lookups, cpu_between,
                                         cpu_by_thread, echo_round_trip_cpu, index_lookups,
                                         round_trip_cpu, roundtrip_lookups)
from kvpool.client.scheduler import SchedulerClient

ROOT = Path(__file__).parent.parent.parent


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_goes_to_the_thread_that_spent_it():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)           # starts ZeroMQ's I/O thread ("ZMQbg/IO/0")
    try:
        spun, leave = threading.Event(), threading.Event()

        def other() -> None:
            _spin(0.05)
            spun.set()
            leave.wait(30)      # a thread that ended is gone from /proc: read it alive

        worker = threading.Thread(target=other, name="bench-other")
        before = cpu_by_thread(os.getpid())
        worker.start()
        _spin(0.05)
        assert spun.wait(30), "the other thread did not spin"
        after = cpu_by_thread(os.getpid())
        leave.set()
        worker.join()
    finally:
        sock.close(0)
        ctx.term()
    spent = {k: after[k] - before[k] for k in after}
    assert spent["main"] >= 0.045, spent
    assert spent["other"] >= 0.045, spent
    assert spent["io"] < 0.02, spent      # an idle I/O thread is counted, and apart


def test_cpu_between_counts_what_each_thread_spent_and_never_what_an_ended_one_had():
    # main spent 0.2, an I/O thread 0.1; a thread that ended meanwhile (its 5 s gone from the
    # second reading) and one that started (0.3 s, all of it in between)
    before = {1: ("main", 10.0), 2: ("ZMQbg/IO/0", 1.0), 3: ("attach", 5.0)}
    after = {1: ("main", 10.2), 2: ("ZMQbg/IO/0", 1.1), 4: ("new", 0.3)}
    assert abs(cpu_between(before, after) - 0.6) < 1e-9


def test_a_round_trip_costs_cpu_on_both_sides(daemon):
    client = SchedulerClient(daemon.client_config(), "bench-test")
    try:
        client.ping()
        per_call = round_trip_cpu(client.ping, 200, daemon.proc.pid)
    finally:
        client.close()
    assert set(per_call) == {"client_main_us", "client_io_us", "daemon_main_us",
                             "daemon_io_us"}, per_call
    for side in per_call:      # every part of a ZeroMQ round trip runs on each of them
        assert 0 < per_call[side] < 100_000, per_call


def test_the_bare_echo_floor_is_measured_on_both_sides(tmp_path):
    per_call = echo_round_trip_cpu(str(tmp_path), 200, bytes(4096))
    for side in per_call:
        assert 0 < per_call[side] < 100_000, per_call


@pytest.fixture
def lookup_keys(daemon):
    """The benchmark's 256 committed keys in a real daemon: (scheduler client, namespace, keys)."""
    small, sched, ns, keys = lookup_setup(daemon.client_config(timeout_ms=10_000), "bench-test")
    yield sched, ns, keys
    small[4].close()
    sched.close()
    small[0].close()


def _sane_phase(r: dict, prefix: str) -> None:
    for stat in ("", "_cpu"):
        p50, p99 = r[f"{prefix}{stat}_p50_us"], r[f"{prefix}{stat}_p99_us"]
        assert 0 < p50 <= p99 < 10_000_000, (prefix, stat, p50, p99)
    hits = r[f"{prefix}_hits"]
    assert set(hits) == {"calls", "min", "max", "mean"} and hits["calls"] > 0, hits


def test_index_lookups_see_every_key_with_one_and_eight_schedulers(daemon, lookup_keys):
    sched, ns, keys = lookup_keys
    r = index_lookups(daemon.socket, sched, ns, keys, 40, daemon.proc.pid)
    for prefix in ("lookup256_1client", "lookup256_8clients"):
        _sane_phase(r, prefix)
        assert r[f"{prefix}_hits"]["min"] == r[f"{prefix}_hits"]["max"] == LOOKUP_KEYS, r
    assert r["lookup256_1client_hits"]["calls"] == 40
    assert r["lookup256_8clients_hits"]["calls"] == 8 * 20, "each of 8 timed its share"
    assert 0 <= r["lookup256_8clients_daemon_cpu_share"] < 2, r


def test_busy_lookups_time_the_index_while_a_writer_makes_the_daemon_evict(daemon, lookup_keys):
    sched, ns, keys = lookup_keys
    before = sched.info()
    r = busy_index_lookups(daemon.socket, sched, ns, keys, 40)
    _sane_phase(r, "lookup256_busy")
    assert r["lookup256_busy_hits"]["calls"] >= 40
    # The writer's namespace is capped: it evicts its own blocks, never the looked-up ones
    # (a read racing a removal may still miss one for a moment).
    assert r["lookup256_busy_hits"]["max"] == LOOKUP_KEYS, r
    churn = r["lookup256_busy_churn"]
    assert churn["evictions"] > 0 and churn["stored_blocks"] > 0, churn
    assert churn["writer_blocks"] > 0 and churn["writer_failed_jobs"] == 0, churn
    assert churn["writer_blocks_per_s"] > 0 and churn["timed_s"] > 0, churn
    assert sched.find(ns, keys)[0] == LOOKUP_KEYS, "the looked-up keys outlived the churn"
    assert sched.info().evictions - before.evictions >= churn["evictions"]


def test_round_trips_stay_measured_under_their_own_names(daemon, lookup_keys):
    sched, ns, keys = lookup_keys
    r = roundtrip_lookups(daemon.socket, sched, ns, keys, 40, daemon.proc.pid)
    for key in ("1client", "8clients"):
        p50, p99 = (r[f"roundtrip_lookup256_{key}_{q}_us"] for q in ("p50", "p99"))
        assert 0 < p50 <= p99, r
    assert r["roundtrip_lookup256_8clients_daemon_main_us"] > 0, r
    assert r["roundtrip_lookup256_8clients_daemon_bound_us"] == \
        8 * r["roundtrip_lookup256_8clients_daemon_main_us"]
    assert r["roundtrip_lookup256_8clients_mean_us"] > 0


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_both_connectors_run_the_same_load_and_are_timed_alike(daemon, tmp_path):
    pytest.importorskip("vllm")
    from bench.connector_methods import OTHER_METHODS, connector_figures

    r = connector_figures(8, 16, sock=daemon.socket, tmp=str(tmp_path))
    for arm in ("connector_methods", "vllm_connector_methods"):
        assert set(r[arm]) == {"Scheduler", "AsyncScheduler"}, r[arm].keys()
        for sched_name, ms in r[arm].items():
            for meth in ("get_num_new_matched_tokens", "update_state_after_alloc",
                         "build_connector_meta", "update_connector_output"):
                m = ms[meth]
                assert m["calls"] > 0 and 0 < m["p50_us"] <= m["p99_us"] <= m["max_us"], \
                    (arm, sched_name, meth, m)
            assert "on_new_request" in ms["_other"] and set(ms["_other"]) <= set(OTHER_METHODS)
            assert ms["_steps"] > 0
            assert ms["_loaded_requests"] == 8, (arm, sched_name, "every request loaded a hit")
    peer = r["vllm_connector_methods"]["AsyncScheduler"]
    assert peer["_loaded_blocks"] == 8 * 24, "the 384-token prefix came from its CPU cache"
    assert peer["_stored_blocks"] > 0
    assert r["vllm_connector"].startswith("OffloadingConnector")
    assert r["connector_vs_vllm_p99_ratio"] == \
        r["connector_method_p99_us"] / r["vllm_connector_method_p99_us"]
    assert r["build_connector_meta_p99_us"] <= r["connector_method_p99_us"]
    assert r["vllm_build_connector_meta_p99_us"] <= r["vllm_connector_method_p99_us"]
    assert set(r["connector_no_store_planning"]) == {"Scheduler", "AsyncScheduler"}


@pytest.mark.timeout(600)
def test_a_whole_run_writes_every_figure(tmp_path):
    """The benchmark as a script, tiny (no vLLM arm): its JSON has the new and the kept keys."""
    r = subprocess.run([sys.executable, "-m", "bench.control_plane", "--blocks", "4",
                        "--iters", "40", "--skip-connector", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (out,) = tmp_path.glob("control-plane-cpu-*.json")
    got = json.loads(out.read_text())
    for key in ("lookup256_1client_p99_us", "lookup256_8clients_p99_us", "lookup256_busy_p99_us",
                "lookup256_busy_churn", "roundtrip_lookup256_1client_p99_us",
                "roundtrip_lookup256_8clients_p99_us", "round_trip_cpu_us", "floor_p50_us",
                "reserve256_p99_us", "take_slots256_p99_us", "host_store_ratio",
                "load_average"):
        assert key in got, key
    assert got["lookup256_8clients_hits"]["min"] == LOOKUP_KEYS
    assert "lookup 256 keys in the index" in r.stdout and "busy daemon" in r.stdout
