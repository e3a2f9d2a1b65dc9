"""Fixtures the vLLM connector suites share: a model folder, engines on the test's daemon and an
observer of that daemon. vLLM is imported only when an engine is made, so suites that skip
without vLLM collect without it."""

from __future__ import annotations

import pytest

from kvpool.client.scheduler import SchedulerClient


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-model")


@pytest.fixture
def info(daemon):
    """An observer of the test's daemon (``SchedulerClient.info``)."""
    c = SchedulerClient(daemon.client_config(), name="test observer")
    yield c
    c.close()


@pytest.fixture
def make_engine(model_root, daemon):
    """``make(**kw)``: a harness ``Engine`` on the test's daemon (``socket=`` another one)."""
    from bench.vllm_scheduler import Engine

    made: list[Engine] = []

    def make(**kw) -> Engine:
        kw.setdefault("engine_id", f"engine-{len(made)}")
        e = Engine(model_root, kw.pop("socket", daemon.socket), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
