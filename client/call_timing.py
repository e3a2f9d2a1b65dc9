"""Per-call latency of the connector's scheduler-side methods, for benchmarks.

``connector_timing=PATH`` (``ClientConfig``; ``KVPOOL_CONNECTOR_TIMING`` in the engine's
environment) makes ``KVPoolConnector`` time every call vLLM's scheduler makes into it and write
``PATH.<pid>.json`` at shutdown (and at exit): per method, the call count and p50/p99/max in
microseconds of wall time, and the p50/p99 of the thread's CPU time over the same calls (what
the method itself costs; the difference is time the thread was not running: preemption on a
busy host, waits for the GIL). With it, the scheduler side also logs each step that planned
stores (``PATH.<pid>.store_steps.jsonl``: wall time, tokens the step scheduled, blocks
planned), so a benchmark can tell the stores made while the engine computed from those made
while it was idle. Off by default: two clock reads of each kind per call are cheap,
but not free on the scheduler's thread.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from typing import Any, Callable, Iterable



def percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class CallTimer:
    def __init__(self, path: str) -> None:
        self.path = f"{path}.{os.getpid()}.json"
        self.samples: dict[str, list[int]] = {}
        self.cpu_samples: dict[str, list[int]] = {}
        self._base = path
        # Lines a timed call logged (line_log): written once its sample is taken, so the
        # log's I/O is not counted as the method's cost.
        self._lines: list[tuple[Any, tuple]] = []
        self._calls = 0              # timed calls running (nested ones included)
        atexit.register(self.dump)

    def wrap(self, obj: Any, names: Iterable[str]) -> None:
        """Replace ``obj``'s bound methods ``names`` by timed ones (on the instance)."""
        for name in names:
            fn = getattr(obj, name)
            bucket = self.samples.setdefault(name, [])
            cpu = self.cpu_samples.setdefault(name, [])

            @functools.wraps(fn)
            def timed(*args, __fn=fn, __bucket=bucket, __cpu=cpu, **kwargs):
                self._calls += 1
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                try:
                    return __fn(*args, **kwargs)
                finally:
                    __bucket.append(time.perf_counter_ns() - t0)
                    __cpu.append(time.thread_time_ns() - c0)
                    self._calls -= 1
                    if self._lines and not self._calls:
                        self._write_lines()

            setattr(obj, name, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, ns in self.samples.items():
            s = sorted(ns)
            c = sorted(self.cpu_samples.get(name, ()))
            out[name] = {"calls": len(s), "p50_us": percentile(s, 0.50) / 1e3,
                         "p99_us": percentile(s, 0.99) / 1e3, "max_us": (s[-1] if s else 0) / 1e3,
                         "cpu_p50_us": percentile(c, 0.50) / 1e3,
                         "cpu_p99_us": percentile(c, 0.99) / 1e3}
        return out

    def dump(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"pid": os.getpid(), "methods": self.summary(),
                       "samples_us": {k: [v / 1e3 for v in ns] for k, ns in self.samples.items()}},
                      f)

    def line_log(self, name: str) -> Callable[..., None]:
        """A function writing its arguments as one JSON list per line to
        ``PATH.<pid>.<name>.jsonl``, flushed as soon as the timed call that logged it returns
        (outside its sample): unlike the dump, it survives a process killed at shutdown (vLLM
        kills an engine core that is slow to stop)."""
        f = open(f"{self._base}.{os.getpid()}.{name}.jsonl", "a", buffering=1)
        atexit.register(f.close)

        def write(*values: Any) -> None:
            self._lines.append((f, values))
            if not self._calls:
                self._write_lines()
        return write

    def _write_lines(self) -> None:
        lines, self._lines = self._lines, []
        for f, values in lines:
            f.write(json.dumps(values) + "\n")


def maybe_time(obj: Any, names: Iterable[str], path: str) -> CallTimer | None:
    """Time ``obj``'s methods ``names`` into ``path`` (``ClientConfig.connector_timing``);
    None when that is empty."""
    if not path:
        return None
    timer = CallTimer(path)
    timer.wrap(obj, names)
    return timer
