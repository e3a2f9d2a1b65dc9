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
    timer.dump()
    out = json.loads(Path(timer.path).read_text())
    assert out["methods"]["step"]["calls"] == 5 and len(out["samples_us"]["step"]) == 5


def test_a_line_log_is_on_disk_line_by_line_before_any_dump(tmp_path):
    timer = CallTimer(str(tmp_path / "timing"))
    atexit.unregister(timer.dump)
    write = timer.line_log("store_steps")
    write(1.0, 2048, 16)
    write(2.0, 0, 3)
    [path] = tmp_path.glob("timing.*.store_steps.jsonl")
    assert [json.loads(x) for x in path.read_text().splitlines()] == [[1.0, 2048, 16],
                                                                       [2.0, 0, 3]]


def test_no_path_times_nothing():
    obj = Methods()
    assert maybe_time(obj, ["step"], "") is None
    assert obj.step.__func__ is Methods.step


def test_percentile_of_an_empty_list_is_zero_and_clamps_at_the_top():
    assert percentile([], 0.99) == 0
    assert percentile([1, 2, 3], 1.0) == 3


def test_a_line_logged_inside_a_timed_call_is_written_after_its_sample(tmp_path):
    timer = CallTimer(str(tmp_path / "timing"))
    atexit.unregister(timer.dump)
    write = timer.line_log("store_steps")
    seen_inside = []

    class Planner:
        def step(self) -> None:
            write(3.0, 512, 2)
            seen_inside.append(path().read_text())

    def path() -> Path:
        return next(tmp_path.glob("timing.*.store_steps.jsonl"))

    obj = Planner()
    timer.wrap(obj, ["step"])
    obj.step()
    assert seen_inside == [""], "the log was written inside the timed call"
    assert [json.loads(x) for x in path().read_text().splitlines()] == [[3.0, 512, 2]]
    assert timer.summary()["step"]["calls"] == 1
