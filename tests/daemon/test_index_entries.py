"""The index's two writers (daemon/_index_writer.c, compiled, and daemon/index_entries.py, its
reference): the same operations leave the same entries, and bad input is refused with a clear
error before anything is written."""

import mmap
import random

import numpy as np
import pytest

from kvpool.daemon.index_entries import PythonEntries
from kvpool.shared import index_format as f

CAPACITY = 4096
LIMIT = 3072
NS = b"N" * 16


def _segment() -> mmap.mmap:
    return mmap.mmap(-1, f.HEADER_BYTES + CAPACITY * f.ENTRY_BYTES)


def _entries(buf: mmap.mmap) -> np.ndarray:
    """Each entry's location, ref and key words (sequence numbers differ between writers: the
    Python one writes a batch's moves once, the compiled one at each move)."""
    t = np.frombuffer(buf, np.uint64, CAPACITY * f.ENTRY_WORDS, f.HEADER_BYTES)
    t = t.reshape(CAPACITY, f.ENTRY_WORDS).copy()
    t[:, 0] &= np.uint64(0xFF)
    return t


def _published(buf: mmap.mmap) -> int:
    return int(np.frombuffer(buf, np.uint64, 1, f.H_PUBLISHED[0])[0])


@pytest.fixture
def writers(compiled_index_writer):
    bufs = [_segment(), _segment()]
    made = [compiled_index_writer.Writer(bufs[0], CAPACITY, LIMIT),
            PythonEntries(bufs[1], CAPACITY, LIMIT)]
    yield made, bufs
    for w in made:
        w.close()
    for b in bufs:
        b.close()


def test_the_compiled_writer_leaves_the_entries_the_python_one_does(writers):
    """Random batches of puts (new keys, moved keys, keys past the limit) and removals (whose
    shifts move entries other removals of the batch moved) at up to the load limit."""
    (compiled, python), (cbuf, pbuf) = writers
    rng = random.Random(3)
    hashes = [NS + rng.randbytes(16) for _ in range(4000)]
    for step in range(400):
        batch = [hashes[i] for i in rng.sample(range(4000), rng.randrange(1, 500))]
        if rng.random() < 0.25:
            for w in writers[0]:
                w.remove_many(batch)
        else:
            where = rng.choice([f.POOL, f.DISK, f.REMOTE])
            refs = [rng.getrandbits(64) for _ in batch]
            assert compiled.put_many(batch, where, refs) == python.put_many(batch, where, refs)
        assert (compiled.published, compiled.unpublished) == (python.published,
                                                              python.unpublished), step
        if step % 20 == 0 or step == 399:
            assert np.array_equal(_entries(cbuf), _entries(pbuf)), f"step {step}"
            assert _published(cbuf) == _published(pbuf) == python.published
    assert python.unpublished > 0, "the run reached the load limit"
    for k in hashes[:200]:
        assert compiled.entry_of(k) == python.entry_of(k)
        assert compiled.location(k) == python.location(k)
    # every entry's state is even: no write was left open
    states = np.frombuffer(cbuf, np.uint64, CAPACITY * f.ENTRY_WORDS, f.HEADER_BYTES)[::6]
    assert not (states & np.uint64(0x100)).any()


@pytest.mark.parametrize("bad, why", [
    (lambda w: w.put_many([NS + b"x" * 15], f.POOL, [1]), "keys"),
    (lambda w: w.put_many([NS + b"x" * 16, "not bytes"], f.POOL, [1, 2]), "keys"),
    (lambda w: w.put_many([NS + b"y" * 16], f.POOL, [1, 2]), "refs"),
    (lambda w: w.put_many([NS + b"y" * 16], f.POOL, [-1]), "refs"),
    (lambda w: w.put_many([NS + b"y" * 16], f.EMPTY, [1]), "location"),
    (lambda w: w.put_many([NS + b"y" * 16], 256, [1]), "location"),
    (lambda w: w.remove_many([NS + b"x" * 16, b"short"]), "keys"),
    (lambda w: w.location(b"short"), "key"),
    (lambda w: w.entry_of(b"short"), "key"),
])
def test_bad_input_is_refused_and_changes_nothing(compiled_index_writer, bad, why):
    buf = _segment()
    w = compiled_index_writer.Writer(buf, CAPACITY, LIMIT)
    kept = NS + b"x" * 16
    assert w.put_many([kept], f.POOL, [7]) == 1
    before = _entries(buf)
    with pytest.raises((ValueError, TypeError), match=why):
        bad(w)
    assert np.array_equal(_entries(buf), before) and w.published == 1
    assert w.location(kept) == f.POOL
    w.close()
    buf.close()


@pytest.mark.parametrize("args, why", [
    ((CAPACITY, CAPACITY), "limit"),          # a full table would never end a probe
    ((CAPACITY, -1), "limit"),
    ((3000, 100), "power of two"),
    ((CAPACITY * 2, 100), "needs"),           # a mapping too short for the entries
])
def test_a_writer_over_a_wrong_segment_is_refused(compiled_index_writer, args, why):
    buf = _segment()
    with pytest.raises(ValueError, match=why):
        compiled_index_writer.Writer(buf, *args)
    buf.close()                                # nothing of the failed writer pins it


def test_a_closed_writer_refuses_work_and_frees_the_mapping(compiled_index_writer):
    buf = _segment()
    w = compiled_index_writer.Writer(buf, CAPACITY, LIMIT)
    with pytest.raises(BufferError):
        buf.close()                            # the writer's view pins the mapping...
    w.close()
    buf.close()                                # ...until it is closed
    with pytest.raises(ValueError, match="closed"):
        w.put_many([NS + b"x" * 16], f.POOL, [1])


def test_the_python_writer_refuses_bad_keys_and_limits():
    buf = _segment()
    with pytest.raises(ValueError, match="limit"):
        PythonEntries(buf, CAPACITY, CAPACITY)
    w = PythonEntries(buf, CAPACITY, LIMIT)
    with pytest.raises(ValueError, match="32 bytes"):
        w.put_many([NS + b"x" * 16, b"short"], f.POOL, [1, 2])
    assert w.published == 0
    w.close()
    buf.close()
