"""GPU tests: every test here is marked ``gpu`` and skipped cleanly where CUDA is missing."""

from __future__ import annotations

import time

import pytest

from bench.gpu_worker import ShmPool, gpu_count

GPUS = gpu_count()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if GPUS == 0:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


# The copy engine driven directly (no daemon), one per test module, over a pool of its own.

@pytest.fixture(scope="module")
def pool():
    p = ShmPool(512 << 20, name=f"kvpool-gputest-engine-{time.monotonic_ns()}")
    yield p
    p.close()


@pytest.fixture(scope="module")
def engine(pool):
    from kvpool.daemon.cuda_copy import CudaCopyEngine
    eng = CudaCopyEngine(pool, register_piece_bytes=64 << 20)   # several pieces: split path
    assert eng.registration.wait(60), "pool registration did not finish"
    assert eng.registration.is_complete, eng.registration.error
    eng._require_ready()
    eng._check_pitched(0)      # settle it now: tests force it either way
    eng.pitched_checked = eng.pitched
    yield eng
    eng.close()
