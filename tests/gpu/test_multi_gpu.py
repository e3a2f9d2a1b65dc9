"""Two GPUs, one daemon (issue 3 item 5, issue 5 item 6, issue 16): TP=2 ranks on different GPUs
store their shards into one slot that becomes visible only when both have landed, and each rank
loads its own shard back; a prefill worker on GPU 0 hands a prompt's KV to a decode worker on
GPU 1 through the pool, bit-exact; and across TP sizes: TP=2 ranks on both GPUs hand off to a
TP=1 worker and back, each side moving exactly its KV heads of slots that hold every head."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from bench.gpu_worker import Worker, gpu_count, join_parts, rank_part

POISON = 0x3C

pytestmark = pytest.mark.skipif(gpu_count() < 2, reason="needs two CUDA GPUs")


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]

def _reserve(sched, ns: bytes, n: int) -> tuple[list[int], str]:
    """``n`` tickets for stores of ``ns`` (the engine's path: the store binds each to its key)
    and the daemon life that granted them."""
    reply = sched.reserve(ns, n)
    assert len(reply.slots) == n, f"granted {len(reply.slots)} of {n} tickets"
    return list(reply.slots), reply.daemon_id



@pytest.fixture
def gpu_daemon(daemon_factory):
    return daemon_factory(pool_size="2GiB", extra=["--cuda", "on", "--extent-size", "64MiB"])


def _scheduler(d):
    from kvpool.client.scheduler import SchedulerClient
    return SchedulerClient(d.client_config(timeout_ms=10000), name="multi-gpu-scheduler")


@pytest.mark.parametrize("layout", ["per_layer", "block_outer"])
def test_tp2_shards_commit_together_and_load_per_rank(gpu_daemon, layout):
    ws = [Worker(r, layout, 32) for r in range(2)]
    sched = _scheduler(gpu_daemon)
    try:
        ns = hashlib.blake2b(f"tp2-{layout}".encode(), digest_size=16).digest()
        for r, w in enumerate(ws):
            w.call("connect", gpu_daemon.socket, ns, r, 2)
        keys = _keys(f"tp2-{layout}", 12)
        slots, grant = _reserve(sched, ns, len(keys))
        assert all(s >= 0 for s in slots), slots
        wants = []
        for r, w in enumerate(ws):
            w.call("fill", 200 + r)
            wants.append(w.call("blocks", list(range(12))))
        assert not np.array_equal(wants[0], wants[1])
        _, ok, msg = ws[0].call("store", list(range(12)), slots, keys, grant)
        assert ok, msg
        # one rank's shard alone is never visible
        assert sched.lookup(ns, [keys]).hits == [0]
        _, ok, msg = ws[1].call("store", list(range(12)), slots, keys, grant)
        assert ok, msg
        reply = sched.lookup(ns, [keys], pin=True)
        assert reply.hits == [12]
        for r, w in enumerate(ws):
            w.call("poison", POISON)
            _, ok, msg = w.call("load", reply.slots[0], list(range(16, 28)))
            assert ok, msg
            got = w.call("blocks", list(range(16, 28)))
            assert np.array_equal(got, wants[r]), f"rank {r} loaded another rank's shard"
            untouched = [b for b in range(32) if not 16 <= b < 28]
            assert (w.call("blocks", untouched) == POISON).all(), "a load wrote outside its blocks"
        sched.release(reply.leases)
    finally:
        sched.close()
        for w in ws:
            w.close()


@pytest.mark.parametrize("layout", ["per_layer", "block_outer"])
def test_prefill_gpu0_decode_gpu1_bit_exact(gpu_daemon, layout):
    prefill, decode = Worker(0, layout, 64), Worker(1, layout, 64)
    sched = _scheduler(gpu_daemon)
    try:
        ns = hashlib.blake2b(f"pd-{layout}".encode(), digest_size=16).digest()
        prefill.call("connect", gpu_daemon.socket, ns, 0, 1)
        decode.call("connect", gpu_daemon.socket, ns, 0, 1)
        keys = _keys(f"pd-{layout}", 40)
        slots, grant = _reserve(sched, ns, len(keys))
        assert all(s >= 0 for s in slots)
        prefill.call("fill", 7)
        src = list(range(3, 43))
        want = prefill.call("blocks", src)
        _, ok, msg = prefill.call("store", src, slots, keys, grant)
        assert ok, msg
        prefill.close()                       # the prefill instance may be gone by now
        reply = sched.lookup(ns, [keys], pin=True)
        assert reply.hits == [40]
        decode.call("poison", POISON)
        dst = list(range(60, 20, -1))         # other block ids, other order
        _, ok, msg = decode.call("load", reply.slots[0], dst)
        assert ok, msg
        assert np.array_equal(decode.call("blocks", dst), want), "decode GPU got other bytes"
        sched.release(reply.leases)
    finally:
        sched.close()
        prefill.close()
        decode.close()


@pytest.mark.parametrize("layout", ["per_layer", "block_outer", "block_heads", "per_head"])
def test_tp_cross_tp2_to_tp1_and_back(gpu_daemon, layout):
    """Prefill at TP=2 (GPU 0 and GPU 1) -> decode at TP=1 (GPU 1): the blocks commit only
    once both head ranges landed, and the TP=1 worker loads every head, bit-exact. Then TP=1
    (GPU 0) -> TP=2: each rank loads exactly its heads."""
    two = [Worker(r, layout, 32, tp_size=2) for r in range(2)]
    one = Worker(1, layout, 64)
    sched = _scheduler(gpu_daemon)
    try:
        ns = hashlib.blake2b(f"cross-{layout}".encode(), digest_size=16).digest()
        for r, w in enumerate(two):
            w.call("connect", gpu_daemon.socket, ns, r, 2, True)
        one.call("connect", gpu_daemon.socket, ns, 0, 1, True)
        keys = _keys(f"cross-{layout}", 12)
        slots, grant = _reserve(sched, ns, len(keys))
        assert all(s >= 0 for s in slots), slots
        parts = []
        for r, w in enumerate(two):
            w.call("fill", 300 + r)
            parts.append(w.call("blocks", list(range(12))))
        _, ok, msg = two[0].call("store", list(range(12)), slots, keys, grant)
        assert ok, msg
        assert sched.lookup(ns, [keys]).hits == [0], "one head range alone must not commit"
        _, ok, msg = two[1].call("store", list(range(12)), slots, keys, grant)
        assert ok, msg
        reply = sched.lookup(ns, [keys], pin=True)
        assert reply.hits == [12]
        one.call("poison", POISON)
        dst = list(range(50, 38, -1))
        _, ok, msg = one.call("load", reply.slots[0], dst)
        assert ok, msg
        assert np.array_equal(one.call("blocks", dst), join_parts(layout, parts)), \
            "TP=1 did not get every head of what the TP=2 ranks stored"
        untouched = [b for b in range(64) if b not in dst]
        assert (one.call("blocks", untouched) == POISON).all()
        sched.release(reply.leases)
        # and back: TP=1 stores, each TP=2 rank loads its heads
        keys = _keys(f"cross-back-{layout}", 10)
        slots, grant = _reserve(sched, ns, len(keys))
        one.call("fill", 77)
        full = one.call("blocks", list(range(10)))
        _, ok, msg = one.call("store", list(range(10)), slots, keys, grant)
        assert ok, msg
        reply = sched.lookup(ns, [keys], pin=True)
        assert reply.hits == [10]
        for r, w in enumerate(two):
            w.call("poison", POISON)
            _, ok, msg = w.call("load", reply.slots[0], list(range(20, 30)))
            assert ok, msg
            assert np.array_equal(w.call("blocks", list(range(20, 30))),
                                  rank_part(layout, full, 2, r)), f"rank {r} got other heads"
        sched.release(reply.leases)
        assert sched.info().errors == 0
    finally:
        sched.close()
        one.close()
        for w in two:
            w.close()


def test_tp_cross_mla_stored_once_loaded_by_every_rank(gpu_daemon):
    """MLA at TP=2 on two GPUs: rank 0 stores the latent, rank 1's store copies nothing; a TP=1
    worker and both TP=2 ranks load it whole."""
    two = [Worker(r, "mla", 16, tp_size=2) for r in range(2)]
    one = Worker(0, "mla", 16)
    sched = _scheduler(gpu_daemon)
    try:
        ns = hashlib.blake2b(b"cross-mla", digest_size=16).digest()
        for r, w in enumerate(two):
            w.call("connect", gpu_daemon.socket, ns, r, 2, True)
        one.call("connect", gpu_daemon.socket, ns, 0, 1, True)
        keys = _keys("cross-mla", 6)
        slots, grant = _reserve(sched, ns, len(keys))
        two[0].call("fill", 5)
        want = two[0].call("blocks", list(range(6)))
        # the replica: no copy
        _, ok, msg = two[1].call("store", list(range(6)), slots, keys, grant)
        assert ok, msg
        assert sched.lookup(ns, [keys]).hits == [0]
        _, ok, msg = two[0].call("store", list(range(6)), slots, keys, grant)
        assert ok, msg
        reply = sched.lookup(ns, [keys], pin=True)
        assert reply.hits == [6]
        for w in (one, *two):
            w.call("poison", POISON)
            _, ok, msg = w.call("load", reply.slots[0], list(range(8, 14)))
            assert ok, msg
            assert np.array_equal(w.call("blocks", list(range(8, 14))), want)
        sched.release(reply.leases)
    finally:
        sched.close()
        one.close()
        for w in two:
            w.close()
