import os

import posix_ipc
import pytest

from kvpool.daemon.pool import COMMITTED, Pool, PoolBusy, resolve_sizes
from kvpool.shared.config import DaemonConfig
from kvpool.shared.errors import ConfigError
from kvpool.shared.layout import Layout


def test_segment_is_private_and_sized(pool, pool_config):
    st = os.stat(f"/dev/shm/{pool_config.pool_name}")
    assert st.st_mode & 0o777 == 0o600
    assert pool.nbytes <= 8 << 20 and pool.geometry.num_extents >= 4
    assert not pool.adopted


def test_second_live_daemon_on_the_same_pool_is_refused(pool, pool_config):
    with pytest.raises(PoolBusy, match="another running kvpoold"):
        Pool.open(pool_config)


def test_adopt_after_close_keeps_records_and_layouts(pool_config):
    p = Pool.open(pool_config)
    layout = Layout(16, 1, "f16", (4096,))
    p.save_layouts({b"n" * 16: layout})
    n = p.assign_extent(0, layout.slot_bytes)
    p.buffer[p.slot_offset(0, 3):p.slot_offset(0, 3) + 4] = b"data"
    p.commit_records([3], [b"n" * 16 + b"k" * 16], [5])
    p.close(unlink=False)
    q = Pool.open(pool_config)
    try:
        assert q.adopted and q.load_layouts() == {b"n" * 16: layout}
        rec = q.records(0)
        assert len(rec) == n and int(rec[3]["state"]) == COMMITTED
        assert bytes(rec[3]["key"]) == b"n" * 16 + b"k" * 16 and int(rec[3]["generation"]) == 5
        assert bytes(q.buffer[q.slot_offset(0, 3):q.slot_offset(0, 3) + 4]) == b"data"
    finally:
        q.close(unlink=True)


def test_stale_segment_with_other_geometry_or_garbage_is_replaced(pool_config):
    p = Pool.open(pool_config)
    p.close(unlink=False)
    bigger = DaemonConfig(pool_name=pool_config.pool_name, pool_size="16MiB", extent_size="1MiB")
    q = Pool.open(bigger)
    assert not q.adopted and q.nbytes > 8 << 20
    q.close(unlink=False)
    shm = posix_ipc.SharedMemory("/" + pool_config.pool_name, 0)
    os.pwrite(shm.fd, b"garbage!" * 8, 0)
    shm.close_fd()
    r = Pool.open(bigger)
    assert not r.adopted
    r.close(unlink=True)


def test_an_auto_sized_pool_is_adopted_whatever_memory_is_free_now(pool_config, monkeypatch):
    """An auto size is computed once: at the next start the pool's own pages count as taken,
    so computed again it would come out smaller and the kept cache would be replaced."""
    from kvpool.daemon import pool as pool_mod
    auto = DaemonConfig(pool_name=pool_config.pool_name, pool_size="auto", extent_size="auto")
    monkeypatch.setattr(pool_mod, "available_memory_bytes", lambda: 96 << 20)
    p = Pool.open(auto)
    first = p.geometry
    p.close(unlink=False)
    monkeypatch.setattr(pool_mod, "available_memory_bytes", lambda: 48 << 20)
    q = Pool.open(auto)
    try:
        assert q.adopted and q.geometry == first
    finally:
        q.close(unlink=True)


def test_a_pool_that_does_not_fit_dev_shm_is_refused_before_it_is_made(pool_config):
    from kvpool.daemon.pool import check_room
    shm = os.statvfs("/dev/shm")
    too_big = DaemonConfig(pool_name=pool_config.pool_name,
                           pool_size=str(shm.f_bavail * shm.f_frsize + (1 << 30)))
    with pytest.raises(ConfigError, match=r"pool_size: the pool needs .* GiB of /dev/shm but "
                                          r"only .* GiB is free there: lower pool_size"):
        check_room(too_big)
    check_room(pool_config)


def test_a_pool_of_another_user_is_named_not_a_traceback(pool_config):
    """(What two users met with one host-wide default name; tests/integration/test_users.py
    runs the real thing.)"""
    if os.geteuid() != 0:
        pytest.skip("needs root, to open root's segment as another user")
    p = Pool.open(pool_config)
    p.close(unlink=False)
    try:
        pid = os.fork()
        if pid == 0:               # as nobody: root's segment is 0600
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                Pool.open(pool_config)
            except PoolBusy as e:
                code = 0 if "belongs to another user (root, uid 0): choose another " \
                             "pool_name" in str(e) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        posix_ipc.unlink_shared_memory("/" + pool_config.pool_name)


def test_sizes():
    assert resolve_sizes(DaemonConfig(pool_size="64GiB")) == (64 << 30, 256 << 20)
    assert resolve_sizes(DaemonConfig(pool_size="3GiB")) == (3 << 30, 16 << 20)
    assert resolve_sizes(DaemonConfig(pool_size="64MiB", extent_size="1MiB")) == (64 << 20, 1 << 20)
    pool, extent = resolve_sizes(DaemonConfig())
    assert pool > 0 and extent >= 4 << 20
    for size, extent in (("4MiB", "4MiB"), ("2MiB", "1MiB"), ("1MiB", "256KiB")):
        with pytest.raises(ConfigError, match="too small"):
            resolve_sizes(DaemonConfig(pool_size=size, extent_size=extent))


def test_tp_cross_format1_pool_is_migrated_on_adopt(pool_config, caplog):
    """A pool written before head-split slots (format 1: rank-sharded layouts only, encoded
    with five fields) is adopted with its blocks, and marked format 2 so an older daemon no
    longer adopts it."""
    import logging

    import msgspec
    p = Pool.open(pool_config)
    old = Layout(16, 2, "f16", (4096,), "tp2 before heads")
    blob = msgspec.msgpack.encode({b"n" * 16: [16, 2, "f16", [4096], "tp2 before heads"]})
    off = p.geometry.layout_table_offset
    p.buffer[off:off + len(blob)] = blob
    p.header[0]["layout_blob_bytes"] = len(blob)
    p.assign_extent(0, old.slot_bytes)
    p.commit_records([1], [b"n" * 16 + b"k" * 16], [3])
    p.header[0]["format_version"] = 1
    p.close(unlink=False)
    with caplog.at_level(logging.WARNING, logger="kvpool.daemon.pool"):
        q = Pool.open(pool_config)
    try:
        assert q.adopted and q.load_layouts() == {b"n" * 16: old}
        assert int(q.header[0]["format_version"]) == 2
        assert int(q.records(0)[1]["state"]) == COMMITTED
        assert "was format 1: migrated in place to format 2" in caplog.text
    finally:
        q.close(unlink=False)
    r = Pool.open(pool_config)             # adopted again as format 2, nothing more to say
    assert r.adopted
    r.close(unlink=True)


def test_tp_cross_pool_of_an_unknown_format_is_replaced_with_a_clear_log_line(pool_config,
                                                                               caplog):
    import logging
    p = Pool.open(pool_config)
    p.header[0]["format_version"] = 7       # a newer daemon's pool
    p.close(unlink=False)
    with caplog.at_level(logging.WARNING, logger="kvpool.daemon.pool"):
        q = Pool.open(pool_config)
    assert not q.adopted and int(q.header[0]["format_version"]) == 2
    assert "pool format 7, this kvpoold reads formats 1, 2" in caplog.text
    assert "its cached blocks are dropped" in caplog.text
    q.close(unlink=True)


def test_batched_record_writes_write_what_per_slot_writes_do(pool, record_writer):
    """``write_states`` and ``commit_records`` address records by slot id across extents and
    leave every byte as the per-slot writes (and the per-extent commit) would, compiled
    (daemon/_pool_records.c) or with numpy."""
    import numpy as np

    from kvpool.daemon.pool import FREE, WRITING
    n = pool.assign_extent(0, 4096)
    assert pool.assign_extent(1, 4096) == n
    stride = pool.slot_id_stride
    a = [0, 5, n - 1]                                 # extent 0
    b = [stride + i for i in a]                       # the same slots of extent 1
    gens = [7, 0x7FFF_FFFF, 123456]
    keys = [bytes([i]) * 32 for i in (1, 2, 3)]
    for sid, g in zip(a, gens):
        pool.write_state(sid, WRITING, g)
    pool.write_states(b, WRITING, gens)
    assert bytes(pool.records(0)) == bytes(pool.records(1))
    assert [int(r["state"]) for r in pool.records(1)[[0, 5, n - 1]]] == [WRITING] * 3
    assert [int(g) for g in pool.records(1)[[0, 5, n - 1]]["generation"]] == gens
    pool.commit_records(a[:2], keys[:2], gens[:2])
    pool.commit_records(b[:2], keys[:2], gens[:2])
    pool.write_state(a[2], FREE)
    pool.write_states(b[2:], FREE)
    assert bytes(pool.records(0)) == bytes(pool.records(1))
    rec = pool.records(1)
    assert [int(s) for s in rec["state"][[0, 5, n - 1]]] == [COMMITTED, COMMITTED, FREE]
    assert bytes(rec[5]["key"]) == keys[1] and int(rec[n - 1]["generation"]) == gens[2]
    assert np.array_equal(pool.generations(1, n), rec["generation"])
    pool.write_states([], WRITING, [])                # nothing to write: no error
    pool.commit_records([], [], [])


def test_committed_records_of_a_batch_are_adopted(pool_config, record_writer):
    """A batch commit across extents survives the daemon: a new pool adopts every record."""
    p = Pool.open(pool_config)
    p.assign_extent(0, 4096)
    p.assign_extent(2, 4096)
    ids = [1, 2 * p.slot_id_stride + 9]
    keys = [b"n" * 16 + b"a" * 16, b"n" * 16 + b"b" * 16]
    p.commit_records(ids, keys, [11, 12])
    p.close(unlink=False)
    q = Pool.open(pool_config)
    try:
        assert int(q.records(0)[1]["state"]) == COMMITTED
        assert bytes(q.records(2)[9]["key"]) == keys[1]
        assert int(q.records(2)[9]["generation"]) == 12
    finally:
        q.close(unlink=True)


def test_compiled_and_numpy_record_writes_leave_the_same_bytes(pool, compiled_pool_records,
                                                               monkeypatch):
    """The same batches (the sizes a store job writes, ids scattered over two extents) through
    the compiled writes, then through numpy's on a copy of the table before them: byte-equal."""
    import random

    import kvpool.daemon.pool as pool_module
    from kvpool.daemon.pool import FREE, WRITING
    n = pool.assign_extent(0, 4096)
    pool.assign_extent(3, 4096)
    rng = random.Random(36)
    every = list(range(n)) + [3 * pool.slot_id_stride + i for i in range(n)]
    batches = []
    for size in (1, 4, 5, 128, 1024, 1500):
        ids = rng.sample(every, min(size, len(every)))
        gens = [rng.randrange(1 << 31) for _ in ids]
        keys = [rng.randbytes(32) for _ in ids]
        batches.append((ids, gens, keys))
    table = pool._rec_bytes
    before = table.copy()

    def write_all():
        for ids, gens, keys in batches:
            pool.write_states(ids, WRITING, gens)
            pool.commit_records(ids[::2], keys[::2], gens[::2])
            pool.write_states(ids[1::2], FREE)

    write_all()
    compiled = table.copy()
    table[:] = before
    monkeypatch.setattr(pool_module, "_pool_records", None)
    write_all()
    assert (table != before).any() and bytes(table) == bytes(compiled)


@pytest.mark.parametrize("call, why", [
    (lambda r, t, ids: r.write_states(t, ids + [-1], 1), "outside the record table"),
    (lambda r, t, ids: r.write_states(t, ids + [10 ** 9], 1), "outside the record table"),
    (lambda r, t, ids: r.write_states(t, ids + [2 ** 70], 1), "too large|int too big"),
    (lambda r, t, ids: r.write_states(t, ids, 1, [1] * (len(ids) - 1)), "not as many"),
    (lambda r, t, ids: r.write_states(t, ids, 1, [1] * (len(ids) - 1) + [2 ** 32]),
     "does not fit 32 bits"),
    (lambda r, t, ids: r.write_states(t, ids, 1, [1] * (len(ids) - 1) + [-1]), "negative"),
    (lambda r, t, ids: r.write_states(t, ids, 256), "not a byte"),
    (lambda r, t, ids: r.write_states(t, ids + ["7"], 1), "integer"),
    (lambda r, t, ids: r.write_states(t, 7, 1), "must be a sequence"),
    (lambda r, t, ids: r.write_states(t[:100], ids, 1), "no whole number"),
    (lambda r, t, ids: r.write_states(bytes(48 * 100), ids, 1), "writable"),
    (lambda r, t, ids: r.commit(t, ids, [b"k" * 32] * (len(ids) - 1) + [b"k" * 31],
                                [1] * len(ids), 2), "is not 32 bytes"),
    (lambda r, t, ids: r.commit(t, ids, [b"k" * 32] * (len(ids) - 1) + ["k" * 32],
                                [1] * len(ids), 2), "is not 32 bytes"),
    (lambda r, t, ids: r.commit(t, ids, [b"k" * 32] * len(ids), None, 2), "every key"),
    (lambda r, t, ids: r.commit(t, ids, [b"k" * 32] * len(ids), [1] * (len(ids) + 1), 2),
     "not as many"),
])
def test_bad_record_writes_are_refused_and_change_nothing(pool, compiled_pool_records, call,
                                                          why):
    """Ids, generations, keys and states are all checked before the first byte is written: a
    refused batch leaves the table as it was (the good ids before the bad one included)."""
    pool.assign_extent(0, 4096)
    ids = list(range(0, 200, 3))
    before = pool._rec_bytes.copy()
    with pytest.raises((IndexError, ValueError, OverflowError, TypeError, BufferError),
                       match=why):
        call(compiled_pool_records, pool._rec_bytes, ids)
    assert bytes(pool._rec_bytes) == bytes(before)
