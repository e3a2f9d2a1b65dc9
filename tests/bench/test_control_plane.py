"""bench/control_plane.py's CPU accounting per thread, which ``round_trip_cpu_us`` is read from:
each thread's time goes to the right side (main, ZeroMQ I/O, other), and a round trip against
a real daemon shows CPU on both sides."""

from __future__ import annotations

import os
import threading
import time

import zmq

from bench.control_plane import cpu_by_thread, echo_round_trip_cpu, round_trip_cpu
from kvpool.client.scheduler import SchedulerClient


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
