"""A hybrid model (gated-delta-net state groups beside full attention) in vLLM's real CPU engine:
first proof that its output depends on its recurrent state, then kvpool serving it without one
wrong logprob.

The model is ``bench.vllm_engine.hybrid_model``'s tiny Qwen3-Next (256-token blocks,
``mamba_cache_mode="align"``, bfloat16). A test of identical outputs proves nothing unless a
wrong state would change them; ``test_the_output_depends_on_the_recurrent_state`` shows that it
does: a prefix-cache hit whose cached state was zeroed answers differently.
"""

from __future__ import annotations

import subprocess

import pytest

from bench.vllm_engine.hybrid_model import HYBRID_BLOCK
from bench.vllm_engine.runner import ROOT
from tests.engine.conftest import BaselineRun, assert_same_outputs, prompts

pytestmark = pytest.mark.timeout(900)

P = prompts(4, seed=21, tokens=3 * HYBRID_BLOCK + 40)
MAX_TOKENS = 6
# A zeroed state moves the test model's next logprobs by ~1; a right one by bfloat16 noise.
STATE_EFFECT = 0.05
HYBRID = {"init": "hybrid", "load_format": "dummy", "dtype": "bfloat16"}


def gen(ps=P, **kw):
    return {"op": "generate", "prompts": ps, "max_tokens": MAX_TOKENS, **kw}


@pytest.fixture(scope="module")
def hybrid_model(engine_python, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("engine-model") / "tiny-qwen3-next"
    subprocess.run([engine_python, "-m", "bench.vllm_engine.hybrid_model", str(path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    return str(path)


@pytest.fixture(scope="module")
def hybrid_baseline(engine_python, hybrid_model, tmp_path_factory):
    """The hybrid engine without kvpool, in process (so it can zero its cached states): P
    computed, P again (its own prefix cache hits), the cached states zeroed, P again. Started
    when the first test asks for it and read when a test needs it, so it starts up beside the
    tests' own engines."""
    from bench.vllm_engine.runner import Engine

    steps = [gen(), gen(), {"op": "zero_states"}, gen()]
    e = Engine(engine_python, {"model": hybrid_model, "socket": None, "inprocess": True,
                               **HYBRID, "steps": steps},
               tmp_path_factory.mktemp("hybrid-baseline"), "hybrid-baseline")
    run = _Steps(e, len(steps))
    yield run
    run.close()


class _Steps(BaselineRun):
    """A ``BaselineRun`` whose engine runs several steps: ``outputs()`` is the first one's,
    ``steps()`` all of them."""

    def __init__(self, engine, n: int) -> None:
        super().__init__(engine)
        self._n = n
        self._steps: list[dict] | None = None

    def steps(self) -> list[dict]:
        if self._steps is None:
            e = self._engine
            try:
                e.wait_ready()
                self._steps = [e.next() for _ in range(self._n)]
                e.finish()
            finally:
                e.close()
        return self._steps

    def outputs(self) -> dict:
        return self.steps()[0]


def worst_logprob_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"])
               for x, y in zip(la, lb))


def test_the_output_depends_on_the_recurrent_state(hybrid_baseline):
    first, again, zeroed, after = hybrid_baseline.steps()
    full = (len(P[0]) - 1) // HYBRID_BLOCK * HYBRID_BLOCK
    assert first["cached_tokens"] == [0] * len(P), first["cached_tokens"]
    # vLLM's own prefix cache: attention blocks and the state at their end; same output.
    assert again["cached_tokens"] == [full] * len(P), again["cached_tokens"]
    assert_same_outputs(again, first, "the engine's own prefix-cache hit")
    assert zeroed["blocks"] > 0, "no cached recurrent state to zero"
    # The same hit, resumed from zeroed states: the output moves (what a cache that restores
    # attention without the state would produce).
    assert after["cached_tokens"] == [full] * len(P), after["cached_tokens"]
    gap = worst_logprob_gap(after, first)
    assert gap > STATE_EFFECT, \
        f"zeroing the cached states moved the logprobs by only {gap:.2e}: the test model's " \
        f"output does not depend on its recurrent state, so no test on it can catch a bad one"
