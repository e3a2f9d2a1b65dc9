"""CallTimer: the per-call latencies and the extra figures a benchmark reads back."""

import atexit
import json
from pathlib import Path

from kvpool.client.call_timing import CallTimer, maybe_time, percentile


class Methods:
    def __init__(self) -> None:
        self.calls = 0

    def step(self, n: int) -> int:
        self.calls += 1
        return n * 2


def test_wrapped_methods_still_answer_and_every_call_is_counted_in_the_dump(tmp_path):
    obj = Methods()
    timer = maybe_time(obj, ["step"], str(tmp_path / "timing"))
    assert isinstance(timer, CallTimer)
    atexit.unregister(timer.dump)
    assert [obj.step(i) for i in range(5)] == [0, 2, 4, 6, 8]
    log = [(1.0, 2048, 16)]
    timer.extras["store_steps"] = lambda: log
    log.append((2.0, 0, 3))      # read at dump time, not when registered
    timer.dump()
    out = json.loads(Path(timer.path).read_text())
    assert out["methods"]["step"]["calls"] == 5 and len(out["samples_us"]["step"]) == 5
    assert out["store_steps"] == [[1.0, 2048, 16], [2.0, 0, 3]]


def test_no_path_times_nothing():
    obj = Methods()
    assert maybe_time(obj, ["step"], "") is None
    assert obj.step.__func__ is Methods.step


def test_percentile_of_an_empty_list_is_zero_and_clamps_at_the_top():
    assert percentile([], 0.99) == 0
    assert percentile([1, 2, 3], 1.0) == 3
