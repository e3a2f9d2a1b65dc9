"""Prometheus metrics and the health endpoint of kvpoold.

Owns every metric name the daemon exports (each defined once, below), the registry they live in,
and a small HTTP server that serves ``/metrics`` and ``/healthz`` from its own threads.

Two kinds of numbers, fed two ways:

- **Counters and histograms** are things that *happen*: a store or load finished, a lookup was
  answered, blocks were evicted, an error reply was sent. The server calls ``observe_*`` /
  ``count_*`` at the moment it happens. Each call takes a lock inside prometheus_client and
  costs about a microsecond, so the event loop may call them inline; the lookup counters,
  updated on every lookup reply, are plain integers read at scrape (``_LookupCollector``).
- **Gauges** are the *state* the server already summarises as a ``PoolInfo`` (what ``kvpool
  info`` prints): pool bytes, slots by state, leases, clients. The server hands a fresh
  ``PoolInfo`` to ``update_from_info`` about once a second; scrapes read that snapshot, so a
  scrape never touches daemon state from the HTTP thread and the gauges of one scrape are
  mutually consistent.

Counters are monotonic and rates are left to the scraper (``rate(...[1m])``), as Redis leaves
``keyspace_hits`` to whoever reads ``INFO``.

Health: ``/healthz`` answers 200 only while the server has said it is serving
(``set_healthy(True)``) *and* the event loop has checked in (``beat`` or ``update_from_info``)
within ``stale_after_s``. The HTTP server runs on its own thread, so without the staleness test a
wedged event loop would still look healthy.

Must never: block or run on the daemon's event loop (the HTTP server has its own threads), read
daemon structures from the HTTP thread, or define a metric name anywhere else.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpool.shared.errors import ConfigError, ErrorCode
from kvpool.shared.protocol import PoolInfo, Role

log = logging.getLogger(__name__)

# Copy jobs range from one 2 MiB block (~40 us at the ~52 GB/s PCIe figure in DESIGN.md) to a
# few thousand blocks (~100 ms); host-path copies and waits on the engine's event are slower.
# The buckets cover 50 us .. 10 s so both the fast path and a stall land in a finite bucket.
_JOB_SECONDS_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

_ROLE_NAMES = {Role.SCHEDULER: "scheduler", Role.WORKER: "worker", Role.OPERATOR: "operator"}


def _error_label(code: int) -> str:
    """Stable label text for an error code; unknown codes keep their number so none is lost."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


# The tiers under the pool (``PoolInfo.tiers``), labelled ``tier`` ("disk", "remote"): name → (TierInfo
# field, is a counter, help). Counters come from the snapshot too: the tier counts them on the
# event loop and the scrape reads the latest ``PoolInfo`` (at most INFO_PERIOD_S old).
_TIER_FIELDS = {
    "kvpool_tier_enabled": ("is_enabled", False, "1 while the tier serves; 0 once a fault (disk "
                            "full, I/O error, Mooncake master unreachable) turned it off."),
    "kvpool_tier_capacity_bytes": ("capacity_bytes", False, "Most bytes of blocks the tier "
                                   "keeps (disk_size; remote: remote_segment_size, this host's "
                                   "share of the store)."),
    "kvpool_tier_used_bytes": ("used_bytes", False, "Bytes of blocks the tier holds or is "
                               "writing (remote: that this host knows the store holds)."),
    "kvpool_tier_blocks": ("blocks", False, "Blocks the tier holds (loadable)."),
    "kvpool_tier_hit_blocks": ("hit_blocks", True, "Blocks the tier was asked to bring up "
                               "into the pool (by a load's staging window)."),
    "kvpool_tier_demoted_blocks": ("demoted_blocks", True, "Blocks written down from the pool."),
    "kvpool_tier_demoted_bytes": ("demoted_bytes", True, "Bytes written down from the pool."),
    "kvpool_tier_promoted_blocks": ("promoted_blocks", True, "Blocks read back into the pool "
                                    "and verified."),
    "kvpool_tier_promoted_bytes": ("promoted_bytes", True, "Bytes read back into the pool."),
    "kvpool_tier_verify_failures": ("verify_failures", True, "Blocks that failed their checksum "
                                    "on the way up (dropped, recomputed by the engine)."),
    "kvpool_tier_io_errors": ("io_errors", True, "I/O faults; the first turns the tier off "
                              "(remote: failed calls, and each outage of the master)."),
    "kvpool_tier_evicted_blocks": ("evicted_blocks", True, "Blocks the tier's own LRU dropped "
                                   "to stay within its capacity."),
    "kvpool_tier_missed_blocks": ("missed_blocks", True, "Blocks the pool evicted before they "
                                  "could be written down (the tier fell behind the stores)."),
    "kvpool_tier_lost_blocks": ("lost_blocks", True, "Hits that could not be brought up (gone "
                                "from the tier meanwhile, or the transfer failed); recomputed."),
    "kvpool_tier_rejected_blocks": ("rejected_blocks", True, "Blocks the tier refused for want "
                                    "of room (remote: every segment of the store full)."),
}


def _tier_families() -> dict[str, Metric]:
    return {name: (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, text, labels=["tier"])
            for name, (_, counter, text) in _TIER_FIELDS.items()}


class _SnapshotCollector(Collector):
    """The gauges, read from the latest ``PoolInfo`` at scrape time."""

    def __init__(self, owner: "Metrics") -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        # Names only (no samples), so the registry can check for duplicates at registration.
        return self._families(None, healthy=False)

    def collect(self) -> Iterable[Metric]:
        info, healthy = self._owner._snapshot()
        return self._families(info, healthy)

    @staticmethod
    def _families(info: PoolInfo | None, healthy: bool) -> list[Metric]:
        g = GaugeMetricFamily
        pool = g("kvpool_pool_bytes", "Size of the shared-memory pool.")
        used = g("kvpool_pool_used_bytes", "Pool bytes held by writing or committed slots.")
        slots = g("kvpool_slots", "Pool slots by state (pinned is a subset of committed).",
                  labels=["state"])
        tickets = g("kvpool_reservation_tickets", "Tickets granted to schedulers and not bound "
                    "to a slot yet (they take no pool space).")
        no_room = CounterMetricFamily("kvpool_no_room_blocks", "Reserved stores that found no "
                                      "slot (every one written or pinned): not stored.")
        namespaces = g("kvpool_namespaces", "Namespaces (model x layout) with blocks or engines.")
        leases = g("kvpool_leases", "Leases currently pinning slots for a load.")
        clients = g("kvpool_clients", "Connected client processes by role.", labels=["role"])
        engines = g("kvpool_engines", "Distinct engines (vLLM engine ids) connected.")
        adopted = g("kvpool_adopted_blocks", "Committed blocks adopted from the previous daemon.")
        ns_used = g("kvpool_namespace_used_bytes", "Pool bytes held by one namespace "
                    "(model x layout), writing or committed.", labels=["namespace"])
        ns_quota = g("kvpool_namespace_quota_bytes", "Byte cap of one namespace (0: none).",
                     labels=["namespace"])
        uptime = g("kvpool_uptime_seconds", "Seconds since this daemon started.")
        up = g("kvpool_healthy", "1 while /healthz answers 200, else 0.")
        c = CounterMetricFamily
        stale = c("kvpool_load_stale_blocks", "Load refs whose block was evicted or its slot "
                  "reused between the scheduler's lookup in the shared-memory index and the load "
                  "(found again by key where the pool or a tier still held it).")
        failed = c("kvpool_load_failed_blocks", "Blocks of load jobs not loaded (gone from the "
                   "pool and every tier, or a fill failed): their engines recompute them.")
        index_keys = g("kvpool_index_keys", "Keys published in the shared-memory index "
                       "(pool and lower tiers).")
        unpublished = c("kvpool_index_unpublished_keys", "Keys the shared-memory index was "
                        "too full to take (their lookups miss): raise index_entries.")
        families: list[Metric] = [pool, used, slots, tickets, no_room, namespaces, leases,
                                  clients, engines, adopted, ns_used, ns_quota, uptime, up,
                                  stale, failed, index_keys, unpublished]
        tiers = _tier_families()
        families += tiers.values()
        up.add_metric([], 1.0 if healthy else 0.0)
        if info is None:
            return families
        for t in info.tiers:
            for name, family in tiers.items():
                family.add_metric([t.name], float(getattr(t, _TIER_FIELDS[name][0])))
        pool.add_metric([], info.pool_bytes)
        used.add_metric([], info.used_bytes)
        slots.add_metric(["writing"], info.slots_writing)
        slots.add_metric(["committed"], info.slots_committed)
        slots.add_metric(["pinned"], info.slots_pinned)
        tickets.add_metric([], info.slots_reserved)
        no_room.add_metric([], info.no_room_blocks)
        namespaces.add_metric([], info.namespaces)
        leases.add_metric([], info.leases)
        by_role = dict.fromkeys(_ROLE_NAMES.values(), 0)
        for c in info.clients:
            role = _ROLE_NAMES.get(c.role, str(int(c.role)))
            by_role[role] = by_role.get(role, 0) + 1
        for role, n in sorted(by_role.items()):
            clients.add_metric([role], n)
        engines.add_metric([], len({c.engine_id for c in info.clients if c.engine_id}))
        adopted.add_metric([], info.adopted_blocks)
        for n in info.namespace_usage:
            ns_used.add_metric([n.namespace.hex()], n.used_bytes)
            ns_quota.add_metric([n.namespace.hex()], n.quota_bytes)
        uptime.add_metric([], info.uptime_s)
        stale.add_metric([], info.load_stale_blocks)
        failed.add_metric([], info.load_failed_blocks)
        index_keys.add_metric([], info.index_keys)
        unpublished.add_metric([], info.index_unpublished)
        return families


class _LookupCollector(Collector):
    """The lookup counters, as plain integers that the event loop adds to and a scrape reads.

    A lookup is the daemon's commonest request: five locked ``Counter.inc`` calls per reply
    cost 4.6 us in a bare interpreter (0.4 us as integer adds) and ~8% of the daemon's CPU per
    256-key lookup in situ. One writer (the event loop) keeps the adds exact; a scrape reads a
    copy, at worst one reply behind in some of the five."""

    _FAMILIES = (
        ("kvpool_lookup_requests", "Requests (key lists) answered by lookup."),
        ("kvpool_lookup_hit_blocks", "Blocks found: each request's run of leading hits."),
        ("kvpool_lookup_miss_blocks", "Blocks asked for after the first miss of a request."),
        ("kvpool_lookup_hit_tokens", "Tokens in hit blocks (blocks x tokens per block)."),
        ("kvpool_lookup_miss_tokens", "Tokens in missed blocks."),
    )

    def __init__(self) -> None:
        self.totals = [0] * len(self._FAMILIES)

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(name, text) for name, text in self._FAMILIES]

    def collect(self) -> Iterable[Metric]:
        return [CounterMetricFamily(name, text, value=value)
                for (name, text), value in zip(self._FAMILIES, list(self.totals))]


class Metrics:
    """Every metric of one daemon, in its own ``CollectorRegistry``.

    Thread-safety: every method may be called from any thread, but ``observe_lookup`` from
    the event loop's only. The server calls the event methods from its event loop and
    ``update_from_info``/``beat`` at least once per ``stale_after_s``; the HTTP server reads
    from its own threads.
    """

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._info: PoolInfo | None = None
        self._healthy = False
        self._last_beat = float("-inf")
        r = self.registry

        self._lookups = _LookupCollector()
        r.register(self._lookups)

        self._store_bytes = Counter(
            "kvpool_store_bytes", "Bytes copied engine -> pool by finished store jobs.",
            registry=r)
        self._load_bytes = Counter(
            "kvpool_load_bytes", "Bytes copied pool -> engine by finished load jobs.",
            registry=r)
        self._store_blocks = Counter(
            "kvpool_store_blocks", "Block shards written by finished store jobs.", registry=r)
        self._load_blocks = Counter(
            "kvpool_load_blocks", "Block shards read by finished load jobs.", registry=r)
        self._store_jobs = Counter(
            "kvpool_store_jobs", "Store requests finished, by result (a worker sends a job of "
            "256 blocks or more as two requests).", ["result"], registry=r)
        self._load_jobs = Counter(
            "kvpool_load_jobs", "Load requests finished, by result (a worker sends a job of "
            "256 blocks or more as two requests).", ["result"], registry=r)
        self._store_seconds = Histogram(
            "kvpool_store_duration_seconds",
            "Store request time from received to copy done (includes waiting on the engine's "
            "compute event; a job of 256+ blocks is two requests).",
            buckets=_JOB_SECONDS_BUCKETS, registry=r)
        self._load_seconds = Histogram(
            "kvpool_load_duration_seconds", "Load request time from received to copy done (a "
            "job of 256+ blocks is two requests).",
            buckets=_JOB_SECONDS_BUCKETS, registry=r)

        self._evictions = Counter(
            "kvpool_evicted_blocks", "Committed blocks evicted to make room (LRU).", registry=r)
        holds = Counter(
            "kvpool_store_holds", "Stores that waited for a lower tier to write blocks they "
            "would have evicted, by how the wait ended (written: room was made; expired: the "
            "tier is behind).", ["outcome"], registry=r)
        self._holds_by = {o: holds.labels(o) for o in ("written", "expired")}
        self._errors = Counter(
            "kvpool_errors", "Error replies and failed jobs, by error code.", ["code"],
            registry=r)
        # Present from the first scrape, so rate() and absent() behave before any traffic; kept,
        # since ``labels()`` is a locked look-up that cost ~2 us of every job's reply.
        self._store_jobs_by = {ok: self._store_jobs.labels("ok" if ok else "failed")
                               for ok in (True, False)}
        self._load_jobs_by = {ok: self._load_jobs.labels("ok" if ok else "failed")
                              for ok in (True, False)}
        r.register(_SnapshotCollector(self))

    # ---- events: called when they happen ------------------------------------------------------

    def observe_lookup(self, requests: int, hit_blocks: int, miss_blocks: int,
                       hit_tokens: int, miss_tokens: int) -> None:
        """One lookup reply: ``requests`` key lists, and their hits/misses in blocks and tokens.
        Event-loop thread only (see ``_LookupCollector``).

        A request's misses are the keys after its run of leading hits (they cannot be loaded
        even if present, because a prefix is a run of leading keys)."""
        totals = self._lookups.totals
        totals[0] += requests
        totals[1] += hit_blocks
        totals[2] += miss_blocks
        totals[3] += hit_tokens
        totals[4] += miss_tokens

    def observe_store(self, nbytes: int, seconds: float, blocks: int = 0, ok: bool = True
                      ) -> None:
        """One store job finished; failed jobs count their job and time, never their bytes."""
        self._observe(self._store_jobs_by[ok], self._store_seconds, self._store_bytes,
                      self._store_blocks, nbytes, seconds, blocks, ok)

    def observe_load(self, nbytes: int, seconds: float, blocks: int = 0, ok: bool = True
                     ) -> None:
        """One load job finished (see ``observe_store``)."""
        self._observe(self._load_jobs_by[ok], self._load_seconds, self._load_bytes,
                      self._load_blocks, nbytes, seconds, blocks, ok)

    @staticmethod
    def _observe(jobs: Counter, hist: Histogram, nbytes_c: Counter, blocks_c: Counter,
                 nbytes: int, seconds: float, blocks: int, ok: bool) -> None:
        jobs.inc()
        hist.observe(max(seconds, 0.0))
        if ok:
            nbytes_c.inc(nbytes)
            blocks_c.inc(blocks)

    def count_store_hold(self, expired: bool) -> None:
        self._holds_by["expired" if expired else "written"].inc()

    def count_evictions(self, blocks: int) -> None:
        if blocks:
            self._evictions.inc(blocks)

    def count_error(self, code: int) -> None:
        """One error reply or failed job, labelled by ``ErrorCode`` name."""
        self._errors.labels(_error_label(code)).inc()

    # ---- state: a snapshot about once a second ------------------------------------------------

    def update_from_info(self, info: PoolInfo) -> None:
        """Replace the gauges' snapshot with ``info`` (what ``kvpool info`` shows); also a beat."""
        with self._lock:
            self._info = info
            self._last_beat = time.monotonic()

    def beat(self) -> None:
        """The event loop is alive (for ``/healthz``) without a new snapshot."""
        with self._lock:
            self._last_beat = time.monotonic()

    def set_healthy(self, healthy: bool) -> None:
        """True once the daemon serves requests; False when it starts shutting down."""
        with self._lock:
            self._healthy = healthy
            if healthy:
                self._last_beat = time.monotonic()

    def health(self) -> tuple[bool, str]:
        """(is serving, reason): ``ok``, ``starting or stopping`` or ``event loop stalled``."""
        with self._lock:
            healthy, last = self._healthy, self._last_beat
        if not healthy:
            return False, "starting or stopping"
        age = time.monotonic() - last
        if age > self.stale_after_s:
            return False, f"event loop stalled: no check-in for {age:.1f}s"
        return True, "ok"

    def _snapshot(self) -> tuple[PoolInfo | None, bool]:
        with self._lock:
            info = self._info
        return info, self.health()[0]

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _Handler(BaseHTTPRequestHandler):
    server: "_HttpServer"
    # HTTP/1.0 closes each connection, so an idle scraper cannot hold a thread open.
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        metrics = self.server.metrics
        if path == "/metrics":
            self._reply(200, metrics.render(), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/health"):
            ok, reason = metrics.health()
            info, _ = metrics._snapshot()
            body = {"status": reason, "daemon_id": info.daemon_id if info else "",
                    "uptime_s": info.uptime_s if info else 0.0}
            self._reply(200 if ok else 503, json.dumps(body).encode() + b"\n",
                        "application/json")
        else:
            self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        # Scrapes every 15 s would drown the daemon's log at info level.
        log.debug("metrics http: " + format, *args)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    metrics: Metrics


class _HttpServer6(_HttpServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics`` and ``/healthz`` on ``host:port`` (port 0 here: any free port, for tests),
    served by a thread of its own until ``close()``."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> None:
        server_cls = _HttpServer6 if ":" in host else _HttpServer
        try:
            self._httpd = server_cls((host, port), _Handler)
        except OSError as e:
            raise ConfigError(f"metrics_host/metrics_port: cannot listen on {host}:{port} "
                              f"({e.strerror}): set metrics_port to a free port, or 0 to turn "
                              f"/metrics and /healthz off") from None
        self._httpd.metrics = metrics
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={
            "poll_interval": 0.2}, name="kvpool-metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics: http://%s:%d/metrics and /healthz", self.host, self.port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving; returns within about the poll interval (0.2 s)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be listened on now (a later bind may still lose a race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the HTTP server binds
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start_metrics_server(metrics: Metrics, host: str, port: int) -> MetricsServer | None:
    """The server for the daemon's settings (``metrics_host``, ``metrics_port``); ``None`` when
    ``port`` is 0 (metrics turned off). Raises ``ConfigError`` when the port is taken."""
    if port == 0:
        return None
    return MetricsServer(metrics, host, port)
