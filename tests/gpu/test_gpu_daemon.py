"""The GPU path end to end through a real kvpoold: register over CUDA IPC, store into the
scheduler's reserved tickets with keyed stores, load into poisoned blocks; a SIGKILLed worker
mid-transfer leaves the daemon serving and its GPU memory released."""

from __future__ import annotations

import hashlib
import re
import time

import pytest

from bench.gpu_worker import Worker
from tests.conftest import wait_for

POISON = 0x5A


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
    d = daemon_factory(pool_size="3GiB", extra=["--cuda", "on", "--peer-timeout-ms", "1000",
                                                     "--extent-size", "64MiB"])
    yield d


def _scheduler(d):
    from kvpool.client.scheduler import SchedulerClient
    return SchedulerClient(d.client_config(timeout_ms=10000), name="gpu-test-scheduler")


def _round_trip(w, sched, ns: bytes, keys: list[bytes], seed: int, what: str = "") -> None:
    """Store blocks 0-15 of ``w`` (filled from ``seed``) under ``keys``, look them up, load
    them into blocks 32-47, and check the bytes."""
    slots, grant = _reserve(sched, ns, len(keys))
    assert all(s >= 0 for s in slots), slots
    w.call("fill", seed)
    want = w.call("blocks", list(range(16)))
    dt, ok, msg = w.call("store", list(range(16)), slots, keys, grant)
    assert ok, msg
    reply = sched.lookup(ns, [keys], pin=True)
    assert reply.hits == [16]
    w.call("poison", POISON)
    dt, ok, msg = w.call("load", reply.slots[0], list(range(32, 48)))
    assert ok, msg
    sched.release(reply.leases)
    got = w.call("blocks", list(range(32, 48)))
    assert (got == want).all(), f"{what}loaded KV differs from stored KV"


@pytest.mark.parametrize("layout", ["per_layer", "block_outer", "mla"])
def test_daemon_round_trip(gpu_daemon, layout):
    w = Worker(0, layout, 64)
    sched = _scheduler(gpu_daemon)
    try:
        ns = hashlib.blake2b(layout.encode(), digest_size=16).digest()
        w.call("connect", gpu_daemon.socket, ns, 0, 1)
        _round_trip(w, sched, ns, _keys(layout, 16), 11)
    finally:
        sched.close()
        w.close()
        print(gpu_daemon.log()[-3000:])


@pytest.mark.parametrize("layout", ["per_layer", "block_outer"])
def test_daemon_round_trip_in_chunks_with_late_offsets(daemon_factory, layout):
    """Chunks of 4 blocks: a 16-block store launches its first chunk before the daemon finds
    room for the rest (and the next once that chunk's room is found), a 16-block load its
    first chunk before it finds the rest's slots (late offsets on both sides), and the bytes
    come back exact."""
    d = daemon_factory(pool_size="3GiB", extra=["--cuda", "on", "--extent-size", "64MiB",
                                                "--chunk-blocks", "4"])
    w = Worker(0, layout, 64)
    sched = _scheduler(d)
    try:
        ns = hashlib.blake2b(b"chunks" + layout.encode(), digest_size=16).digest()
        w.call("connect", d.socket, ns, 0, 1)
        for rep in range(3):
            _round_trip(w, sched, ns, _keys(f"{layout}-{rep}", 16), 20 + rep, f"rep {rep}: ")
    finally:
        sched.close()
        w.close()
        print(d.log()[-3000:])


def test_killed_worker_mid_transfer(gpu_daemon):
    probe = Worker(0, "block_outer", 4)
    sched = _scheduler(gpu_daemon)
    try:
        free_before = probe.call("mem_free")
        w = Worker(0, "block_outer", 1024)          # 2 GiB of KV
        ns = b"k" * 16
        w.call("connect", gpu_daemon.socket, ns, 0, 1)
        w.call("fill", 5)
        keys = _keys("kill", 1024)
        slots, grant = _reserve(sched, ns, len(keys))
        assert all(s >= 0 for s in slots)
        # stream stores without waiting for their completions, then kill the worker
        w.conn.send(("stream", "store", [(list(range(i, i + 128)), slots[i:i + 128],
                                          keys[i:i + 128], grant)
                                         for i in range(0, 1024, 128)]))
        time.sleep(0.05)
        w.kill()
        sched.ping()                                 # still serving
        deadline = time.monotonic() + 30
        while probe.call("mem_free") < free_before - (512 << 20):
            assert time.monotonic() < deadline, "the dead worker's GPU memory was not freed"
            time.sleep(0.2)
        info = sched.info()
        assert info.slots_writing == 0 or time.monotonic() < deadline
        # and a new worker can use it
        w2 = Worker(0, "per_layer", 16)
        try:
            ns2 = b"n" * 16
            w2.call("connect", gpu_daemon.socket, ns2, 0, 1)
            k2 = _keys("after", 4)
            s2, g2 = _reserve(sched, ns2, len(k2))
            w2.call("fill", 1)
            _, ok, msg = w2.call("store", [0, 1, 2, 3], s2, k2, g2)
            assert ok, msg
        finally:
            w2.close()
    finally:
        sched.close()
        probe.close()


_FIRST_GAP = re.compile(r"first registration: longest event-loop gap since start ([0-9.]+) ms")
GAP_LIMIT_MS = 50.0     # issue 36 item 6, as tests/integration/test_event_loop.py checks on CPU


def test_a_cuda_workers_first_registration_does_not_hold_the_loop(daemon_factory):
    """A fresh daemon and a CUDA worker registering the moment it answers: the daemon's loop
    goes no more than 50 ms without running from its start through that registration. On GPU
    hosts 2 of 5 daemons logged 26-68 ms there (issue 36): the CUDA attach (waiting for the
    engine's CUDA start, the IPC opens, the GPU's first streams and threads) ran on the loop."""
    w = Worker(0, "per_layer", 64)      # its process and KV memory made before the daemon
    try:
        d = daemon_factory(pool_size="1GiB", extra=["--cuda", "on", "--extent-size", "64MiB"])
        w.call("connect", d.socket, b"g" * 16, 0, 1)
        found = wait_for(lambda: _FIRST_GAP.search(d.log()), 30,
                         lambda: f"the first registration's line:\n{d.log()[-3000:]}")
        gap = float(found.group(1))
        assert gap <= GAP_LIMIT_MS, (f"the event loop went {gap:.1f} ms without running "
                                     f"through the first registration:\n{d.log()[-3000:]}")
    finally:
        w.close()
