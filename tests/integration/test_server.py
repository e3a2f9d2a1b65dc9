"""Failure rules over a real daemon process: every bad input gets a clear error, the daemon keeps
serving everyone else and loses no committed block."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvpool.client.scheduler import SchedulerClient
from kvpool.shared import protocol as p
from kvpool.shared.errors import ErrorCode, TooLarge, VersionMismatch
from tests.conftest import wait_for, wait_for_async
from bench.kvtest import HostKv, keyed_store

ROOT = Path(__file__).resolve().parents[2]


class Raw:
    """A bare DEALER socket speaking bytes, to send what no client library would."""

    def __init__(self, daemon):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{daemon.socket}")

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout_ms: int = 5000) -> p.Reply:
        assert self.sock.poll(timeout_ms), "daemon sent no reply"
        return p.decode_reply(self.sock.recv())

    def call(self, msg) -> p.Reply:
        self.send(p.encode(msg))
        return self.reply()

    def hello(self) -> p.HelloReply:
        r = self.call(p.Hello(1, p.PROTOCOL_VERSION, p.Role.WORKER, "raw"))
        assert isinstance(r, p.HelloReply)
        return r

    def close(self):
        self.sock.close(0)


@pytest.fixture
def committed(daemon):
    """A block stored by a well-behaved engine, checked again after every abuse."""
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config(), "good")
    keys = kv.keys(list(range(64)))
    kv.fill_random([0, 1, 2, 3], seed=1)
    assert worker.wait([keyed_store(sched, worker, reg, kv.namespace, [0, 1, 2, 3], keys)],
                       10)[0].ok
    expected = kv.blocks_of([0, 1, 2, 3])
    yield kv, worker, reg, sched, keys
    hits = sched.lookup(kv.namespace, [keys], pin=True)
    assert hits.hits == [4], "a committed block was lost"
    kv.poison([10, 11, 12, 13])
    done = worker.wait([worker.submit_load(reg, hits.slots[0], [10, 11, 12, 13])], 10)[0]
    assert done.ok and torch.equal(kv.blocks_of([10, 11, 12, 13]), expected)
    sched.release(hits.leases)
    worker.close()
    sched.close()
    kv.close()


def test_garbage_frames_get_protocol_errors(daemon, committed):
    raw = Raw(daemon)
    for frame in (b"", b"\xc1\xff\x00", msgspec.msgpack.encode([200, 5]),
                  msgspec.msgpack.encode({"not": "an array"})):
        raw.send(frame)
        r = raw.reply()
        assert isinstance(r, p.ErrorReply) and r.code == ErrorCode.PROTOCOL, r
    raw.send(b"one", b"two")
    r = raw.reply()
    assert r.code == ErrorCode.PROTOCOL and "one frame" in r.message
    raw.close()


def test_wrong_types_keep_the_req_id(daemon, committed):
    raw = Raw(daemon)
    raw.hello()
    raw.send(msgspec.msgpack.encode([6, 41, 12345, "keys?", "yes"]))
    r = raw.reply()
    assert (r.req_id, r.code) == (41, ErrorCode.PROTOCOL) and "malformed" in r.message
    raw.close()


def test_requests_before_hello_and_unknown_owners(daemon, committed):
    raw = Raw(daemon)
    r = raw.call(p.LookupRequest(3, b"n" * 16, [[b"k" * 16]]))
    assert r.code == ErrorCode.HELLO_REQUIRED and r.req_id == 3
    r = raw.call(p.Heartbeat(4, 987654))
    assert r.code == ErrorCode.HELLO_REQUIRED
    assert isinstance(raw.call(p.Ping(5)), p.Pong)       # ping needs no hello
    raw.close()


def test_version_mismatch_is_refused_clearly(daemon, committed):
    raw = Raw(daemon)
    r = raw.call(p.Hello(1, p.PROTOCOL_VERSION + 1, p.Role.SCHEDULER))
    assert r.code == ErrorCode.VERSION_MISMATCH and "upgrade" in r.message
    raw.close()



def test_client_of_another_protocol_version_gets_version_mismatch(daemon, monkeypatch):
    theirs = p.PROTOCOL_VERSION + 7
    monkeypatch.setattr(p, "PROTOCOL_VERSION", theirs)     # the client module reads it at call time
    client = SchedulerClient(daemon.client_config())
    try:
        with pytest.raises(VersionMismatch, match=f"protocol {theirs}, this daemon speaks {theirs - 7}"):
            client.info()
    finally:
        client.close()


def test_oversized_frames_are_refused(daemon_factory):
    d = daemon_factory(extra=["--max-request-bytes", "65536"])
    raw = Raw(d)
    raw.hello()
    big = p.LookupRequest(9, b"n" * 16, [[b"k" * 16] * 8000])     # ~140 KiB
    r = raw.call(big)
    assert (r.req_id, r.code) == (9, ErrorCode.TOO_LARGE) and "65536" in r.message
    assert isinstance(raw.call(p.LookupRequest(10, b"n" * 16, [[b"k" * 16]])), p.LookupReply)
    raw.close()


def test_unknown_ids_and_out_of_range_blocks(daemon, committed):
    kv, worker, reg, sched, keys = committed
    raw = Raw(daemon)
    raw.hello()
    r = raw.call(p.StoreRequest(7, 424242, 1, [0], [1]))
    assert isinstance(r, p.JobDone) and r.code == ErrorCode.UNKNOWN_ID and r.job_id == 1
    r = raw.call(p.UnregisterRequest(8, 424242))
    assert r.code == ErrorCode.UNKNOWN_ID
    assert raw.call(p.ReleaseRequest(9, [555])) == p.OkReply(9, 0)
    r = raw.call(p.ReserveRequest(10, b"?" * 16, 1))
    assert r.code == ErrorCode.UNKNOWN_ID and "no registered layout" in r.message
    raw.close()

    more = kv.keys(list(range(96)))[4:]
    grant = sched.reserve(kv.namespace, len(more))

    def store(block_ids, tickets, keys=more):
        return worker.wait([worker.submit_store(reg, block_ids, tickets, keys=keys,
                                                grant=grant.daemon_id)], 10)[0]
    for bad in ([-1, 5], [5, kv.blocks], [5]):
        done = store(bad, grant.slots)
        assert not done.ok and done.code in (ErrorCode.OUT_OF_RANGE, ErrorCode.PROTOCOL), done
    done = store([4, 5], [grant.slots[0] + (3 << 32), grant.slots[1]])
    assert done.code == ErrorCode.OUT_OF_RANGE        # another generation: no ticket of ours
    done = store([4, 5], grant.slots, keys=more[:1])
    assert done.code == ErrorCode.PROTOCOL and "keys for" in done.message
    done = worker.wait([worker.submit_store(reg, [4, 5], grant.slots, keys=more,
                                            grant="another-daemon")], 10)[0]
    assert done.code == ErrorCode.UNKNOWN_ID and "reserve again" in done.message
    done = worker.wait([worker.submit_load(reg, [0xFFFF_FFF0], [9])], 10)[0]
    assert done.code == ErrorCode.OUT_OF_RANGE
    # Nothing above disturbed the tickets: they still take the real store.
    assert store([4, 5], grant.slots).ok
    assert sched.lookup(kv.namespace, [kv.keys(list(range(96)))]).hits == [6]


def test_registrations_the_daemon_cannot_serve(daemon, committed):
    kv, *_ = committed
    raw = Raw(daemon)
    raw.hello()
    cuda = p.RegisterRequest(2, kv.namespace, kv.layout, 0, kv.blocks,
                             [p.CudaRegion("GPU-x", b"\0" * 64, 1 << 20)], kv.placement)
    r = raw.call(cuda)
    assert r.code == ErrorCode.PROTOCOL and "no copy engine" in r.message
    r = raw.call(p.RegisterRequest(3, kv.namespace, kv.layout, 5, kv.blocks, [kv.mem.region],
                                   kv.placement))
    assert r.code == ErrorCode.OUT_OF_RANGE and "tp_rank" in r.message
    other = msgspec.structs.replace(kv.layout, description="different")
    r = raw.call(p.RegisterRequest(4, kv.namespace, other, 0, kv.blocks, [kv.mem.region],
                                   kv.placement))
    assert r.code == ErrorCode.LAYOUT_MISMATCH
    r = raw.call(p.RegisterRequest(5, kv.namespace, kv.layout, 0, kv.blocks, [kv.mem.region],
                                   kv.placement, quota_bytes=-1))
    assert r.code == ErrorCode.OUT_OF_RANGE and "quota" in r.message
    raw.close()


def test_namespace_quota_over_the_wire(daemon_factory):
    """The daemon's cap bounds every namespace, an engine may declare a lower one, and a store
    past a quota evicts only that namespace's own blocks; `info` shows each namespace's use."""
    d = daemon_factory(extra=["--namespace-quota", "16KiB"])     # 4 blocks of 4 KiB
    capped, other = HostKv(model="capped"), HostKv(model="other")
    cw = capped.register(d.client_config())[0]
    creg = cw.register(capped.namespace, capped.layout, 0, capped.blocks, [capped.mem.region],
                       capped.placement, quota_bytes=8 << 10)          # 2 blocks
    ow, oreg = other.register(d.client_config())
    sched = SchedulerClient(d.client_config())

    def store(kv, worker, reg, keys):
        """Per key, whether it is in the pool after the store."""
        job = keyed_store(sched, worker, reg, kv.namespace, list(range(len(keys))), keys)
        assert worker.wait([job], 10)[0].ok
        return [bool(n) for n in sched.lookup(kv.namespace, [[k] for k in keys]).hits]

    try:
        other_keys = other.keys(list(range(96)))
        assert store(other, ow, oreg, other_keys) == [True] * 4 + [False] * 2
        first = capped.keys(list(range(32)))
        store(capped, cw, creg, first)
        later = capped.keys(list(range(1000, 1032)))
        assert all(store(capped, cw, creg, later))                    # evicts its own two
        assert sched.lookup(capped.namespace, [first, later]).hits == [0, 2]
        assert sched.lookup(other.namespace, [other_keys]).hits == [4]
        usage = {n.namespace: n for n in sched.info().namespace_usage}
        assert (usage[capped.namespace].quota_bytes, usage[capped.namespace].used_bytes) == \
            (8 << 10, 8 << 10)
        assert (usage[other.namespace].quota_bytes, usage[other.namespace].blocks) == (16 << 10, 4)
    finally:
        cw.close(); ow.close(); sched.close(); capped.close(); other.close()


def test_full_pool_with_everything_leased_stores_nothing_and_evicts_nothing(daemon_factory):
    d = daemon_factory(pool_size="8MiB")
    kv = HostKv(layers=4, blocks=64, heads=8, head_dim=64)       # 128 KiB slots
    worker, reg = kv.register(d.client_config())
    sched = SchedulerClient(d.client_config())
    stored = 0
    leases = []
    for i in range(200):
        ks = kv.keys(list(range(i * 1000, i * 1000 + 16)))
        done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, [i % 64], ks)], 10)[0]
        assert done.ok, done
        if not done.nbytes:                 # no room: every slot is leased
            break
        leases += sched.lookup(kv.namespace, [ks], pin=True).leases
        stored += 1
    assert 20 < stored < 200
    info = sched.info()
    assert (info.evictions, info.no_room_blocks, info.slots_committed) == (0, 1, stored)
    sched.release(leases)
    ks = kv.keys(list(range(999_000, 999_016)))
    done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, [0], ks)], 10)[0]
    assert done.nbytes, "a released pool takes stores again"
    worker.close(); sched.close(); kv.close()


# ---- regressions found by the soak campaign (bench/soak) ----------------------------------

def test_crafted_shm_names_are_refused_and_the_daemon_serves_on(daemon, committed):
    """A NUL byte in a host region's name used to crash the daemon (a segfault in the shm
    library); only engine segments (kvpool-engine-*) are opened on a client's behalf now."""
    kv, *_ = committed
    raw = Raw(daemon)
    raw.hello()
    for name in ("kvpool-kv-\0", "x\0y", "../../etc/passwd", "..", "", "kvpool-engine-a/../b",
                 daemon.pool_name, "kvpool-kv-" + "a" * 300):
        r = raw.call(p.RegisterRequest(2, kv.namespace, kv.layout, 0, kv.blocks,
                                       [p.HostRegion(name, kv.mem.nbytes)], kv.placement))
        assert r.code == ErrorCode.PROTOCOL and "refused" in r.message, (name, r)
    assert isinstance(raw.call(p.Ping(3)), p.Pong)
    raw.close()


def test_strings_that_are_not_utf8_are_protocol_errors(daemon, committed):
    raw = Raw(daemon)
    frame = msgspec.msgpack.encode([1, 5, 1, 2, "x"]).replace(b"\xa1x", b"\xa2\xc3\x28")
    raw.send(frame)
    r = raw.reply()
    assert (r.req_id, r.code) == (5, ErrorCode.PROTOCOL), r       # was INTERNAL
    raw.close()


def test_layouts_and_block_ids_past_their_bounds_are_refused(daemon, committed):
    kv, worker, reg, sched, keys = committed
    raw = Raw(daemon)
    raw.hello()
    huge = msgspec.structs.replace(kv.layout, tp_size=1 << 40)      # a bit per rank: 128 GiB
    r = raw.call(p.RegisterRequest(2, b"h" * 16, huge, (1 << 40) - 1, kv.blocks,
                                   [kv.mem.region], kv.placement))
    assert r.code == ErrorCode.LAYOUT_MISMATCH and "tp_size" in r.message, r
    r = raw.call(p.RegisterRequest(3, kv.namespace, kv.layout, 0, kv.blocks, [kv.mem.region],
                                   kv.placement))
    reg_id = r.registration_id
    for i, ids in enumerate(([2**63], [3, 2**64 - 1], [-(2**63)], [1] * 40 + [2**64 - 1],
                             [1] * 40 + [-1], [1] * 40 + [kv.blocks])):
        r = raw.call(p.LoadRequest(4 + i, reg_id, 9, [1] * len(ids), ids))
        assert isinstance(r, p.JobDone) and r.code == ErrorCode.OUT_OF_RANGE, r   # was INTERNAL
    raw.close()


def test_one_request_names_a_bounded_number_of_blocks(daemon, committed):
    kv, worker, reg, sched, keys = committed
    from kvpool.daemon.copy_jobs import MAX_BLOCKS_PER_REQUEST as most
    with pytest.raises(TooLarge, match="split it"):
        sched.reserve(kv.namespace, most + 1)
    done = worker.wait([worker.submit_store(reg, [0] * (most + 1), [1] * (most + 1),
                                            keys=[b"k" * 16] * (most + 1))], 10)[0]
    assert done.code == ErrorCode.TOO_LARGE
    done = worker.wait([worker.submit_load(reg, [1] * (most + 1), [0] * (most + 1))], 10)[0]
    assert done.code == ErrorCode.TOO_LARGE


def test_registrations_per_client_are_bounded(daemon, committed):
    kv, *_ = committed
    from kvpool.daemon.server import MAX_REGISTRATIONS_PER_CLIENT as most
    raw = Raw(daemon)
    raw.hello()
    for i in range(most + 1):
        r = raw.call(p.RegisterRequest(i + 2, b"%016d" % i, kv.layout, 0, kv.blocks,
                                       [kv.mem.region], kv.placement))
        if i < most:
            assert isinstance(r, p.RegisterReply), r
    assert r.code == ErrorCode.TOO_LARGE and "registrations" in r.message
    raw.close()


def test_a_job_whose_registration_goes_still_gets_its_answer(daemon):
    """A worker that unregistered (or re-registered) with a job in flight waited forever: the
    daemon dropped the job's reply."""
    kv = HostKv(blocks=64, layers=8, heads=8, head_dim=64)          # 256 KiB blocks
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    try:
        job = keyed_store(sched, worker, reg, kv.namespace, list(range(48)),
                          kv.keys(list(range(16 * 48))))
        worker.unregister(reg)
        done = worker.wait([job], 10)[0]           # TimeoutError before the fix
        assert done.ok or done.code == ErrorCode.ABORTED, done
    finally:
        worker.close(); sched.close(); kv.close()


def test_a_client_that_closes_is_released_at_once(daemon):
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    watcher = SchedulerClient(daemon.client_config())
    try:
        ks = kv.keys(list(range(64)))
        assert worker.wait([keyed_store(sched, worker, reg, kv.namespace, [0, 1, 2, 3], ks)],
                           10)[0].ok
        sched.lookup(kv.namespace, [ks], pin=True)
        assert watcher.info().leases == 1
        sched.close()
        worker.close()
        # Said goodbye: released now, not after the peer timeout (2 s for test daemons).
        info = watcher.info()
        assert (info.leases, len(info.clients)) == (0, 1), info
    finally:
        watcher.close(); kv.close()


# Big stores, committed chunk by chunk as their copies land: 2 MiB blocks (Llama-8B's shape),
# chunks of 8 of them in a daemon told so.
LLAMA = dict(layers=32, heads=8, head_dim=128)
CHUNK = 8


def _hits(sched, kv, ks) -> int:
    return sched.lookup(kv.namespace, [ks]).hits[0]


def test_a_big_store_becomes_visible_chunk_by_chunk_and_only_landed_blocks_load(
        daemon_factory):
    d = daemon_factory(pool_size="640MiB",
                       extra=["--extent-size", "32MiB", "--chunk-blocks", str(CHUNK)])
    cfg = d.client_config(timeout_ms=20000)
    writer, reader = HostKv(blocks=96, **LLAMA), HostKv(blocks=CHUNK, **LLAMA)
    w, wreg = writer.register(cfg)
    r, rreg = reader.register(cfg, name="reader")     # its own copy thread: loads run beside
    sched = SchedulerClient(cfg)
    try:
        writer.fill_random(list(range(96)), seed=3)
        expected = writer.blocks_of(list(range(CHUNK)))
        partial = set()
        for attempt in range(3):                       # a fresh prompt each time
            ks = writer.keys(list(range(attempt * 10**5, attempt * 10**5 + 16 * 96)))
            job = keyed_store(sched, w, wreg, writer.namespace, list(range(96)), ks)
            while w.jobs_in_flight:
                hit = sched.lookup(writer.namespace, [ks], pin=True)
                n = hit.hits[0]
                assert n % CHUNK == 0, f"{n} blocks visible: not whole chunks"
                if 0 < n < 96:
                    partial.add(n)
                    # what is visible has landed: it loads back exact while the rest copies
                    reader.poison(list(range(CHUNK)))
                    done = r.wait([r.submit_load(rreg, hit.slots[0][:CHUNK],
                                                 list(range(CHUNK)))], 20)[0]
                    assert done.ok, done
                    assert torch.equal(reader.blocks_of(list(range(CHUNK))), expected)
                sched.release(hit.leases)
                for c in w.poll():
                    assert c.job_id == job and c.ok, c
            assert _hits(sched, writer, ks) == 96
            if partial:
                break
        assert partial, "no lookup ever saw a store half committed"
    finally:
        w.close(); r.close(); sched.close(); writer.close(); reader.close()


def test_a_big_load_copies_its_head_first_and_sends_what_the_pool_lacks_down_the_load_path(
        daemon_factory):
    """A load bigger than a chunk starts its head's copy before it finds the rest (the late
    load): all in the pool, every block lands exact; a stale ref past the head is found by its
    key, or without a key fails alone, the failed position counted in the whole job; a ref
    past the head that names no slot fails the job with OUT_OF_RANGE once its head landed,
    and pins nothing after (the daemon serves on, every block evictable again)."""
    d = daemon_factory(pool_size="64MiB", extra=["--chunk-blocks", "4"])
    cfg = d.client_config(timeout_ms=20000)
    kv = HostKv(blocks=48)
    w, reg = kv.register(cfg)
    sched = SchedulerClient(cfg)
    try:
        ks = kv.keys(list(range(16 * 16)))
        kv.fill_random(list(range(16)), seed=11)
        assert w.wait([keyed_store(sched, w, reg, kv.namespace, list(range(16)), ks)],
                      20)[0].ok
        expected = kv.blocks_of(list(range(16)))
        refs = list(sched.lookup(kv.namespace, [ks]).slots[0])
        assert len(refs) == 16
        into = list(range(16, 32))
        stale = refs[:]
        stale[9] ^= 1 << 40                 # another generation of the same slot

        def load(refs, keys=()):
            kv.poison(into)
            return w.wait([w.submit_load(reg, refs, into, list(keys))], 20)[0]

        done = load(refs)
        assert done.ok and not done.failed, done
        assert torch.equal(kv.blocks_of(into), expected)
        done = load(stale, ks)
        assert done.ok and not done.failed, done
        assert torch.equal(kv.blocks_of(into), expected)
        done = load(stale)
        assert done.ok and list(done.failed) == [9], done
        got = kv.blocks_of(into)            # [layers, 2, blocks, ...]
        assert torch.equal(got[:, :, :9], expected[:, :, :9])
        assert torch.equal(got[:, :, 10:], expected[:, :, 10:])
        bad = refs[:]
        bad[12] = (1 << 32) | 0xFFFF_FFF0    # a slot id past the pool's
        done = load(bad)
        assert not done.ok and done.code == ErrorCode.OUT_OF_RANGE, done
        assert "names no slot" in done.message
        wait_for(lambda: sched.info().slots_pinned == 0, 10,
                 lambda: f"the failed load's head to be unpinned: {sched.info()}")
        done = load(refs)
        assert done.ok and torch.equal(kv.blocks_of(into), expected)
    finally:
        w.close(); sched.close(); kv.close()


_DYING_WORKER = """
import sys, time
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.config import ClientConfig
from bench.kvtest import HostKv, keyed_store
cfg = ClientConfig(socket=sys.argv[1], timeout_ms=20000)
kv = HostKv(blocks=96, layers=32, heads=8, head_dim=128)
w, reg = kv.register(cfg)
s = SchedulerClient(cfg)
kv.fill_random(list(range(96)), seed=5)
keyed_store(s, w, reg, kv.namespace, list(range(96)), kv.keys(list(range(16 * 96))))
print("sent", flush=True)
time.sleep(120)
"""


def test_a_big_store_whose_worker_dies_keeps_only_landed_chunks_and_frees_the_rest(
        daemon_factory):
    d = daemon_factory(pool_size="640MiB",
                       extra=["--extent-size", "32MiB", "--chunk-blocks", str(CHUNK)])
    child = subprocess.Popen([sys.executable, "-c", _DYING_WORKER, d.socket],
                             stdout=subprocess.PIPE, cwd=ROOT)
    kv = HostKv(blocks=96, **LLAMA)
    sched = SchedulerClient(d.client_config(timeout_ms=20000))
    try:
        assert child.stdout.readline().strip() == b"sent", "the worker did not start its store"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: len(sched.info().clients) == 1 and sched.info().slots_writing == 0,
                 20, "the dead worker's job to end")
        # The slots of the chunks that never landed go back once the job's end is handled
        # (a step after its writing slots are dropped): bounded, not leaked.
        slot_bytes = kv.layout.slot_bytes
        wait_for(lambda: sched.info().used_bytes == sched.info().slots_committed * slot_bytes,
                 20, lambda: f"the unlanded chunks' slots to be freed: {sched.info()}")
        info = sched.info()
        ks = kv.keys(list(range(16 * 96)))
        n = _hits(sched, kv, ks)
        assert n % CHUNK == 0 and info.slots_committed == n
        print(f"{n} of 96 blocks landed before the worker died")
        # nothing leaked: the slots of the chunks that did not land are free again
        assert info.used_bytes == n * kv.layout.slot_bytes and info.slots_pinned == 0
        if n:
            worker, reg = kv.register(d.client_config(timeout_ms=20000))
            kv.fill_random(list(range(96)), seed=5)
            expected = kv.blocks_of(list(range(n)))
            kv.poison(list(range(96)))
            hit = sched.lookup(kv.namespace, [ks], pin=True)
            assert worker.wait([worker.submit_load(reg, hit.slots[0], list(range(n)))],
                               20)[0].ok
            assert torch.equal(kv.blocks_of(list(range(n))), expected)
            sched.release(hit.leases)
            worker.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
        sched.close(); kv.close()


class _HeldEngine:
    """A CUDA-region engine that copies nothing: it keeps each store's future, progress and
    late offsets for the test to play the copy, and notes what the index held at submission.
    ``head``: what it asks of a store before its copy starts (``store_head``); ``step``: where
    it asks the caller to ``advance`` to first (``LateOffsets.step``), noting each advance;
    ``load_head``: a load's (``load_head``, 0: it takes no loads), whose future it keeps."""

    def __new__(cls, srv_of, head: int = 0, step: int = 0, load_head: int = 0):
        from concurrent.futures import Future

        from kvpool.daemon.copy_engine import CopyEngine, Mapped
        from kvpool.shared.errors import Aborted

        class Held(CopyEngine):
            name = "held"
            refuse = False
            late = None

            def attach(self, registration, peer=None):
                m = Mapped.__new__(Mapped)
                m.registration = registration
                return m

            def detach(self, mapped):
                pass

            def store_head(self, n):
                return head if 0 < head < n else 0

            def submit_store(self, mapped, block_ids, shard_offsets, wait_event=b"",
                             progress=None, late=None):
                if self.refuse:
                    raise Aborted("refused")
                srv = srv_of()
                self.seen = (srv.index.ticket_count, srv.index.slot_counts()[0])
                self.offsets = shard_offsets.copy()     # as written at submission
                self.fut, self.progress, self.late = Future(), progress, late
                self.advanced = []
                if late is not None and step:
                    late.step = step
                    late.on_advance = lambda upto: self.advanced.append(
                        (upto, late.offsets[:upto].copy(), srv.index.ticket_count))
                return self.fut

            def load_head(self, n):
                return load_head if 0 < load_head < n else 0

            def submit_load(self, mapped, shard_offsets, block_ids, late=None):
                assert load_head, "no loads here"
                self.load_fut, self.load_late = Future(), late
                return self.load_fut
        return Held()


class _ServerHarness:
    """A ``Server`` on ``pool`` with one worker client ("\0me") registered for ``ns`` through
    ``engine``, requests dispatched straight in and replies collected."""

    slot = 4096
    ns = b"s" * 16

    def __init__(self, pool, head: int = 0, step: int = 0, load_head: int = 0) -> None:
        from kvpool.daemon.server import Server
        from kvpool.shared.config import DaemonConfig

        cfg = DaemonConfig(pool_name=pool.name.lstrip("/"), pool_size="8MiB",
                           extent_size="1MiB")
        self.engine = _HeldEngine(lambda: self.srv, head, step, load_head)
        self.srv = Server(cfg, pool, {p.CudaRegion: self.engine})
        self.replies: list = []
        self.srv._send = self.srv.jobs.send = lambda _identity, r: self.replies.append(r)

    def dispatch(self, msg) -> None:
        class Frame:
            buffer = memoryview(p.encode(msg))
        self.srv._dispatch(b"\0me", Frame())

    def call(self, msg):
        self.dispatch(msg)
        return self.replies[-1]

    async def register(self, blocks: int = 16) -> int:
        from kvpool.shared.layout import Layout, SegmentPlacement

        self.call(p.Hello(1, p.PROTOCOL_VERSION, p.Role.WORKER, "t", os.getpid()))
        self.dispatch(p.RegisterRequest(
            2, self.ns, Layout(16, 1, "f16", (self.slot,), "t"), 0, blocks,
            [p.CudaRegion("GPU-0", b"h" * 64, blocks * self.slot)],
            [SegmentPlacement(0, 0, self.slot)]))
        await wait_for_async(lambda: len(self.replies) == 2, 10, "the registration's reply")
        return self.replies[-1].registration_id

    async def reply_after(self, n: int):
        await wait_for_async(lambda: len(self.replies) > n, 10, "the job's reply")
        return self.replies[-1]


def test_a_keyed_store_binds_its_slots_in_its_dispatch_whether_its_copy_starts_or_not(pool):
    """A store of tickets hands its copy to the engine once their slots are found, before they
    are bound (Index.open_store); the binding still happens within the same dispatch: before
    the dispatch returns, the slots are bound and in flight, and a chunk that lands commits.
    An engine that refuses the job leaves neither the tickets nor the key behind."""
    import asyncio

    from kvpool.daemon.copy_engine import JobResult

    h = _ServerHarness(pool)
    eng, ns, slot = h.engine, h.ns, h.slot

    async def run():
        reg = await h.register()
        ix = h.srv.index
        ks = [b"%016d" % i for i in range(8)]
        refs = ix.reserve(ns, 8, 7, 0.0)
        n = len(h.replies)
        h.dispatch(p.StoreRequest(3, reg, 1, list(range(8)), refs, keys=ks))
        assert len(h.replies) == n                          # in flight: no reply yet
        assert eng.seen == (8, 0)                         # handed over before the binding
        assert ix.ticket_count == 0 and ix.slot_counts()[0] == 8   # bound in the dispatch
        eng.progress(4)
        await wait_for_async(lambda: ix.leading(ns, ks) == 4, 10, "the landed chunk's commit")
        eng.fut.set_result(JobResult(8 * slot))
        assert (await h.reply_after(n)).code == 0 and ix.leading(ns, ks) == 8
        eng.refuse = True
        more = [b"%016d" % i for i in range(8, 12)]
        refs = ix.reserve(ns, 4, 7, 0.0)
        used = ix.namespaces.used_bytes_of(ns)
        done = h.call(p.StoreRequest(4, reg, 2, list(range(4)), refs, keys=more))
        assert done.code == int(ErrorCode.ABORTED)
        assert ix.ticket_count == 0 and ix.slot_counts()[0] == 0
        assert ix.namespaces.used_bytes_of(ns) == used and ix.leading(ns, more) == 0
        assert ix.tickets.held == {} and ix.pinned_count() == 0

    asyncio.run(run())


@pytest.mark.parametrize("step", [0, 8])
def test_a_big_store_is_handed_over_with_its_heads_offsets_and_gets_the_rest_in_its_dispatch(
        pool, step):
    """Where the engine asks for a head (``store_head``), a big fresh store reaches it with the
    head's offsets written and its tickets unbound; before the dispatch returns, every ticket
    is bound and every offset written (the engine may go on), and the job commits as any
    other. Where the engine asks for a ``step``, the offsets up to it are written and handed on
    (``advance``) before the rest's room is found and any ticket is bound. Where the rest then
    finds no room after all, the engine is told to stop after the head, the job fails, and
    neither tickets, slots nor pins are left behind."""
    import asyncio

    import numpy as np

    from kvpool.daemon.copy_engine import JobResult
    from kvpool.shared.errors import Aborted

    h = _ServerHarness(pool, head=4, step=step)
    eng, ns, slot = h.engine, h.ns, h.slot

    async def run():
        reg = await h.register()
        ix = h.srv.index
        ks = [b"%016d" % i for i in range(12)]
        refs = ix.reserve(ns, 12, 7, 0.0)
        n = len(h.replies)
        h.dispatch(p.StoreRequest(3, reg, 1, list(range(12)), refs, keys=ks))
        assert eng.seen == (12, 0) and eng.late is not None and eng.late.head == 4
        assert eng.late.offsets is not None and len(eng.late.offsets) == 12
        assert ix.ticket_count == 0 and ix.slot_counts()[0] == 12
        bound = [ix.stores.bound[r] for r in refs]
        want = np.array([s.offset for s in bound], np.int64)
        assert np.array_equal(eng.offsets[:4], want[:4])      # at submission: the head
        eng.late.wait()                                       # ready: returns at once
        assert np.array_equal(eng.late.offsets, want)
        if step:
            assert [a[0] for a in eng.advanced] == [step]
            upto, offsets, tickets = eng.advanced[0]
            assert np.array_equal(offsets, want[:step]) and tickets == 12   # none bound yet
        else:
            assert eng.advanced == []
        assert [s.block_hash for s in bound] == ks and all(s.pins == 1 for s in bound)
        eng.progress(4)
        await wait_for_async(lambda: ix.leading(ns, ks) == 4, 10, "the head's commit")
        eng.fut.set_result(JobResult(12 * slot))
        assert (await h.reply_after(n)).code == 0 and ix.leading(ns, ks) == 12
        # room assured, yet none found for the rest (a broken promise): the engine is told
        h.srv.index.room.assured = lambda cls, k: True
        free = ix.room.allocate
        calls: list[int] = []        # the head's room only
        ix.room.allocate = lambda cls, k: free(cls, k) if not calls.append(k) and \
            len(calls) == 1 else []
        more = [b"%016d" % i for i in range(100, 112)]
        refs = ix.reserve(ns, 12, 7, 0.0)
        used = ix.namespaces.used_bytes_of(ns)
        n = len(h.replies)
        h.dispatch(p.StoreRequest(4, reg, 2, list(range(12)), refs, keys=more))
        with pytest.raises(Aborted, match="no room for the whole store: stored its first 4 "):
            eng.late.wait()
        assert eng.advanced == [], "an advance past room that was not found"
        try:
            eng.late.wait()
        except Aborted as e:
            eng.fut.set_exception(e)                          # as an engine ends such a job
        assert (await h.reply_after(n)).code == int(ErrorCode.ABORTED)
        assert ix.ticket_count == 0 and ix.slot_counts()[0] == 0
        assert ix.namespaces.used_bytes_of(ns) == used and ix.leading(ns, more) == 0
        assert ix.pinned_count() == 0
        ix.stores.expire(0.0)             # housekeeping forgets the dropped slots' bindings
        assert ix.stores.bound == {}

    asyncio.run(run())


def test_a_late_load_whose_worker_goes_before_its_rest_is_aborted_and_pins_nothing(pool):
    """A late load whose rest is not all in the pool waits for its head to land, then loads
    the rest as a job of its own; where the worker unregistered meanwhile, the job is answered
    ABORTED instead, and neither the head's pins nor anything else is left behind."""
    import asyncio

    from kvpool.daemon.copy_engine import JobResult
    from kvpool.shared.errors import Aborted

    h = _ServerHarness(pool, load_head=4)
    eng, ns, slot = h.engine, h.ns, h.slot

    async def run():
        reg = await h.register()
        ix = h.srv.index
        ks = [b"%016d" % i for i in range(16)]
        n = len(h.replies)
        h.dispatch(p.StoreRequest(3, reg, 1, list(range(16)), ix.reserve(ns, 16, 7, 0.0),
                                  keys=ks))
        eng.fut.set_result(JobResult(16 * slot))
        assert (await h.reply_after(n)).code == 0
        refs = ix.lookup(ns, [ks], False, 7, 0.0)[2][0]
        refs[9] ^= 1 << 40                  # gone since the lookup: the rest is not all there
        n = len(h.replies)
        h.dispatch(p.LoadRequest(4, reg, 2, refs, list(range(16))))
        assert len(h.replies) == n and eng.load_late.head == 4
        assert ix.pinned_count() == 4                      # the head, copying
        with pytest.raises(Aborted) as rest:
            eng.load_late.wait()                           # the rest goes its own way
        h.dispatch(p.UnregisterRequest(5, reg))            # the worker goes meanwhile
        eng.load_fut.set_exception(rest.value)             # the head landed
        await wait_for_async(lambda: any(getattr(r, "job_id", None) == 2
                                         for r in h.replies[n:]), 10, "the load's reply")
        done = next(r for r in h.replies[n:] if getattr(r, "job_id", None) == 2)
        assert done.code == int(ErrorCode.ABORTED) and "disconnected" in done.message
        assert ix.pinned_count() == 0
        assert ix.lookup(ns, [ks], False, 7, 0.0)[0] == [16]   # nothing committed was lost

    asyncio.run(run())
