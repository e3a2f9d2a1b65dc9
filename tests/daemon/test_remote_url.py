"""The remote_store URL: what each part means, its defaults, and a clear error for each mistake."""

import pytest

from kvpool.daemon.remote_url import RemoteUrl, parse_remote_url, resolve_local
from kvpool.shared.errors import ConfigError


def test_defaults_point_at_the_masters_own_metadata_server():
    u = parse_remote_url("mooncake://master.example:50051")
    assert u == RemoteUrl("master.example", 50051, "http://master.example:8080/metadata", "tcp",
                          "", "")
    assert u.master == "master.example:50051" and u.display() == "mooncake://master.example:50051"


def test_every_query_key():
    u = parse_remote_url("mooncake://10.0.0.5:6000?metadata=http://meta:9000/metadata"
                         "&protocol=rdma&device=mlx5_0,mlx5_1&local=10.0.0.7")
    assert (u.metadata, u.protocol, u.device, u.local_host) == (
        "http://meta:9000/metadata", "rdma", "mlx5_0,mlx5_1", "10.0.0.7")
    assert parse_remote_url("mooncake://m:1?metadata=P2PHANDSHAKE").metadata == "P2PHANDSHAKE"


def test_ipv6_master():
    u = parse_remote_url("mooncake://[fd00::1]:50051")
    assert u.master_host == "fd00::1" and u.master == "[fd00::1]:50051"
    assert u.metadata == "http://[fd00::1]:8080/metadata"


@pytest.mark.parametrize("url, says", [
    ("", "the scheme must be mooncake://"),
    ("mooncake://:50051", "no master host"),
    ("mooncake://m:99999", "Port out of range"),
    ("mooncake://m:50051/path", "only host, port and query"),
    ("mooncake://user@m:50051", "only host, port and query"),
    ("mooncake://m:50051?protocol=tcp&protocol=rdma", "given twice"),
    ("mooncake://m:50051?protocol=rdma&device=bad%20name", "not a device name"),
    ("mooncake://m:50051?local=bad%20host", "local must be this host's address"),
    ("mooncake://m:50051?metadata=http:///x", "metadata must be an http:// URL"),
])
def test_mistakes_are_named(url, says):
    with pytest.raises(ConfigError) as e:
        parse_remote_url(url)
    assert says in e.value.message and "remote_store" in e.value.message


def test_local_address_is_the_route_to_the_master():
    u = resolve_local(parse_remote_url("mooncake://127.0.0.1:50051"))
    assert u.local_host == "127.0.0.1"
    given = resolve_local(parse_remote_url("mooncake://127.0.0.1:50051?local=10.1.2.3"))
    assert given.local_host == "10.1.2.3"


def test_unresolvable_master():
    with pytest.raises(ConfigError, match="does not resolve"):
        resolve_local(parse_remote_url("mooncake://no-such-host.invalid:50051"))
