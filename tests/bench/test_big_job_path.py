"""bench/investigations/big_job_path.py runs the daemon's dispatch in process, warm and with a
cold start set before each job (no GPU)."""

from __future__ import annotations

from bench.investigations.big_job_path import run

HOPS = {"store_decode", "store_to_submit", "store_landed", "store_job_done", "store_done_to_sent",
        "load_decode", "load_to_submit", "load_job_done", "load_done_to_sent"}


def test_it_times_every_hop_of_a_store_and_a_load_warm_and_after_a_cold_start():
    for idle_s, flush_mib in ((0.0, 0), (0.002, 4)):
        us = run(512, 4, idle_s, flush_mib)
        assert HOPS <= us.keys(), sorted(us)
        assert all(v > 0 for v in us.values()), us
