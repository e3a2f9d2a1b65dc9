"""daemon/disk_store.py: the disk tier's files, without a daemon: round trips, what a restart
finds, torn records, wrong keys, short files, privacy and the directory lock."""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np
import pytest

from kvpool.daemon.disk_store import RECORD_DTYPE, DiskBusy, DiskStore
from kvpool.shared.errors import ConfigError

S = 8192


@pytest.fixture
def pool():
    buf = mmap.mmap(-1, 64 * S)
    buf.write(os.urandom(64 * S))
    yield buf
    buf.close()


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag * 16 + i.to_bytes(16, "little") for i in range(n)]


def write(store: DiskStore, idx: list[int], offsets: list[int], ks: list[bytes]) -> np.ndarray:
    return store.write(S, np.asarray(idx, np.int64), np.asarray(offsets, np.int64) * S, ks,
                       np.arange(1, len(ks) + 1, dtype=np.uint64), np.zeros(0, np.int64))


def test_blocks_round_trip_and_a_restart_finds_their_records(tmp_path, pool):
    store = DiskStore.open(str(tmp_path / "d"), pool)
    ks = keys(8)
    # scattered pool slots, two runs of disk indices
    sums = write(store, [0, 1, 2, 3, 10, 11, 12, 13], [5, 9, 1, 30, 2, 3, 4, 6], ks)
    want = [bytes(pool[o * S:(o + 1) * S]) for o in [5, 9, 1, 30, 2, 3, 4, 6]]
    pool[40 * S:48 * S] = bytes(8 * S)
    ok = store.read(S, np.asarray([0, 1, 2, 3, 10, 11, 12, 13]), np.arange(40, 48) * S, ks, sums)
    assert ok.all()
    assert [bytes(pool[o * S:(o + 1) * S]) for o in range(40, 48)] == want
    store.close()
    store = DiskStore.open(str(tmp_path / "d"), pool)
    [found] = store.scan()
    assert found.slot_bytes == S and found.file_blocks == 14
    assert found.indices.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert [bytes(k) for k in found.records["key"]] == ks
    assert found.records["checksum"].tolist() == sums.tolist()
    store.close()


def test_torn_records_short_files_and_wrong_keys_are_never_blocks(tmp_path, pool):
    d = tmp_path / "d"
    store = DiskStore.open(str(d), pool)
    ks = keys(6)
    sums = write(store, list(range(6)), list(range(6)), ks)
    store.close()
    with open(d / f"blocks-{S}.idx", "r+b") as f:      # a torn record: one byte of its key
        f.seek(2 * RECORD_DTYPE.itemsize + 3)
        f.write(b"\xee")
    os.truncate(d / f"blocks-{S}.dat", 5 * S)          # the last block's data is gone
    store = DiskStore.open(str(d), pool)
    [found] = store.scan()
    assert found.indices.tolist() == [0, 1, 3, 4]
    # Bytes that are another key's (a record left over a reused index) fail verification,
    # and so does a read past the end of the file.
    swapped = [ks[1], ks[0], ks[2], ks[3], ks[4], ks[5]]
    ok = store.read(S, np.arange(6), np.arange(20, 26) * S, swapped, sums)
    assert ok.tolist() == [False, False, True, True, True, False]
    store.close()


def test_freed_blocks_lose_their_records(tmp_path, pool):
    d = tmp_path / "d"
    store = DiskStore.open(str(d), pool)
    write(store, list(range(4)), list(range(4)), keys(4))
    store.free(S, np.asarray([1, 2]))
    assert store.scan()[0].indices.tolist() == [0, 3]
    assert os.stat(d / f"blocks-{S}.dat").st_blocks * 512 <= 2 * S   # holes punched
    store.close()


def test_the_directory_is_private_locked_and_ours(tmp_path, pool):
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    store = DiskStore.open(str(d), pool)
    write(store, [0], [0], keys(1))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in d.iterdir())
    with pytest.raises(DiskBusy, match="another running kvpoold"):
        DiskStore.open(str(d), pool)
    store.close()
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to uid 12345"):
        DiskStore.open(str(other), pool)


def test_written_data_has_no_record_until_a_group_commit_makes_it_durable(tmp_path, pool,
                                                                         monkeypatch):
    """``write_data`` leaves no record; one ``commit`` of several batches flushes the data once,
    then writes their records, then flushes those once: a record never precedes its data."""
    import kvpool.daemon.disk_store as disk_store
    store = DiskStore.open(str(tmp_path / "d"), pool)
    a, b = keys(3, b"a"), keys(2, b"b")
    sums_a = store.write_data(S, np.arange(3), np.arange(3) * S, a, np.zeros(0, np.int64))
    sums_b = store.write_data(S, np.arange(3, 5), np.arange(10, 12) * S, b,
                              np.zeros(0, np.int64))
    assert not store.scan()[0].indices.size           # data written, nothing recorded
    files = store._open(S)
    steps: list[str] = []
    real_sync, real_put = disk_store.os.fdatasync, DiskStore._put_records
    monkeypatch.setattr(disk_store.os, "fdatasync", lambda fd: (
        steps.append({files.data_fd: "sync data", files.idx_fd: "sync records"}[fd]),
        real_sync(fd))[1])
    monkeypatch.setattr(DiskStore, "_put_records", lambda self, f, idx, rec: (
        steps.append(f"records {idx.tolist()}"), real_put(self, f, idx, rec))[1])
    store.commit(S, [(np.arange(3), a, sums_a, np.arange(1, 4, dtype=np.uint64)),
                     (np.arange(3, 5), b, sums_b, np.arange(4, 6, dtype=np.uint64))])
    assert steps == ["sync data", "records [0, 1, 2, 3, 4]", "sync records"]
    monkeypatch.undo()
    store.close()
    store = DiskStore.open(str(tmp_path / "d"), pool)
    [found] = store.scan()
    assert [bytes(k) for k in found.records["key"]] == a + b
    assert found.records["checksum"].tolist() == sums_a.tolist() + sums_b.tolist()
    ok = store.read(S, np.arange(5), np.arange(40, 45) * S, a + b, found.records["checksum"])
    assert ok.all()
    store.close()
