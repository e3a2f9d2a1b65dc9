import os

import pytest

from kvpool.shared.config import (ClientConfig, DaemonConfig, build_config, env_layer,
                                  parse_size, toml_layer)
from kvpool.shared.errors import ConfigError


@pytest.mark.parametrize("text,expected", [("64GiB", 64 << 30), ("512MiB", 512 << 20),
                                           ("1048576", 1 << 20), ("1.5GB", 1_500_000_000),
                                           ("4k", 4000), ("2 MiB", 2 << 20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "-1", "12XB", "GiB"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(bad)


def test_layers_merge_in_order_and_the_result_is_frozen(tmp_path):
    f = tmp_path / "kvpool.toml"
    f.write_text('pool_size = "1GiB"\nlease_ttl_s = 5\nkeep_pool = true\n')
    cfg = build_config(DaemonConfig, toml_layer(f), env_layer(DaemonConfig, {
        "KVPOOL_LEASE_TTL_S": "7", "UNRELATED": "x"}), {"pool_size": "2GiB", "socket": None})
    assert (cfg.pool_size, cfg.lease_ttl_s, cfg.keep_pool) == ("2GiB", 7.0, True)
    with pytest.raises(AttributeError):
        cfg.pool_size = "1"   # type: ignore[misc]


@pytest.mark.parametrize("layer,key", [({"pool_sise": "1GiB"}, "pool_sise"),
                                       ({"lease_ttl_s": -1}, "lease_ttl_s"),
                                       ({"cuda": "maybe"}, "cuda"),
                                       ({"socket_mode": "0999"}, "socket_mode"),
                                       ({"pool_size": "lots"}, "pool_size")])
def test_bad_settings_name_the_key(layer, key):
    with pytest.raises(ConfigError, match=key):
        build_config(DaemonConfig, layer)


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        toml_layer(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("pool_size = [")
    with pytest.raises(ConfigError, match="bad.toml"):
        toml_layer(bad)


def test_default_socket_path_follows_xdg_runtime_dir(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert ClientConfig().socket_path == "/run/user/1000/kvpool/kvpoold.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert DaemonConfig().socket_path in ("/run/kvpool/kvpoold.sock",
                                          f"/tmp/kvpool-{os.geteuid()}/kvpoold.sock")


def test_store_policy_and_min_prefix_default_to_storing_everything_at_once():
    cfg = ClientConfig()
    assert (cfg.store_policy, cfg.store_min_prefix_tokens) == ("eager", 0)


def test_store_settings_come_from_env_and_the_extra_config_wins():
    env = env_layer(ClientConfig, {"KVPOOL_STORE_POLICY": "lazy",
                                   "KVPOOL_STORE_MIN_PREFIX_TOKENS": "256"})
    assert env == {"store_policy": "lazy", "store_min_prefix_tokens": "256"}
    cfg = build_config(ClientConfig, env)
    assert (cfg.store_policy, cfg.store_min_prefix_tokens) == ("lazy", 256)
    cfg = build_config(ClientConfig, env, {"store_policy": "eager", "store_min_prefix_tokens": 0})
    assert (cfg.store_policy, cfg.store_min_prefix_tokens) == ("eager", 0)


@pytest.mark.parametrize("layer,key", [({"store_policy": "sometimes"}, "store_policy"),
                                       ({"store_policy": "Lazy"}, "store_policy"),
                                       ({"store_min_prefix_tokens": -1}, "store_min_prefix_tokens"),
                                       ({"store_min_prefix_tokens": 1 << 25},
                                        "store_min_prefix_tokens"),
                                       ({"store_min_prefix_tokens": "many"},
                                        "store_min_prefix_tokens")])
def test_bad_store_settings_name_the_key(layer, key):
    with pytest.raises(ConfigError, match=key):
        build_config(ClientConfig, layer)
