"""GPU tests: every test here is marked ``gpu`` and skipped cleanly where CUDA is missing."""

from __future__ import annotations

import pytest

from tests.gpu.gpu_worker import gpu_count

GPUS = gpu_count()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if GPUS == 0:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
