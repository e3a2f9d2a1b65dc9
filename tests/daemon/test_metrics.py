"""daemon/metrics.py over a real HTTP server on an ephemeral loopback port."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.daemon.metrics import Metrics, MetricsServer, start_metrics_server
from kvpool.shared.errors import ConfigError, ErrorCode
from kvpool.shared.protocol import ClientInfo, NamespaceInfo, PoolInfo, Role
from tests.daemon.httptest import fetch


def make_info(**over) -> PoolInfo:
    fields = dict(
        daemon_id="d-1", uptime_s=12.5, pool_bytes=1 << 30, used_bytes=3 << 20,
        free_bytes=(1 << 30) - (3 << 20), slots_writing=1, slots_committed=2, namespaces=1,
        hit_blocks=10, miss_blocks=5, evictions=0, leases=1, stored_blocks=3, loaded_blocks=2,
        stored_bytes=6 << 20, loaded_bytes=4 << 20, errors=0,
        clients=[ClientInfo(1, Role.SCHEDULER, "sched", 10, "engA", 0, 1, 0),
                 ClientInfo(2, Role.WORKER, "tp0", 11, "engA", 1, 0, 0),
                 ClientInfo(3, Role.WORKER, "tp0", 12, "engB", 1, 0, 0)],
        adopted_blocks=7, slots_pinned=1, slots_reserved=900, no_room_blocks=3,
        namespace_usage=[NamespaceInfo(b"\x01" * 16, "m", 1, 2, 2 << 20, 8 << 20)])
    fields.update(over)
    return PoolInfo(**fields)




def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def served():
    metrics = Metrics(stale_after_s=5.0)
    server = MetricsServer(metrics, "127.0.0.1", 0)
    yield metrics, server
    server.close()


def test_every_name_follows_the_naming_rule():
    text = Metrics().render().decode()
    names = {fam.name for fam in text_string_to_metric_families(text)}
    assert names, text
    for fam in text_string_to_metric_families(text):
        assert re.fullmatch(r"kvpool_[a-z_]+", fam.name), fam.name
        if fam.type == "counter":
            # the parser strips _total from counter family names; the samples carry it
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name


def test_metrics_and_gauges_from_info(served):
    metrics, server = served
    metrics.update_from_info(make_info())
    metrics.observe_lookup(requests=2, hit_blocks=10, miss_blocks=5, hit_tokens=160,
                           miss_tokens=80)
    metrics.observe_store(nbytes=6 << 20, seconds=0.002, blocks=3)
    metrics.observe_store(nbytes=1 << 20, seconds=0.5, blocks=1, ok=False)
    metrics.observe_load(nbytes=4 << 20, seconds=0.0001, blocks=2)
    metrics.count_evictions(4)
    metrics.count_error(ErrorCode.POOL_FULL)
    metrics.count_error(ErrorCode.POOL_FULL)
    metrics.count_error(1234)

    status, text = fetch(server.url + "/metrics")
    assert status == 200
    s = samples(text)
    assert s[("kvpool_pool_bytes", ())] == 1 << 30
    assert s[("kvpool_pool_used_bytes", ())] == 3 << 20
    assert s[("kvpool_slots", (("state", "writing"),))] == 1
    assert s[("kvpool_slots", (("state", "committed"),))] == 2
    assert s[("kvpool_slots", (("state", "pinned"),))] == 1
    # tickets are no slots: a gauge of their own, none in kvpool_slots
    assert s[("kvpool_reservation_tickets", ())] == 900
    assert ("kvpool_slots", (("state", "reserved"),)) not in s
    assert s[("kvpool_no_room_blocks_total", ())] == 3
    assert s[("kvpool_clients", (("role", "worker"),))] == 2
    assert s[("kvpool_clients", (("role", "scheduler"),))] == 1
    assert s[("kvpool_clients", (("role", "operator"),))] == 0
    assert s[("kvpool_engines", ())] == 2
    assert s[("kvpool_leases", ())] == 1
    assert s[("kvpool_adopted_blocks", ())] == 7
    assert s[("kvpool_namespace_used_bytes", (("namespace", "01" * 16),))] == 2 << 20
    assert s[("kvpool_namespace_quota_bytes", (("namespace", "01" * 16),))] == 8 << 20
    assert s[("kvpool_lookup_hit_blocks_total", ())] == 10
    assert s[("kvpool_lookup_miss_tokens_total", ())] == 80
    assert s[("kvpool_store_bytes_total", ())] == 6 << 20   # the failed job adds no bytes
    assert s[("kvpool_store_blocks_total", ())] == 3
    assert s[("kvpool_store_jobs_total", (("result", "ok"),))] == 1
    assert s[("kvpool_store_jobs_total", (("result", "failed"),))] == 1
    assert s[("kvpool_store_duration_seconds_count", ())] == 2
    assert s[("kvpool_store_duration_seconds_bucket", (("le", "0.0025"),))] == 1
    assert s[("kvpool_load_bytes_total", ())] == 4 << 20
    assert s[("kvpool_load_duration_seconds_bucket", (("le", "0.0001"),))] == 1
    assert s[("kvpool_evicted_blocks_total", ())] == 4
    assert s[("kvpool_errors_total", (("code", "POOL_FULL"),))] == 2
    assert s[("kvpool_errors_total", (("code", "1234"),))] == 1


def test_healthz_follows_serving_state_and_loop_check_ins(served):
    metrics, server = served
    status, body = fetch(server.url + "/healthz")
    assert status == 503 and json.loads(body)["status"] == "starting or stopping"

    metrics.set_healthy(True)
    metrics.update_from_info(make_info())
    status, body = fetch(server.url + "/healthz")
    assert status == 200, body
    assert json.loads(body) == {"status": "ok", "daemon_id": "d-1", "uptime_s": 12.5}
    assert samples(fetch(server.url + "/metrics")[1])[("kvpool_healthy", ())] == 1

    # A loop that stops checking in goes stale: shorten the window instead of sleeping 5 s.
    metrics.stale_after_s = 0.05
    deadline = time.monotonic() + 10
    while fetch(server.url + "/healthz")[0] != 503:
        assert time.monotonic() < deadline, "healthz never went stale"
        time.sleep(0.02)
    assert "stalled" in json.loads(fetch(server.url + "/healthz")[1])["status"]
    metrics.stale_after_s = 5.0
    metrics.beat()
    assert fetch(server.url + "/healthz")[0] == 200

    metrics.set_healthy(False)
    assert fetch(server.url + "/healthz")[0] == 503
    assert samples(fetch(server.url + "/metrics")[1])[("kvpool_healthy", ())] == 0


def test_unknown_path_is_404(served):
    _, server = served
    assert fetch(server.url + "/nope")[0] == 404


def test_port_zero_disables_and_taken_port_names_the_setting(served):
    metrics, server = served
    assert start_metrics_server(metrics, "127.0.0.1", 0) is None
    with pytest.raises(ConfigError, match="metrics_port"):
        MetricsServer(metrics, "127.0.0.1", server.port)


def test_close_stops_serving():
    server = MetricsServer(Metrics(), "127.0.0.1", 0)
    url = server.url
    assert fetch(url + "/metrics")[0] == 200
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 5
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/metrics", timeout=2)


def test_tier_gauges_and_counters_come_from_the_snapshot():
    from kvpool.shared.protocol import TierInfo
    m = Metrics()
    t = TierInfo("disk", False, "/d", 100, 40, 3, 5, 6, 600, 7, 700, 1, 2, 8, 9, 3, "off: EIO")
    m.update_from_info(PoolInfo("d", 0.0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, [],
                                tiers=[t]))
    text = m.render().decode()
    for line in ('kvpool_tier_enabled{tier="disk"} 0.0', 'kvpool_tier_used_bytes{tier="disk"} 40.0',
                 'kvpool_tier_promoted_bytes_total{tier="disk"} 700.0',
                 'kvpool_tier_verify_failures_total{tier="disk"} 1.0',
                 'kvpool_tier_missed_blocks_total{tier="disk"} 9.0'):
        assert line in text, line


def test_remote_tier_next_to_the_disk_tier():
    from kvpool.shared.protocol import TierInfo
    m = Metrics()
    disk = TierInfo("disk", True, "/d", 100, 40, 3, 5, 6, 600, 7, 700, 0, 0, 0, 0, 0, "ok")
    remote = TierInfo("remote", True, "mooncake://m:50051", 64, 8, 2, 4, 3, 300, 2, 200, 1, 0,
                      0, 0, 0, "ok", lost_blocks=5, rejected_blocks=6)
    m.update_from_info(PoolInfo("d", 0.0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, [],
                                tiers=[disk, remote]))
    text = m.render().decode()
    for line in ('kvpool_tier_enabled{tier="remote"} 1.0', 'kvpool_tier_enabled{tier="disk"} 1.0',
                 'kvpool_tier_lost_blocks_total{tier="remote"} 5.0',
                 'kvpool_tier_rejected_blocks_total{tier="remote"} 6.0',
                 'kvpool_tier_hit_blocks_total{tier="remote"} 4.0'):
        assert line in text, line


def test_lookup_counters_start_at_zero_and_add_up_every_reply():
    # Plain integers added on the event loop and read at scrape (_LookupCollector): present
    # before any lookup, so rate() works from the first scrape, and exact after many.
    from prometheus_client import generate_latest

    m = Metrics()
    names = ("kvpool_lookup_requests_total", "kvpool_lookup_hit_blocks_total",
             "kvpool_lookup_miss_blocks_total", "kvpool_lookup_hit_tokens_total",
             "kvpool_lookup_miss_tokens_total")
    s = samples(generate_latest(m.registry).decode())
    assert [s.get((n, ())) for n in names] == [0, 0, 0, 0, 0]
    for i in range(1000):
        m.observe_lookup(2, i % 7, 3, (i % 7) * 16, 48)
    s = samples(generate_latest(m.registry).decode())
    hit = sum(i % 7 for i in range(1000))
    assert [s[(n, ())] for n in names] == [2000, hit, 3000, hit * 16, 48000]
