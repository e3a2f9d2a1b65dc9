"""daemon/events.py: a real PUB socket on ipc:// and a SUB socket that decodes what it sends."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvpool.daemon.events import (KvEventPublisher, KVEventBatch, fold_hash,
                                  start_event_publisher)
from kvpool.shared.errors import ConfigError

NS_A = b"A" * 16
NS_B = b"B" * 16
K = [bytes([i]) * 16 for i in range(1, 9)]


class Feed:
    """A SUB socket on one topic; ``next()`` returns (topic, seq, raw payload) or fails."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: bytes) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        getattr(ctx, "feeds", []).append(self)

    def next(self, timeout_s: float = 10.0) -> tuple[bytes, int, bytes]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no event batch within {timeout_s}s")
        topic, seq, payload = self.sock.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def empty(self) -> bool:
        return not self.sock.poll(0)


class _Ctx(zmq.Context):
    """Remembers its SUB feeds: a socket left to the garbage collector warns (an error here)."""

    feeds: list


@pytest.fixture
def ctx():
    c = _Ctx()
    c.feeds = []
    yield c
    for feed in c.feeds:
        feed.sock.close(linger=0)
    c.destroy(linger=0)


@pytest.fixture
def pub(tmp_path, ctx):
    p = KvEventPublisher(f"ipc://{tmp_path}/events", interval_ms=5, context=ctx)
    yield p
    p.close()


def connected(pub: KvEventPublisher, feed: Feed, engine: str) -> None:
    """Wait until ``feed`` receives ``engine``'s topic: PUB drops everything sent before a
    subscription reaches it, so probe with a throwaway namespace until one batch arrives."""
    probe_ns = b"probe" + bytes(11)
    deadline = time.monotonic() + 10
    pub.registration_added(engine, probe_ns, 16, lambda: [])
    while True:
        pub.blocks_stored(probe_ns, [b"p" * 16])
        pub.flush()
        if feed.sock.poll(20):
            break
        assert time.monotonic() < deadline, "subscriber never connected"
    pub.registration_removed(engine, probe_ns, lambda: [])   # engine keeps its other namespaces
    pub.flush()
    while feed.sock.poll(100):   # drain probes
        feed.sock.recv_multipart()


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def test_wire_shape_matches_vllm(pub, ctx):
    pub.registration_added("engA", NS_A, 16, lambda: [])
    feed = Feed(ctx, pub.endpoint, b"engA")
    connected(pub, feed, "engA")
    pub.blocks_stored(NS_A, K[:2])
    pub.flush()
    topic, _, payload = feed.next()
    assert topic == b"engA"
    raw = msgspec.msgpack.decode(payload)
    # KVEventBatch is positional [ts, events, data_parallel_rank]; events are maps tagged by
    # class name, required fields present even when None, optional ones left out.
    assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float)
    assert raw[2] == 0
    assert raw[1] == [{"type": "BlockStored", "block_hashes": K[:2], "parent_block_hash": None,
                       "token_ids": [], "block_size": 16, "lora_id": None, "medium": "CPU",
                       "lora_name": None}]
    assert list(raw[1][0])[0] == "type"


def test_attribution_follows_registrations(pub, ctx):
    # engA registers in NS_A with two workers (TP=2); engB joins later; blocks go to both.
    pub.registration_added("engA", NS_A, 16, lambda: [])
    pub.registration_added("engA", NS_A, 16, lambda: pytest.fail("only asked on first"))
    fa = Feed(ctx, pub.endpoint, b"engA")
    fb = Feed(ctx, pub.endpoint, b"engB")
    connected(pub, fa, "engA")
    connected(pub, fb, "engB")

    pub.blocks_stored(NS_A, K[:3])
    pub.blocks_stored(NS_B, K[3:4])        # nobody can load NS_B: not sent
    pub.flush()
    _, seq_a, payload = fa.next()
    ev = decode(payload).events
    assert [type(e).__name__ for e in ev] == ["BlockStored"] and ev[0].block_hashes == K[:3]
    assert fb.empty()

    # engB's first registration in NS_A announces what NS_A already holds, to engB only.
    pub.registration_added("engB", NS_A, 16, lambda: K[:3])
    pub.flush()
    ev = decode(fb.next()[2]).events
    assert ev[0].block_hashes == K[:3] and ev[0].medium == "CPU"
    assert fa.empty()

    pub.blocks_removed(NS_A, K[:1])
    pub.flush()
    for feed in (fa, fb):
        _, seq, payload = feed.next()
        ev = decode(payload).events
        assert type(ev[0]).__name__ == "BlockRemoved" and ev[0].block_hashes == K[:1]
        if feed is fa:
            assert seq == seq_a + 1      # per-topic sequence numbers: no gaps on engA's topic

    # engA's first worker leaves: nothing changes; its last leaves: it can load nothing.
    pub.registration_removed("engA", NS_A, lambda: K[1:3])
    pub.flush()
    assert fa.empty()
    pub.registration_removed("engA", NS_A, lambda: K[1:3])
    pub.flush()
    ev = decode(fa.next()[2]).events
    assert [type(e).__name__ for e in ev] == ["AllBlocksCleared"]
    pub.blocks_stored(NS_A, K[4:5])
    pub.flush()
    assert decode(fb.next()[2]).events[0].block_hashes == K[4:5]
    assert fa.empty()


def test_leaving_one_of_two_namespaces_removes_only_its_blocks(pub, ctx):
    pub.registration_added("engA", NS_A, 16, lambda: [])
    pub.registration_added("engA", NS_B, 32, lambda: [])
    fa = Feed(ctx, pub.endpoint, b"engA")
    connected(pub, fa, "engA")
    pub.registration_removed("engA", NS_B, lambda: K[:2])
    pub.flush()
    ev = decode(fa.next()[2]).events
    assert type(ev[0]).__name__ == "BlockRemoved" and ev[0].block_hashes == K[:2]


def test_int64_hashes_and_topic_template(tmp_path, ctx):
    p = KvEventPublisher(f"ipc://{tmp_path}/ev", topic="kv@{engine_id}@m", hash_format="int64",
                         interval_ms=5, context=ctx)
    try:
        p.registration_added("e1", NS_A, 16, lambda: [])
        feed = Feed(ctx, p.endpoint, b"kv@e1@m")
        connected(p, feed, "e1")
        p.blocks_stored(NS_A, K[:1])
        p.flush()
        topic, _, payload = feed.next()
        assert topic == b"kv@e1@m"
        assert decode(payload).events[0].block_hashes == [fold_hash(K[0])]
        assert fold_hash(b"\x00" * 8 + b"\x01" * 8) == 0x0101010101010101
    finally:
        p.close()


def test_bad_settings_name_the_key(tmp_path, ctx):
    with pytest.raises(ConfigError, match="events_topic"):
        KvEventPublisher(f"ipc://{tmp_path}/x", topic="{pod}", context=ctx)
    with pytest.raises(ConfigError, match="events_endpoint"):
        KvEventPublisher("nonsense://here", context=ctx)
    assert start_event_publisher("", "{engine_id}", "bytes", 50) is None


def test_large_announcement_is_split(pub, ctx):
    from kvpool.daemon.events import MAX_HASHES_PER_EVENT
    keys = [i.to_bytes(16, "big") for i in range(MAX_HASHES_PER_EVENT + 5)]
    fa = Feed(ctx, pub.endpoint, b"engA")
    connected(pub, fa, "engA")
    pub.registration_added("engA", NS_A, 16, lambda: keys)
    pub.flush()
    ev = decode(fa.next()[2]).events
    assert [len(e.block_hashes) for e in ev] == [MAX_HASHES_PER_EVENT, 5]


def test_a_large_batch_goes_out_in_bounded_messages(pub, ctx, monkeypatch):
    """The sender encodes one message with the GIL held: a topic's pending events go out
    at most ``MAX_EVENTS_PER_MESSAGE`` a message, in order, with consecutive sequence
    numbers."""
    from kvpool.daemon import events
    monkeypatch.setattr(events, "MAX_HASHES_PER_EVENT", 2)
    monkeypatch.setattr(events, "MAX_EVENTS_PER_MESSAGE", 3)
    keys = [i.to_bytes(16, "big") for i in range(7)]
    fa = Feed(ctx, pub.endpoint, b"engA")
    connected(pub, fa, "engA")
    pub.registration_added("engA", NS_A, 16, lambda: keys)
    pub.flush()
    (_, seq1, first), (_, seq2, second) = fa.next(), fa.next()
    assert seq2 == seq1 + 1
    a, b = decode(first).events, decode(second).events
    assert [len(e.block_hashes) for e in a] == [2, 2, 2] and [len(e.block_hashes) for e in b] == [1]
    assert [h for e in a + b for h in e.block_hashes] == keys
    assert fa.empty()


def test_int64_hashes_are_folded_once_for_every_engine(tmp_path, ctx):
    """Folding happens in the sender, per message: the events one announcement queues for two
    engines reach both folded, and the keys the loop handed over are left as they were."""
    p = KvEventPublisher(f"ipc://{tmp_path}/ev", hash_format="int64", interval_ms=5,
                         context=ctx)
    try:
        feeds = {}
        for engine in ("e1", "e2"):
            p.registration_added(engine, NS_A, 16, lambda: [])
            feeds[engine] = Feed(ctx, p.endpoint, engine.encode())
            connected(p, feeds[engine], engine)
        handed = list(K[:3])
        p.blocks_stored(NS_A, handed)
        p.blocks_removed(NS_A, handed[:1])
        p.flush()
        for feed in feeds.values():
            got: list = []
            while len(got) < 2:               # (the sender may wake between the two)
                got += decode(feed.next()[2]).events
            stored, removed = got
            assert stored.block_hashes == [fold_hash(k) for k in K[:3]]
            assert removed.block_hashes == [fold_hash(K[0])]
        assert handed == K[:3]
    finally:
        p.close()
