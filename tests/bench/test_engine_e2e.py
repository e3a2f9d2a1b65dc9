"""engine_e2e's accounting: stores made while the engine computed and while it was idle, and
the CPU seconds of an engine's processes."""

import json
import os
import signal
import subprocess
import sys

from bench.engine_e2e import busy_stores
from bench.vllm_engine.runner import process_cpu_s, session_cpu_s


def test_steps_are_split_by_what_they_computed_and_attributed_to_the_window_holding_them(
        tmp_path):
    # Two engines' step logs (one per engine-core process), as the connector writes them.
    def log(name, steps):
        (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in steps))
    log("timing-x.101.store_steps.jsonl", [[10.0, 2048, 16], [11.0, 0, 4], [20.5, 512, 2]])
    log("timing-x.102.store_steps.jsonl", [[21.0, 0, 8], [30.0, 1024, 1]])
    log("timing-y.103.store_steps.jsonl", [[10.5, 2048, 99]])       # another arm's: not read
    (tmp_path / "timing-x.101.json").write_text("{}")             # the latencies: not read
    arm = {"multiturn": {"stored_bytes": 1, "window_s": [9.0, 12.0]},
           "no_repeat": {"stored_bytes": 1, "window_s": [20.0, 22.0]},
           "shared": {"stored_bytes": 1, "window_s": [40.0, 41.0]},
           "daemon": [{"stored_blocks": 3}]}
    busy_stores(str(tmp_path / "timing-x"), arm, block_bytes=100)
    assert (arm["multiturn"]["busy_stored_bytes"], arm["multiturn"]["idle_stored_bytes"]) \
        == (1600, 400)
    assert (arm["no_repeat"]["busy_stored_bytes"], arm["no_repeat"]["idle_stored_bytes"]) \
        == (200, 800)
    assert (arm["shared"]["busy_stored_bytes"], arm["shared"]["idle_stored_bytes"]) == (0, 0)
    assert arm["daemon"] == [{"stored_blocks": 3}]


def test_a_sessions_cpu_seconds_count_its_children_and_grow_only_while_they_compute():
    # A driver-like process (its own session) whose child burns CPU, then sleeps.
    burn = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\n"
            "print(1, flush=True)\\ntime.sleep(60)'])")
    proc = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "1"     # the child burned its 0.3 s
        used = session_cpu_s(proc.pid)
        assert used >= 0.25, f"{used} CPU s counted for a child that burned 0.3 s"
        assert process_cpu_s(proc.pid) < 0.25, "the parent alone burned nothing"
        assert session_cpu_s(proc.pid) - used < 0.1, "sleeping processes gained CPU time"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    assert process_cpu_s(proc.pid) == 0.0
