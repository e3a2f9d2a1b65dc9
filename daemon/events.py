"""KV events for KV-aware routers: a ZeroMQ PUB socket speaking vLLM's ``KVEventBatch``.

Owns the events socket, the wire encoding and the map of which engines can load which
namespace. It must never block the event loop: the server's calls only append to a list under a
lock; a background thread encodes and sends, and a PUB socket drops (and we count) rather than
wait for a slow subscriber.

**Wire format** (vLLM 0.33 ``vllm/distributed/kv_events.py``, learned from its source): each
message is three frames, ``(topic, seq, payload)``. ``seq`` is an 8-byte big-endian counter that
grows by one per batch *on that topic*, so a subscriber can see gaps. ``payload`` is msgpack of
``KVEventBatch``, positional: ``[ts, [event, ...], data_parallel_rank]``; vLLM's publisher always
fills the rank (0 without data parallelism) and so do we: each engine id is one stream, and a
data-parallel vLLM gives each rank its own engine id. Each event is a msgpack map whose
``"type"`` key names the class:

- ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, then ``group_idx`` (optional fields left out when None).
- ``BlockRemoved``: ``block_hashes``, ``medium``.
- ``AllBlocksCleared``: no fields.

``medium`` is always ``"CPU"``. The daemon knows keys, not tokens, so stored events carry
``token_ids=[]`` and ``parent_block_hash=None``, exactly like vLLM's own offloading connector does
for offloaded chunks it has no request context for; ``block_size`` is the namespace's tokens
per block. ``block_hashes`` are kvpool block keys (16 bytes, see ``kvpool.shared.keys``) or, with
``events_hash_format="int64"``, those bytes folded to an unsigned 64-bit integer the way vLLM
folds its own under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.

**Attribution.** vLLM publishes one stream per engine, and a router attributes every event of a
stream to that engine. A block in the pool can be loaded by every engine with a worker
registered in its namespace (same model and layout), so each batch is sent once per such engine,
on the topic ``events_topic.format(engine_id=...)``. A router configures, per engine, our
endpoint plus that engine's topic (vLLM's own ``KVEventsConfig`` has exactly these two knobs)
and reads "blocks this engine can load from host memory". An engine that starts registering in
a namespace is first sent the blocks already committed there; when its last registration in a
namespace goes, the blocks of that namespace are removed for it, or, if it has no namespace
left, it is sent ``AllBlocksCleared``. Subscribers that join late see only what happens next
(no replay socket yet); vLLM's consumers reference-count repeated stores of one hash, so a
re-announcement is harmless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Iterable, Literal, Union

import msgspec
import zmq

from kvpool.shared.errors import ConfigError

log = logging.getLogger(__name__)

MEDIUM_CPU = "CPU"

# Per-topic events waiting for the sender thread. A router that cannot keep up loses events
# beyond this rather than growing the daemon's memory without bound.
MAX_PENDING_EVENTS = 100_000

# Hashes per BlockStored/BlockRemoved event: a re-announcement of a large namespace becomes
# several events, keeping each message well under typical subscriber buffers.
MAX_HASHES_PER_EVENT = 4096

# Events per message: the sender encodes a message in one C call with the GIL held, and an
# announcement of 524K blocks as one message held it 7-10 ms (this VM); a message of at most
# 16 events (65,536 hashes) holds it ~1 ms, and the event loop runs between messages.
MAX_EVENTS_PER_MESSAGE = 16

WireHash = Union[bytes, int]


class _Event(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """A vLLM ``KVCacheEvent`` on the wire: a map tagged by class name under ``"type"``."""


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def fold_hash(key: bytes) -> int:
    """A key as vLLM's integer block hash: big-endian value, low 64 bits kept."""
    return int.from_bytes(key, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _folded(event: Event) -> Event:
    """``event`` with its block hashes as vLLM's integers (a copy: one event object is queued
    for every engine that can load its blocks)."""
    hashes = getattr(event, "block_hashes", None)
    if not hashes:
        return event
    return msgspec.structs.replace(event, block_hashes=[fold_hash(k) for k in hashes])


def check_topic(topic: str) -> None:
    """``ConfigError`` unless ``events_topic`` substitutes nothing but ``{engine_id}``."""
    try:
        topic.format(engine_id="x")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"events_topic {topic!r}: only {{engine_id}} may be substituted "
                          f"({e!r})") from None


class KvEventPublisher:
    """Publishes the pool's block events to every engine that can load them.

    Every method except ``close`` is meant for the daemon's event loop and returns at once;
    ``close`` joins the sender thread (bounded by ``linger_s``).
    """

    def __init__(self, endpoint: str, topic: str = "{engine_id}",
                 hash_format: Literal["bytes", "int64"] = "bytes", interval_ms: int = 50,
                 context: zmq.Context | None = None) -> None:
        check_topic(topic)
        self._topic_template = topic
        self._int_hashes = hash_format == "int64"
        self._interval_s = interval_ms / 1000.0
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigError(f"events_endpoint: cannot bind {endpoint!r}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

        # namespace -> engine id -> registrations; engine id -> namespaces
        self._engines: dict[bytes, dict[str, int]] = defaultdict(dict)
        self._namespaces_of: dict[str, set[bytes]] = defaultdict(set)
        self._block_tokens: dict[bytes, int] = {}

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[str, list[Event]] = {}
        self._seq: dict[str, int] = defaultdict(int)
        self._closing = False
        self._sending = False   # the sender holds batches taken from _pending but not yet sent
        self.sent_batches = 0
        self.dropped_events = 0
        self._thread = threading.Thread(target=self._sender, name="kvpool-events", daemon=True)
        self._thread.start()
        log.info("kv events: publishing on %s (topic %r)", self.endpoint, topic)

    # ---- engines ------------------------------------------------------------------------------

    def registration_added(self, engine_id: str, namespace: bytes, block_tokens: int,
                           committed_keys: Callable[[], Iterable[bytes]]) -> None:
        """A worker of ``engine_id`` registered in ``namespace``. On the engine's first
        registration there, ``committed_keys()`` is called once and those blocks are announced
        to it (the server passes the index's committed keys of the namespace)."""
        self._block_tokens[namespace] = block_tokens
        engines = self._engines[namespace]
        engines[engine_id] = engines.get(engine_id, 0) + 1
        if engines[engine_id] == 1:
            self._namespaces_of[engine_id].add(namespace)
            self._stored_to([engine_id], namespace, list(committed_keys()))

    def registration_removed(self, engine_id: str, namespace: bytes,
                             committed_keys: Callable[[], Iterable[bytes]]) -> None:
        """A registration of ``engine_id`` in ``namespace`` went away (unregister or its worker
        left). After the last one, the engine can load none of the namespace's blocks."""
        engines = self._engines.get(namespace, {})
        if engine_id not in engines:
            return
        engines[engine_id] -= 1
        if engines[engine_id] > 0:
            return
        del engines[engine_id]
        if not engines:
            self._engines.pop(namespace, None)
        mine = self._namespaces_of[engine_id]
        mine.discard(namespace)
        if mine:
            self._removed_to([engine_id], list(committed_keys()))
        else:
            del self._namespaces_of[engine_id]
            self._enqueue(engine_id, [AllBlocksCleared()])

    # ---- blocks -------------------------------------------------------------------------------

    def blocks_stored(self, namespace: bytes, keys: list[bytes]) -> None:
        """Blocks became loadable (committed: every rank's shard landed)."""
        engines = list(self._engines.get(namespace, ()))
        if engines and keys:
            self._stored_to(engines, namespace, keys)

    def blocks_removed(self, namespace: bytes, keys: list[bytes]) -> None:
        """Committed blocks left the pool (evicted, reset, dropped)."""
        engines = list(self._engines.get(namespace, ()))
        if engines and keys:
            self._removed_to(engines, keys)

    def publish_index_events(self, records: list[tuple[str, bytes, bytes]]) -> None:
        """Forward the index's ``(kind, namespace, block hash)`` records ("stored"/"removed"),
        in order, grouping runs of one kind and namespace into one event each."""
        run: list[bytes] = []
        for i, (kind, ns, key) in enumerate(records):
            run.append(key)
            nxt = records[i + 1] if i + 1 < len(records) else None
            if nxt is None or nxt[0] != kind or nxt[1] != ns:
                (self.blocks_stored if kind == "stored" else self.blocks_removed)(ns, run)
                run = []

    def pool_cleared(self) -> None:
        """Every block is gone for every engine (the pool is destroyed at shutdown)."""
        for engine_id in list(self._namespaces_of):
            self._enqueue(engine_id, [AllBlocksCleared()])

    def _stored_to(self, engines: list[str], namespace: bytes, keys: list[bytes]) -> None:
        # (keys as they are: the sender folds them for int64 hashes, off the event loop,
        # where a fold of 524K keys took ~80 ms; each event takes a slice, a copy)
        block_tokens = self._block_tokens.get(namespace, 0)
        events: list[Event] = [
            BlockStored(block_hashes=keys[i:i + MAX_HASHES_PER_EVENT], parent_block_hash=None,
                        token_ids=[], block_size=block_tokens, lora_id=None, medium=MEDIUM_CPU,
                        lora_name=None)
            for i in range(0, len(keys), MAX_HASHES_PER_EVENT)]
        for engine_id in engines:
            self._enqueue(engine_id, events)

    def _removed_to(self, engines: list[str], keys: list[bytes]) -> None:
        events: list[Event] = [
            BlockRemoved(block_hashes=keys[i:i + MAX_HASHES_PER_EVENT], medium=MEDIUM_CPU)
            for i in range(0, len(keys), MAX_HASHES_PER_EVENT)]
        for engine_id in engines:
            self._enqueue(engine_id, events)

    def _enqueue(self, engine_id: str, events: list[Event]) -> None:
        if not events:
            return
        topic = self._topic_template.format(engine_id=engine_id)
        with self._lock:
            pending = self._pending.setdefault(topic, [])
            room = MAX_PENDING_EVENTS - len(pending)
            if room < len(events):
                self.dropped_events += len(events) - max(room, 0)
                events = events[:max(room, 0)]
            pending.extend(events)

    # ---- sender thread ------------------------------------------------------------------------

    def _sender(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            with self._wake:
                if not self._closing:
                    self._wake.wait(self._interval_s)
                batches, self._pending = self._pending, {}
                self._sending = bool(batches)
                closing = self._closing
            for topic, events in batches.items():
                for i in range(0, len(events), MAX_EVENTS_PER_MESSAGE):
                    self._send(encoder, topic, events[i:i + MAX_EVENTS_PER_MESSAGE])
            with self._lock:
                self._sending = False
            if closing:
                return

    def _send(self, encoder: msgspec.msgpack.Encoder, topic: str, events: list[Event]) -> None:
        """One batch on ``topic`` (the sender thread's)."""
        if self._int_hashes:
            events = [_folded(e) for e in events]
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=events,
                                              data_parallel_rank=0))
        try:
            self._sock.send_multipart(
                (topic.encode(), seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent_batches += 1
        except zmq.Again:
            self.dropped_events += len(events)
        except zmq.ZMQError:
            log.exception("kv events: send failed on %s", self.endpoint)
            self.dropped_events += len(events)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wake the sender now and wait until what was queued before this call is sent."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            self._wake.notify()
        while True:
            with self._lock:
                if not self._pending and not self._sending:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("kv events: pending events not sent in time")
            time.sleep(0.005)

    def close(self, linger_s: float = 1.0) -> None:
        """Send what is queued (bounded by ``linger_s``), stop the thread, close the socket."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout=linger_s + 1.0)
        self._sock.close(linger=int(linger_s * 1000))


def start_event_publisher(endpoint: str, topic: str, hash_format: Literal["bytes", "int64"],
                          interval_ms: int) -> KvEventPublisher | None:
    """The publisher for the daemon's ``events_*`` settings; ``None`` when ``endpoint`` is ""."""
    if not endpoint:
        return None
    return KvEventPublisher(endpoint, topic, hash_format, interval_ms)
