"""The KV events decode with vLLM 0.33's own classes, the way its subscribers read them."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvpool.daemon.events import KvEventPublisher, fold_hash

pytestmark = pytest.mark.vllm

NS = b"N" * 16
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


@pytest.mark.parametrize("hash_format", ["bytes", "int64"])
def test_vllm_decodes_every_event_kind(tmp_path, hash_format):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    ctx = zmq.Context()
    pub = KvEventPublisher(f"ipc://{tmp_path}/ev", hash_format=hash_format, interval_ms=5,
                           context=ctx)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"eng-0")
        sub.connect(pub.endpoint)
        decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

        # PUB drops what it sends before the subscription arrives: announce until one lands.
        deadline = time.monotonic() + 10
        pub.registration_added("eng-0", NS, 16, lambda: KEYS[:1])
        pub.flush()
        while not sub.poll(50):
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.blocks_stored(NS, KEYS[:1])
            pub.flush()
        while sub.poll(100):
            sub.recv_multipart()

        pub.blocks_stored(NS, KEYS[1:3])
        pub.blocks_removed(NS, KEYS[1:2])
        pub.registration_removed("eng-0", NS, lambda: KEYS[:3])   # last one: all cleared
        pub.flush()
        events = []
        while len(events) < 3:
            assert sub.poll(10_000), f"only {events} arrived"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"eng-0" and len(seq) == 8
            batch = decoder.decode(payload)
            assert isinstance(batch, kv_events.KVEventBatch)
            assert batch.data_parallel_rank == 0 and batch.ts <= time.time()
            events.extend(batch.events)

        want = KEYS[1:3] if hash_format == "bytes" else [fold_hash(k) for k in KEYS[1:3]]
        stored, removed, cleared = events
        assert isinstance(stored, kv_events.BlockStored)
        assert stored.block_hashes == want
        assert stored.medium == kv_events.MEDIUM_CPU and stored.block_size == 16
        assert stored.token_ids == [] and stored.parent_block_hash is None
        assert stored.lora_id is None and stored.lora_name is None
        assert isinstance(removed, kv_events.BlockRemoved)
        assert removed.block_hashes == want[:1] and removed.medium == kv_events.MEDIUM_CPU
        assert isinstance(cleared, kv_events.AllBlocksCleared)
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.destroy(linger=0)
