"""The engine shapes every connector suite runs under: vLLM's two schedulers, and step speeds
from an engine with nothing to compute (it steps as fast as it can) to a slow GPU step."""

import pytest

SCHEDULERS = [pytest.param(False, id="Scheduler"), pytest.param(True, id="AsyncScheduler")]
STEP_SPEEDS = [pytest.param(0.0, id="empty-steps"), pytest.param(0.005, id="5ms-steps"),
               pytest.param(0.05, id="50ms-steps")]
