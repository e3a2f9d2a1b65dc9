import os

import pytest

from kvpool.shared.config import (ClientConfig, ConnectorConfig, DaemonConfig, build_config,
                                  config_file_variable, connector_config, env_layer,
                                  known_variables, parse_size, toml_layer, unknown_variables)
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


def test_default_socket_and_pool_per_user(monkeypatch, tmp_path):
    """Root and the systemd unit's user serve /run/kvpool with the pool "kvpool"; anyone else
    their own /tmp/kvpool-UID and kvpool-UID, whatever another user left in /run/kvpool. A
    client goes to /run/kvpool when its socket lets it in, unless it has a daemon of its own."""
    from kvpool.shared import config as cfg
    system = tmp_path / "run-kvpool"
    system.mkdir()
    monkeypatch.setattr(cfg, "SYSTEM_SOCKET_DIR", str(system))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    writable: set[str] = set()
    monkeypatch.setattr(cfg.os, "access", lambda path, mode: str(path) in writable)
    monkeypatch.setattr(cfg.os, "geteuid", lambda: 0)
    assert DaemonConfig().socket_path == f"{system}/kvpoold.sock"
    assert DaemonConfig().pool == "kvpool"
    monkeypatch.setattr(cfg.os, "geteuid", lambda: 4321)
    own = "/tmp/kvpool-4321/kvpoold.sock"
    assert (DaemonConfig().socket_path, ClientConfig().socket_path) == (own, own)
    assert DaemonConfig().pool == "kvpool-4321"
    writable.add(f"{system}/kvpoold.sock")          # a group member, while the unit serves
    assert (DaemonConfig().socket_path, ClientConfig().socket_path) == (own, f"{system}/"
                                                                         "kvpoold.sock")
    writable.add(str(system))                        # the unit's own user
    assert DaemonConfig().socket_path == f"{system}/kvpoold.sock"
    assert DaemonConfig().pool == "kvpool"
    assert DaemonConfig(pool_name="mine").pool == "mine"


@pytest.mark.parametrize("layer,message", [
    ({"pool_sise": "1GiB"}, "unknown setting 'pool_sise' (did you mean 'pool_size'?)"),
    ({"lease_ttl_s": -1}, "invalid setting lease_ttl_s=-1: expected a number above 0, at most "
                          "3600"),
    ({"peer_timeout_ms": "5"}, "peer_timeout_ms='5': expected a whole number from 100 to 600000"),
    ({"cuda": "maybe"}, "cuda='maybe': expected one of auto, off, on"),
    ({"socket_mode": "0999"}, "socket_mode='0999': expected an octal file mode such as 0600"),
    ({"pool_size": "lots"}, "pool_size='lots': expected a size such as 64GiB, 512MiB or a number "
                            "of bytes, or auto"),
    ({"namespace_quota": "auto"}, "namespace_quota='auto': expected a size such as 20GiB"),
    ({"keep_pool": "perhaps"}, "keep_pool='perhaps': expected true or false"),
    ({"allow_uid": "a b"}, "allow_uid='a b': expected names or numbers separated by commas"),
    ({"events_topic": "x" * 300}, "events_topic='xxxxx"),
])
def test_a_bad_setting_says_which_form_it_takes_not_a_regex(layer, message):
    with pytest.raises(ConfigError) as e:
        build_config(DaemonConfig, layer)
    assert message in e.value.message and "regex" not in e.value.message and "^" not in \
        e.value.message, e.value.message
    assert len(e.value.message) < 200


def test_every_client_and_connector_key_is_a_variable_and_the_extra_config_wins():
    env = {"KVPOOL_MODEL_ID": "m@1", "KVPOOL_QUOTA": "2GiB", "KVPOOL_PD_WAIT_S": "1.5",
           "KVPOOL_PD_STREAM": "false", "KVPOOL_PD_HANDOFF": "true",
           "KVPOOL_LOAD_FAILURE_POLICY": "fail", "KVPOOL_TIMEOUT_MS": "700"}
    client, conn = connector_config({}, env)
    assert conn == ConnectorConfig(model_id="m@1", quota="2GiB", pd_stream=False,
                                   pd_handoff=True, load_failure_policy="fail")
    assert (client.timeout_ms, client.pd_wait_s) == (700, 1.5)
    client, conn = connector_config({"pd_wait_s": 4, "timeout_ms": 900, "model_id": "x"}, env)
    assert (client.pd_wait_s, client.timeout_ms, conn.model_id, conn.quota) == (4.0, 900, "x",
                                                                                 "2GiB")
    assert connector_config({}, {})[1].pd_stream is None      # follows load_failure_policy
    every = {f"KVPOOL_{k.upper()}" for k in ClientConfig.__struct_fields__
             + ConnectorConfig.__struct_fields__}
    assert every <= known_variables()


@pytest.mark.parametrize("extra,message", [
    ({"pd_wait": 3}, "unknown kv_connector_extra_config key 'pd_wait' for KVPoolConnector (did "
                     "you mean 'pd_wait_s'?)"),
    ({"pd_stream": "maybe"}, "pd_stream='maybe': expected true or false"),
    ({"load_failure_policy": "retry"}, "expected one of fail, recompute"),
    ({"quota": "lots"}, "quota='lots': expected a size"),
])
def test_bad_connector_keys_name_the_key_and_the_form(extra, message):
    with pytest.raises(ConfigError) as e:
        connector_config(extra, {})
    assert message in e.value.message, e.value.message


def test_an_unknown_variable_is_reported_with_the_closest_known_one():
    env = {"KVPOOL_POOL_SISE": "1GiB", "KVPOOL_PD_WAIT": "2", "KVPOOL_SOCKET": "/x",
           "KVPOOL_CONFIGFILE": "a.toml", "KVPOOL_ZZZ": "1", "OTHER": "1"}
    assert unknown_variables(env) == [
        "KVPOOL_CONFIGFILE is not a kvpool setting (did you mean KVPOOL_CONFIG?): ignored",
        "KVPOOL_PD_WAIT is not a kvpool setting (did you mean KVPOOL_PD_WAIT_S?): ignored",
        "KVPOOL_POOL_SISE is not a kvpool setting (did you mean KVPOOL_POOL_SIZE?): ignored",
        "KVPOOL_ZZZ is not a kvpool setting: ignored"]
    assert unknown_variables({"KVPOOL_SKIP_ENGINE": "1", "KVPOOL_CONFIG": "a"}) == []


def test_the_config_file_variable_and_its_deprecated_spelling():
    assert config_file_variable({"KVPOOL_CONFIG": "a.toml"}) == ("a.toml", [])
    path, notes = config_file_variable({"KVPOOL_CONFIG_FILE": "b.toml"})
    assert path == "b.toml" and "deprecated" in notes[0] and "KVPOOL_CONFIG " in notes[0]
    path, notes = config_file_variable({"KVPOOL_CONFIG": "a.toml", "KVPOOL_CONFIG_FILE": "b"})
    assert path == "a.toml" and "KVPOOL_CONFIG_FILE is ignored" in notes[0]
    assert config_file_variable({}) == (None, [])


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
