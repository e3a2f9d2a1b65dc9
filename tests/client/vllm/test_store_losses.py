"""StoreLosses: unstored blocks counted by reason, for vLLM's stats and one warning per interval."""

import logging

import pytest

from kvpool.client.vllm.store_losses import REASONS, StoreLosses


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def warnings(caplog) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    return out


def test_counts_by_reason_in_all_and_per_stats_interval():
    losses = StoreLosses(clock=Clock())
    losses.add("store_wait", 3)
    losses.add("preempted", 2)
    losses.add("store_wait", 0)          # nothing lost: nothing counted
    assert losses.take_interval() == {"store_wait": 3, "preempted": 2}
    assert losses.take_interval() == {}
    losses.add("reserve_refused", 4)
    assert losses.take_interval() == {"reserve_refused": 4}
    assert losses.totals == {**dict.fromkeys(REASONS, 0), "store_wait": 3, "preempted": 2,
                             "reserve_refused": 4}
    assert losses.total == 9


def test_an_unknown_reason_is_refused():
    with pytest.raises(ValueError, match="unknown reason"):
        StoreLosses().add("no_room", 1)


def test_one_warning_per_interval_names_every_count_since_the_last(caplog):
    caplog.set_level(logging.WARNING, logger="kvpool.vllm")
    clock = Clock()
    losses = StoreLosses(interval_s=10.0, clock=clock)
    losses.add("store_wait", 2)
    [first] = warnings(caplog)
    assert "2 because a finished request waited store_wait_s" in first
    for _ in range(50):                  # an overload: losses every step
        clock.now += 0.1
        losses.add("daemon_unavailable", 1)
        losses.maybe_log()
    assert warnings(caplog) == []
    clock.now += 5.01                    # 10 s since the first warning
    losses.maybe_log()
    [second] = warnings(caplog)
    assert "50 because kvpoold was unreachable (daemon_unavailable)" in second
    assert "store_wait" not in second


def test_what_is_left_is_logged_at_shutdown(caplog):
    caplog.set_level(logging.WARNING, logger="kvpool.vllm")
    losses = StoreLosses(interval_s=10.0, clock=Clock())
    losses.add("store_failed", 1)
    losses.add("store_failed", 6)        # within the interval: held back
    assert len(warnings(caplog)) == 1
    losses.maybe_log(final=True)
    [last] = warnings(caplog)
    assert "6 because a worker's store job failed (store_failed)" in last
    losses.maybe_log(final=True)         # nothing left: no line
    assert warnings(caplog) == []
