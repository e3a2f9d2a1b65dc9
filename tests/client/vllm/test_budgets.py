"""The scheduler side's budgets: one object, set from ClientConfig (extra config keys and
KVPOOL_* variables), bounded, with store_wait_s its own setting."""

from __future__ import annotations

import time

import pytest

from kvpool.client.vllm.budgets import Budgets
from kvpool.shared.config import ClientConfig, build_config, env_layer
from kvpool.shared.errors import ConfigError


def test_defaults_and_units():
    b = Budgets.from_config()
    assert (b.plan_s, b.step_s, b.overdue_s, b.pressure_s) == (100e-6, 150e-6, 50e-6, 1e-3)
    assert (b.overdue_after_s, b.store_wait_s, b.lookup_stale_s, b.pd_wait_s) == \
        (0.5, 2.0, 0.25, 3.0)
    assert (b.backoff_s, b.backoff_max_s, b.report_interval_s) == (0.2, 5.0, 10.0)
    assert b.clock is time.monotonic


def test_every_budget_has_a_variable_and_the_extra_config_wins():
    env = {"KVPOOL_STORE_PLAN_BUDGET_US": "250", "KVPOOL_STORE_STEP_BUDGET_US": "300",
           "KVPOOL_STORE_OVERDUE_AFTER_S": "1.5", "KVPOOL_STORE_OVERDUE_BUDGET_US": "70",
           "KVPOOL_STORE_PRESSURE_BUDGET_US": "2000", "KVPOOL_STORE_WAIT_S": "7",
           "KVPOOL_LOOKUP_STALE_S": "0.5", "KVPOOL_PD_WAIT_S": "9",
           "KVPOOL_UNSTORED_REPORT_S": "30"}
    config = build_config(ClientConfig, env_layer(ClientConfig, env), {"pd_wait_s": 4})
    clock = lambda: 5.0  # noqa: E731
    b = Budgets.from_config(config, clock)
    assert (b.plan_s, b.step_s, b.overdue_after_s, b.overdue_s, b.pressure_s) == \
        (250e-6, 300e-6, 1.5, 70e-6, 2e-3)
    assert (b.store_wait_s, b.lookup_stale_s, b.pd_wait_s, b.report_interval_s) == \
        (7.0, 0.5, 4.0, 30.0)
    assert b.clock is clock


def test_store_wait_is_its_own_setting_not_the_request_timeout():
    b = Budgets.from_config(ClientConfig(timeout_ms=9000))
    assert b.store_wait_s == 2.0
    assert Budgets.from_config(ClientConfig(timeout_ms=9000, store_wait_s=0.5)).store_wait_s == 0.5


@pytest.mark.parametrize("key, value", [("store_plan_budget_us", -1),
                                        ("store_plan_budget_us", 2_000_000),
                                        ("store_wait_s", -0.1), ("pd_wait_s", 4000),
                                        ("unstored_report_s", 0), ("lookup_stale_s", "soon")])
def test_a_budget_out_of_bounds_is_a_config_error_naming_it(key, value):
    with pytest.raises(ConfigError, match=key):
        build_config(ClientConfig, {key: value})
