"""What the server tells the outside world: metrics, health and KV events, behind one object.

``Telemetry`` owns a ``Metrics`` registry, its HTTP server (when ``metrics_port`` is not 0) and
the KV event publisher (when ``events_endpoint`` is set), and turns the server's moments into
calls on them, so ``daemon/server.py`` needs one line per moment. Every method is called from
the daemon's event loop and returns at once: HTTP and ZeroMQ sends happen on their own threads.

Must never: read daemon state on its own (the server passes what it needs), raise from a hook
(a telemetry fault is logged, it never fails a request), or keep the daemon from stopping.
"""

from __future__ import annotations

import logging
import time
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Iterable

from kvpool.daemon.events import KvEventPublisher, start_event_publisher
from kvpool.daemon.metrics import Metrics, MetricsServer, start_metrics_server
from kvpool.shared.config import DaemonConfig
from kvpool.shared.protocol import PoolInfo

if TYPE_CHECKING:
    from kvpool.daemon.slot_table import Slot, SlotTable

log = logging.getLogger("kvpoold")

# How often the gauges are refreshed from a PoolInfo; building one walks the client table, so
# not on every housekeeping tick. A scrape every 15 s sees data at most this old.
INFO_PERIOD_S = 1.0


def engine_key(engine_id: str, pid: int) -> str:
    """The engine a client belongs to, for event attribution: its vLLM engine id, or its pid
    for clients that did not send one (each such process is its own engine)."""
    return engine_id or f"pid-{pid}"


_NS = attrgetter("ns")
_BLOCK_HASH = attrgetter("block_hash")


class _EventRecords:
    """The slot table's watcher for KV events: one record per block stored or removed,
    published at the next info tick."""

    def __init__(self, records: list[tuple[str, bytes, bytes]]) -> None:
        self.records = records

    # (zip over attrgetters: C-level passes, two per block on a full pool's every store)
    def committed(self, slots: list["Slot"]) -> None:
        self.records.extend(zip(repeat("stored"), map(_NS, slots), map(_BLOCK_HASH, slots)))

    def removed(self, slots: list["Slot"]) -> None:
        self.records.extend(zip(repeat("removed"), map(_NS, slots), map(_BLOCK_HASH, slots)))


class Telemetry:
    """Built with the server (it counts in memory from then on, serving nothing); ``open``
    binds what the config asks for once the daemon owns its socket."""

    def __init__(self, config: DaemonConfig | None = None) -> None:
        self.config = config
        self.metrics = Metrics(stale_after_s=config.health_stale_s if config else 10.0)
        self.http: MetricsServer | None = None
        self.events: KvEventPublisher | None = None
        self._next_info = 0.0
        self._evictions_seen = 0
        self._closed = False
        # ("stored"|"removed", namespace, block hash) records of the slot table (``watch``);
        # None when nobody publishes events.
        self._index_events: list[tuple[str, bytes, bytes]] | None = None

    def open(self) -> None:
        """Open the HTTP server and the events socket the config asks for. Raises
        ``ConfigError`` (naming the setting) when a port or endpoint cannot be bound."""
        config = self.config
        assert config is not None, "a Telemetry built without a config serves nothing"
        self.http = start_metrics_server(self.metrics, config.metrics_host, config.metrics_port)
        try:
            self.events = start_event_publisher(config.events_endpoint, config.events_topic,
                                                config.events_hash_format,
                                                config.events_interval_ms)
        except BaseException:
            if self.http is not None:
                self.http.close()
                self.http = None
            raise
        if self.events is not None:
            self._index_events = []

    @classmethod
    def start(cls, config: DaemonConfig) -> "Telemetry":
        """A Telemetry for ``config``, opened (tools and tests)."""
        t = cls(config)
        t.open()
        return t

    @classmethod
    def disabled(cls) -> "Telemetry":
        """Counts in memory, serves nothing (tests of the parts that report to it)."""
        return cls()

    def watch(self, table: "SlotTable") -> None:
        """Record the slot table's stored and removed blocks for the KV event publisher
        (nothing when events are off: the table then keeps no records at all)."""
        if self._index_events is not None:
            table.watch(_EventRecords(self._index_events))

    def _forward_index_events(self) -> None:
        """Publish what the index recorded so far, to the engines attached *now*."""
        records = self._index_events
        if records:
            assert self.events is not None
            self.events.publish_index_events(records)
            records.clear()

    # ---- lifecycle ----------------------------------------------------------------------------

    def serving(self, info: PoolInfo) -> None:
        """The daemon accepts requests now: /healthz turns 200."""
        self.metrics.update_from_info(info)
        self._evictions_seen = info.evictions
        self.metrics.set_healthy(True)

    def stopping(self) -> None:
        """Shutdown began: /healthz turns 503 so load balancers and probes stop sending."""
        self.metrics.set_healthy(False)

    def close(self, pool_kept: bool) -> None:
        """Last call (later ones do nothing). Without ``pool_kept`` every engine is told its
        blocks are gone."""
        self.metrics.set_healthy(False)
        if self._closed:
            return
        self._closed = True
        if self.events is not None:
            self._forward_index_events()
            if not pool_kept:
                self.events.pool_cleared()
            self.events.close()
        if self.http is not None:
            self.http.close()

    # ---- periodic (housekeeping, every ~100 ms) -----------------------------------------------

    def tick(self, now: float, info: Callable[[], PoolInfo]) -> None:
        """The loop is alive; forward the index's event records; refresh the gauges once per
        ``INFO_PERIOD_S``."""
        try:
            self._forward_index_events()
            if now >= self._next_info:
                self._next_info = now + INFO_PERIOD_S
                snapshot = info()
                self.metrics.count_evictions(snapshot.evictions - self._evictions_seen)
                self._evictions_seen = snapshot.evictions
                self.metrics.update_from_info(snapshot)
            else:
                self.metrics.beat()
        except Exception:
            log.exception("telemetry tick failed")

    # ---- moments ------------------------------------------------------------------------------

    def lookup(self, hits: list[int], key_lists: list[list[bytes]], block_tokens: int) -> None:
        """A lookup was answered: ``hits[i]`` leading hits of ``key_lists[i]``."""
        hit = sum(hits)
        miss = sum(map(len, key_lists)) - hit
        self.metrics.observe_lookup(len(key_lists), hit, miss, hit * block_tokens,
                                    miss * block_tokens)

    def hits_read(self, hit_blocks: int, miss_blocks: int, block_tokens: int) -> None:
        """A scheduler reported a step's lookups in the shared-memory index."""
        self.metrics.observe_lookup(1, hit_blocks, miss_blocks, hit_blocks * block_tokens,
                                    miss_blocks * block_tokens)

    def job_done(self, is_store: bool, nbytes: int, started: float, blocks: int, ok: bool
                 ) -> None:
        """A store or load job finished; ``started`` is its ``time.monotonic()`` at receipt."""
        observe = self.metrics.observe_store if is_store else self.metrics.observe_load
        observe(nbytes, time.monotonic() - started, blocks, ok)

    def store_held(self, expired: bool) -> None:
        """A store waited for the lower tiers (``CopyJobs``); ``expired``: its wait ran out."""
        self.metrics.count_store_hold(expired)

    def error(self, code: int) -> None:
        """An ErrorReply or a failed JobDone was sent with ``code``."""
        self.metrics.count_error(code)

    def registration_added(self, engine_id: str, pid: int, namespace: bytes, block_tokens: int,
                           committed_hashes: Callable[[], Iterable[bytes]]) -> None:
        """A worker registered. Records still queued go out first, to the engines attached
        before it: the new engine learns those blocks from ``committed_hashes()`` once, not
        twice (consumers count repeated stores of a hash)."""
        if self.events is not None:
            self._forward_index_events()
            self.events.registration_added(engine_key(engine_id, pid), namespace, block_tokens,
                                           committed_hashes)

    def registration_removed(self, engine_id: str, pid: int, namespace: bytes,
                             committed_hashes: Callable[[], Iterable[bytes]]) -> None:
        """A registration closed; queued records still reach its engine first."""
        if self.events is not None:
            self._forward_index_events()
            self.events.registration_removed(engine_key(engine_id, pid), namespace,
                                             committed_hashes)
