"""bench/gpu_worker.py's start_workers, on CPU (host-memory workers, device -1): the
benchmarks' workers start together, and one that fails takes the others down with it."""

from __future__ import annotations

import time

import pytest

from bench.gpu_worker import start_workers


def test_workers_start_together_and_each_answers():
    ws = start_workers([(-1, "block_outer", 4), (-1, "per_layer", 4, 2)])
    try:
        assert [w.layout for w in ws] == ["block_outer", "per_layer"]
        assert [w.tp_size for w in ws] == [1, 2]
        for w in ws:
            w.call("fill", 3)
            assert len(w.call("blocks", [0, 1])) == 2
    finally:
        for w in ws:
            w.close()


def test_one_worker_that_fails_to_start_closes_the_others(monkeypatch):
    """A worker that dies starting (here: a layout it does not know) is an error at once, not
    a 120 s wait, and the workers started beside it are closed."""
    import bench.gpu_worker as gw
    started = []

    class Recorded(gw.Worker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(gw, "Worker", Recorded)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited while starting"):
        start_workers([(-1, "block_outer", 4), (-1, "no-such-layout", 4)])
    assert time.monotonic() - t0 < 60, "a dead worker was waited for"
    assert len(started) == 1
    started[0].proc.join(30)
    assert not started[0].proc.is_alive(), "the worker that started was left running"
