"""The shared-memory index's writer (daemon/index_segment.py), read back by the scheduler's
reader (client/index_reader.py) in the same process: entries, clusters and their deletion,
a full table, superseding, and what KeyLocations publishes for the pool and the tiers."""

import os
import random
import secrets

import numpy as np
import posix_ipc
import pytest

from kvpool.client.index_reader import IndexReader
from kvpool.daemon.index_segment import IndexSegment, KeyLocations, capacity_for
from kvpool.shared import index_format as f

# Every test here runs with the compiled probe and with numpy's, and with the compiled writer
# and the Python one.
pytestmark = pytest.mark.usefixtures("index_probe", "index_writer")

NS = b"N" * 16


def key(i: int, ns: bytes = NS) -> bytes:
    return ns + i.to_bytes(8, "little") + b"\x5a" * 8


@pytest.fixture
def segment():
    seg = IndexSegment(f"/kvpool-test-index-{os.getpid()}-{secrets.token_hex(4)}", 4096, "d1")
    yield seg
    seg.close()


def test_every_put_is_found_with_its_location_and_ref_and_removed_ones_are_not(segment):
    reader = IndexReader.open(segment.name)
    rng = random.Random(5)
    live: dict[int, tuple[int, int]] = {}
    for step in range(20_000):              # random puts, moves and removals: long clusters
        i = rng.randrange(3000)
        if i in live and rng.random() < 0.5:
            segment.remove(key(i))
            del live[i]
        elif len(live) < 3000:
            where = rng.choice([f.POOL, f.DISK, f.REMOTE])
            ref = rng.getrandbits(63) if where == f.POOL else 0
            assert segment.put(key(i), where, ref)
            live[i] = (where, ref)
        if step % 2000 == 0:
            hashes = [key(i)[16:] for i in range(3000)]
            loc, ref = reader.find(NS, hashes)
            got = {i: (int(loc[i]), int(ref[i])) for i in range(3000) if loc[i] != f.EMPTY}
            assert got == live
    assert len(segment) == len(live)
    assert reader.find(b"M" * 16, [key(i)[16:] for i in live])[0].max() == 0, "another ns"
    reader.close()


def test_batched_puts_and_removals_leave_what_the_same_single_ones_would(segment):
    """put_many and remove_many (the store path's batches: one removal's shift can move an
    entry another removal of the batch moved already) against a model; random hashes at up to
    3/4 load make clusters dozens of entries long."""
    reader = IndexReader.open(segment.name)
    rng = random.Random(11)
    hashes = [rng.randbytes(16) for _ in range(3000)]
    live: dict[int, tuple[int, int]] = {}
    for step in range(300):
        batch = rng.sample(range(3000), rng.randrange(1, 600))
        gone = [i for i in batch if i in live and rng.random() < 0.2]
        segment.remove_many([NS + hashes[i] for i in gone])
        for i in gone:
            del live[i]
        came = [i for i in batch if i not in gone][:3000 - len(live)]
        where = rng.choice([f.POOL, f.DISK])
        refs = [rng.getrandbits(63) if where == f.POOL else 0 for _ in came]
        assert segment.put_many([NS + hashes[i] for i in came], where, refs) == len(came)
        live.update({i: (where, r) for i, r in zip(came, refs)})
        if step % 30 == 0 or step == 299:
            loc, ref = reader.find(NS, hashes)
            got = {i: (int(loc[i]), int(ref[i])) for i in range(3000) if loc[i] != f.EMPTY}
            assert got == live, f"step {step}"
    assert len(segment) == len(live)
    reader.close()


def test_a_run_of_leading_hits_stops_at_the_first_miss(segment):
    reader = IndexReader.open(segment.name)
    for i in (0, 1, 2, 4):
        segment.put(key(i), f.POOL, 100 + i)
    n, loc, ref = reader.leading(NS, [key(i)[16:] for i in range(6)])
    assert n == 3 and loc.tolist() == [f.POOL] * 3 and ref.tolist() == [100, 101, 102]
    assert reader.leading_lists(NS, [key(i)[16:] for i in range(6)]) == \
        (3, [100, 101, 102], [f.POOL] * 3)
    assert reader.leading_lists(NS, tuple(key(i)[16:] for i in range(6)))[0] == 3, "a tuple"
    assert reader.leading(NS, [])[0] == 0 and reader.leading_lists(NS, []) == (0, [], [])
    reader.close()


def test_a_record_stopped_half_written_is_never_a_hit(segment):
    """The writer dies (or is preempted) between the odd and the even sequence store: the
    entry's body may say anything, the reader must miss it."""
    reader = IndexReader.open(segment.name)
    segment.put(key(1), f.POOL, 7)
    i = segment.entry_of(key(1))
    words = memoryview(segment._buf)[f.HEADER_BYTES:].cast("Q")
    base = i * f.ENTRY_WORDS
    seq = words[base] >> 8
    words[base] = ((seq + 1) << 8) | f.POOL          # odd: a write began...
    words[base + 1] = 99                             # ...and got this far
    assert reader.find(NS, [key(1)[16:]])[0].tolist() == [f.EMPTY]
    words[base] = ((seq + 2) << 8) | f.POOL          # finished
    assert reader.find(NS, [key(1)[16:]])[1].tolist() == [99]
    words.release()
    reader.close()


def test_a_full_table_leaves_new_keys_unpublished_and_counts_them(segment):
    cap = int(0.75 * segment.capacity)
    for i in range(cap):
        assert segment.put(key(i), f.POOL, i + 1)
    assert not segment.put(key(cap), f.POOL, 1) and segment.unpublished == 1
    assert segment.put(key(0), f.DISK)               # a published key still moves
    reader = IndexReader.open(segment.name)
    loc, _ = reader.find(NS, [key(i)[16:] for i in range(cap + 1)])
    assert loc[0] == f.DISK and (loc[1:cap] == f.POOL).all() and loc[cap] == f.EMPTY
    reader.close()


def test_a_new_segment_of_the_same_name_supersedes_the_mapped_one():
    name = f"/kvpool-test-index-{os.getpid()}-{secrets.token_hex(4)}"
    first = IndexSegment(name, 4096, "life-1")
    first.put(key(1), f.POOL, 5)
    reader = IndexReader.open(name)
    assert reader.daemon_id == "life-1" and not reader.superseded
    # The first daemon was killed: nothing closed it. The next one takes the name over.
    second = IndexSegment(name, 8192, "life-2")
    try:
        assert reader.superseded and reader.find(NS, [key(1)[16:]]) is None
        again = IndexReader.open(name)
        assert again.daemon_id == "life-2" and again.capacity == 8192
        assert again.find(NS, [key(1)[16:]])[0].tolist() == [f.EMPTY]
        again.close()
    finally:
        second.close()
        reader.close()
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(name, 0)              # closed: unlinked


def test_the_segment_has_the_mode_asked_for_and_readers_cannot_write(segment):
    st = os.fstat(posix_ipc.SharedMemory(segment.name, 0, read_only=True).fd)
    assert st.st_mode & 0o777 == 0o600
    reader = IndexReader.open(segment.name)
    with pytest.raises(TypeError):
        reader._buf[0] = 1                            # mapped read-only
    reader.close()


def test_capacity_is_sized_from_the_pool_and_the_disk():
    assert capacity_for(8 << 20, 0) == 4096
    assert capacity_for(64 << 30, 0) == 1 << 22
    assert capacity_for(1 << 30, 1 << 30) == 1 << 18
    assert capacity_for(1 << 30, 0, setting=5000) == 8192


class _Tier:
    def __init__(self, name, holds=()):
        self.name, self.is_enabled, self.holds = name, True, set(holds)

    def leading(self, ns, hashes, slot_bytes):
        return int(ns + hashes[0] in self.holds)


class _Slot:
    def __init__(self, k, ref):
        self.key, self.ref, self.ns = k, ref, k[:16]


class _Namespaces:
    layouts = {NS: type("L", (), {"slot_bytes": 4096})()}


def test_key_locations_publish_the_pool_first_then_the_first_tier_that_holds_a_key(segment):
    disk, remote = _Tier("disk"), _Tier("remote")
    loc = KeyLocations(segment, _Namespaces(), [disk, remote])
    a, b, c = key(1), key(2), key(3)
    loc.committed([_Slot(a, 11), _Slot(b, 12)])
    disk.holds |= {a}
    loc.tier_holds(disk, [a, c])                      # a stays in the pool; c is on disk
    remote.holds |= {a, c}
    loc.tier_holds(remote, [a, c])
    assert [segment.location(k) for k in (a, b, c)] == [f.POOL, f.POOL, f.DISK]
    loc.removed([_Slot(a, 11), _Slot(b, 12)])         # evicted from the pool
    assert [segment.location(k) for k in (a, b)] == [f.DISK, f.EMPTY]
    disk.holds -= {a, c}
    loc.tier_dropped(disk, [a, c])
    assert [segment.location(k) for k in (a, c)] == [f.REMOTE, f.REMOTE]
    remote.holds.clear()
    loc.tier_dropped(remote, [a, c])
    assert len(segment) == 0


def test_the_reader_hashes_keys_as_the_writer_does():
    rng = np.random.default_rng(3)
    for bits in (12, 16, 22):
        keys = [rng.bytes(32) for _ in range(200)]
        want = [f.home(k, bits) for k in keys]
        hw = np.frombuffer(b"".join(k[16:] for k in keys), np.uint64).reshape(-1, 2)
        nsw = np.frombuffer(b"".join(k[:16] for k in keys), np.uint64).reshape(-1, 2)
        folded = hw[:, 0] ^ hw[:, 1] ^ nsw[:, 0] ^ nsw[:, 1]
        folded ^= folded >> np.uint64(32)
        with np.errstate(over="ignore"):
            got = (folded * np.uint64(f.HASH_MULTIPLIER)) >> np.uint64(64 - bits)
        assert got.tolist() == want


def test_keys_that_are_not_uniform_hashes_spread_over_the_table(segment):
    """Counter keys (a client's own, a benchmark's: b"%016d") share their first word. Homes
    fold every word, so they spread as hashes do: short clusters (an insert or a removal
    walks a few entries, where one shared home made each walk the whole cluster and an
    eviction of 1024 of them stalled the daemon's loop for 5 s), and the reader finds each."""
    reader = IndexReader.open(segment.name)
    keys = [NS + b"%016d" % i for i in range(3000)]          # 73% of the table
    for i, k in enumerate(keys):
        assert segment.put(k, f.POOL, i + 1)
    walks = [(segment.entry_of(k) - f.home(k, segment.bits)) & (segment.capacity - 1)
             for k in keys]
    assert max(walks) < f.MAX_PROBE and sum(walks) / len(walks) < 4, \
        f"clusters too long: mean walk {sum(walks) / len(walks):.1f}, longest {max(walks)}"
    loc, ref = reader.find(NS, [k[16:] for k in keys])
    assert (loc == f.POOL).all() and ref.tolist() == list(range(1, 3001))
    reader.close()


def test_leading_runs_follow_displaced_keys_and_stop_at_the_first_miss(segment):
    """A table 3/4 full: most keys sit past their home entry. The leading run of any list is
    exactly its keys up to the first one not published, wherever in their clusters they sit."""
    reader = IndexReader.open(segment.name)
    rng = random.Random(9)
    published = set(rng.sample(range(4000), 3000))
    for i in published:
        segment.put(key(i), f.POOL, i + 1)
    for _ in range(300):
        ids = rng.sample(range(4000), rng.randrange(1, 64))
        ids.sort(key=lambda i: i not in published)   # mostly hits first, then misses
        want = next((n for n, i in enumerate(ids) if i not in published), len(ids))
        n, loc, ref = reader.leading(NS, [key(i)[16:] for i in ids])
        assert n == want and ref.tolist() == [i + 1 for i in ids[:n]]
        assert reader.leading_lists(NS, [key(i)[16:] for i in ids]) == \
            (want, [i + 1 for i in ids[:n]], [f.POOL] * n)
    reader.close()


def test_evicted_keys_leave_the_index_after_the_current_callback_in_order(segment):
    """With ``defer`` (the loop's call_soon) a store that evicts launches its copy before the
    victims leave the index; any other change first withdraws what is pending, so the
    segment sees changes in the order they were made."""
    later: list = []
    disk = _Tier("disk")
    loc = KeyLocations(segment, _Namespaces(), [disk], defer=later.append)
    a, b, c = key(1), key(2), key(3)
    loc.committed([_Slot(a, 11), _Slot(b, 12)])
    loc.removed([_Slot(a, 11)])
    loc.removed([_Slot(b, 12)])
    assert len(later) == 1, "one deferred withdrawal per callback, however many evictions"
    assert [segment.location(k) for k in (a, b)] == [f.POOL, f.POOL]
    later.pop()()
    assert [segment.location(k) for k in (a, b)] == [f.EMPTY, f.EMPTY]
    loc.committed([_Slot(a, 21)])
    loc.removed([_Slot(a, 21)])
    loc.committed([_Slot(a, 31), _Slot(c, 32)])     # a came back before the callback ended
    assert [segment.location(k) for k in (a, c)] == [f.POOL, f.POOL]
    disk.holds |= {b}
    loc.removed([_Slot(c, 32)])
    loc.tier_holds(disk, [b])                        # withdraws c first, then publishes b
    assert [segment.location(k) for k in (b, c)] == [f.DISK, f.EMPTY]
    later.pop()()                                    # nothing left to do: a stays
    assert segment.location(a) == f.POOL



def _minor_faults() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_large_tables_pages_are_mapped_at_start_so_no_put_takes_a_page_fault(
        index_writer, index_probe):
    """Keys land at random places of a table sized for the smallest blocks: each fresh key's
    first touch of its entry's page (and its mirror's) was a page fault on the event loop.
    Counted as faults (an operation count), on a table of 2**20 entries."""
    if index_writer == "python" or index_probe == "numpy":
        pytest.skip("the compiled writer prefaults (the Python one is the slow fallback)")
    seg = IndexSegment(f"/kvpool-test-index-{os.getpid()}-{secrets.token_hex(4)}", 1 << 20, "d1")
    try:
        seg.prefault_wait()
        keys = [key(i) for i in range(1024)]
        before = _minor_faults()
        assert seg.put_many(keys, f.POOL, list(range(1024))) == 1024
        seg.remove_many(keys[::2])
        faults = _minor_faults() - before
        # (a page of Python objects may fault; 1024 random entries of a 48 MiB table and its
        # mirror would take one or two each)
        assert faults < 32, f"{faults} page faults for 1024 puts into a prefaulted table"
        reader = IndexReader.open(seg.name)
        try:
            loc, _ = reader.find(NS, [k[16:] for k in keys[:4]])
            assert list(loc) == [f.EMPTY, f.POOL, f.EMPTY, f.POOL]
        finally:
            reader.close()
    finally:
        seg.close()


def test_a_segment_closed_while_its_pages_are_still_being_mapped_waits_for_them():
    seg = IndexSegment(f"/kvpool-test-index-{os.getpid()}-{secrets.token_hex(4)}", 1 << 21, "d1")
    seg.put_many([key(1)], f.POOL, [7])
    seg.close()                     # joins the prefault before the mapping goes
    assert seg._buf.closed


def test_a_readers_lookups_take_no_page_faults_once_its_mapping_is_read_through(index_probe):
    """The scheduler's side: a lookup on a fresh mapping of a large table faulted on most of
    its probes (each key's entry on a page of its own)."""
    seg = IndexSegment(f"/kvpool-test-index-{os.getpid()}-{secrets.token_hex(4)}", 1 << 20, "d1")
    try:
        keys = [key(i) for i in range(2048)]
        seg.put_many(keys, f.POOL, list(range(2048)))
        reader = IndexReader.open(seg.name)
        try:
            reader.prefault_wait()
            hashes = [k[16:] for k in keys]
            before = _minor_faults()
            for i in range(0, 2048, 256):
                reader.leading(NS, hashes[i:i + 256])
            loc, ref = reader.find(NS, hashes[:256])
            faults = _minor_faults() - before
            assert list(loc) == [f.POOL] * 256 and list(ref) == list(range(256))
            assert faults < 32, f"{faults} page faults for 2304 probes of a read-through table"
        finally:
            reader.close()
    finally:
        seg.close()
