"""Lookups read in the daemon's shared-memory index, over a real daemon (issue 37): hits in the
same call, optimistic loads whose stale blocks fail alone, restarts the readers follow, and
lower-tier hits brought up through the staging window, a batch larger than the pool included."""

from __future__ import annotations

import posix_ipc
import torch

from bench.kvtest import HostKv, keyed_store
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared import index_format as f
from tests.conftest import wait_for


def _engine(daemon, **kv):
    kv = HostKv(**kv)
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config(), "sched")
    assert sched.connect()
    return kv, worker, reg, sched


def _store(kv, worker, reg, sched, first_token: int, n: int, seed: int) -> list[bytes]:
    keys = kv.keys(list(range(first_token, first_token + n * kv.block_tokens)))
    kv.fill_random(list(range(n)), seed)
    done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, list(range(n)), keys)],
                       30)[0]
    assert done.ok and done.nbytes == n * kv.layout.slot_bytes, done
    return keys


def test_hits_are_read_in_the_index_in_the_same_call_and_load_byte_exact(daemon):
    kv, worker, reg, sched = _engine(daemon)
    try:
        keys = _store(kv, worker, reg, sched, 0, 6, seed=1)
        want = kv.blocks_of(list(range(6)))
        n, refs, where = sched.find(kv.namespace, keys + kv.keys(list(range(500, 516))))
        assert n == 6 and where == [f.POOL] * 6
        assert refs == sched.lookup(kv.namespace, [keys]).slots[0], "the index and the daemon agree"
        assert sched.find(kv.namespace, kv.keys(list(range(9000, 9032))))[0] == 0
        # Each key alone (a state group's): hits past a miss count too, a miss reads -1.
        other = kv.keys(list(range(9000, 9000 + kv.block_tokens)))
        assert sched.find_each(kv.namespace, [keys[0]] + other + keys[1:]) == \
            [refs[0], -1] + refs[1:]
        kv.poison(list(range(10, 16)))
        done = worker.wait([worker.submit_load(reg, refs, list(range(10, 16)), keys)], 30)[0]
        assert done.ok and done.failed == () and done.nbytes == 6 * kv.layout.slot_bytes
        assert torch.equal(kv.blocks_of(list(range(10, 16))), want)
        before = sched.info()
        sched.touch_nowait(kv.namespace, keys, missed_blocks=2)
        wait_for(lambda: sched.info().hit_blocks >= before.hit_blocks + 6, 10,
                 "the daemon to count the hits the index answered")
        assert sched.info().miss_blocks == before.miss_blocks + 2
        assert sched.info().index_keys == 6 and sched.info().index_segment
    finally:
        worker.close(); sched.close(); kv.close()


def test_a_block_evicted_between_lookup_and_load_fails_alone_and_a_reused_slot_is_never_read(
        daemon_factory):
    d = daemon_factory(pool_size="8MiB")
    kv, worker, reg, sched = _engine(d, heads=16, head_dim=64)        # 128 KiB blocks
    try:
        first = _store(kv, worker, reg, sched, 0, 4, seed=2)
        want = kv.blocks_of(list(range(4)))
        n, refs, _ = sched.find(kv.namespace, first)
        assert n == 4
        for i in range(1, 5):                   # several pools' worth: every slot is reused
            _store(kv, worker, reg, sched, 100_000 * i, 24, seed=10 + i)
        assert sched.find(kv.namespace, first)[0] == 0, "evicted: gone from the index"
        kv.poison(list(range(40, 44)))
        done = worker.wait([worker.submit_load(reg, refs, list(range(40, 44)), first)], 30)[0]
        assert done.ok and done.failed == (0, 1, 2, 3) and done.nbytes == 0, done
        assert torch.isnan(kv.blocks_of(list(range(40, 44))).float()).all(), \
            "a reused slot's bytes were loaded"
        info = sched.info()
        assert info.load_stale_blocks == 4 and info.load_failed_blocks == 4
        # Stored again (other slots now): the old refs still find them by key.
        kv.kv[:, :, torch.arange(4)] = want
        done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, [0, 1, 2, 3], first)],
                           30)[0]
        assert done.ok
        done = worker.wait([worker.submit_load(reg, refs, list(range(40, 44)), first)], 30)[0]
        assert done.ok and done.failed == ()
        assert torch.equal(kv.blocks_of(list(range(40, 44))), want)
        # Without keys a stale ref has no fallback: refused per block, never misread.
        done = worker.wait([worker.submit_load(reg, refs, list(range(40, 44)))], 30)[0]
        assert done.ok and done.failed == (0, 1, 2, 3)
    finally:
        worker.close(); sched.close(); kv.close()


def test_readers_follow_a_restarted_daemon_to_its_new_index(daemon):
    kv, worker, reg, sched = _engine(daemon)
    try:
        keys = _store(kv, worker, reg, sched, 0, 3, seed=3)
        old = sched.index()
        assert old is not None and sched.find(kv.namespace, keys)[0] == 3
        daemon.kill()                                      # the pool stays in /dev/shm
        daemon.restart()
        assert old.superseded, "the new daemon marks the old segment superseded"
        assert sched.find(kv.namespace, keys) is None or \
            sched.find(kv.namespace, keys)[0] in (0, 3)
        wait_for(lambda: sched.ready() and sched.find(kv.namespace, keys) is not None
                 and sched.find(kv.namespace, keys)[0] == 3, 20,
                 "the scheduler to map the restarted daemon's index, adopted blocks in it")
        assert sched.index().daemon_id == sched.info().daemon_id
    finally:
        worker.close(); sched.close(); kv.close()


def _sixty_six_blocks_on_disk(d, kv, worker, reg, sched) -> tuple[list[bytes], dict]:
    """66 blocks of 256 KiB stored 11 per job (as an engine stores), all on disk after. Each
    job's blocks reach the disk before the next job is stored: the pool holds ~28, and on a
    loaded machine a disk writer left behind sees blocks evicted unwritten (counted missed;
    the test waited for 66 on disk for ever)."""
    keys = kv.keys(list(range(66 * kv.block_tokens)))
    want = {}
    for a in range(0, 66, 11):
        ids = list(range(a, a + 11))
        kv.fill_random(ids, seed=a)
        done = worker.wait([keyed_store(sched, worker, reg, kv.namespace, ids,
                                        keys[a:a + 11])], 30)[0]
        assert done.ok and done.nbytes == 11 * kv.layout.slot_bytes, done
        for b in ids:
            want[b] = kv.blocks_of([b])
        wait_for(lambda: sched.info().tiers[0].blocks >= a + 11, 60,
                 lambda: f"{a + 11} blocks on disk: {sched.info().tiers[0]}")
    return keys, want


def _restarted(d, kv, worker, sched, keys, reboot: bool):
    worker.close(); sched.close()
    d.kill()
    if reboot:
        posix_ipc.unlink_shared_memory("/" + d.pool_name)     # the pool is gone
    d.restart()
    worker, reg = kv.register(d.client_config())
    sched = SchedulerClient(d.client_config(), "sched")
    assert sched.connect()
    wait_for(lambda: sched.find(kv.namespace, keys) is not None
             and sched.find(kv.namespace, keys)[0] == 66, 20, "66 hits in the index")
    return worker, reg, sched


def test_a_batch_larger_than_the_pool_comes_up_from_disk_whole_after_kill_and_restart(
        daemon_factory, tmp_path):
    """An 8 MiB pool over a disk tier; 66 blocks of 256 KiB (16.5 MiB) stored, the daemon
    killed and its pool lost (a reboot). The restarted daemon's index lists all 66 on disk, and
    one load job of all 66 brings them up window by window, every block byte exact (it loaded
    24 of 66 before the staging window)."""
    d = daemon_factory(pool_size="8MiB", extra=["--disk-path", str(tmp_path / "disk"),
                                                 "--disk-size", "64MiB"])
    kv, worker, reg, sched = _engine(d, layers=4, heads=16, head_dim=64, blocks=160)
    assert kv.layout.slot_bytes == 256 << 10
    try:
        keys, want = _sixty_six_blocks_on_disk(d, kv, worker, reg, sched)
        worker, reg, sched = _restarted(d, kv, worker, sched, keys, reboot=True)
        n, refs, where = sched.find(kv.namespace, keys)
        assert set(where) == {f.DISK} and set(refs) == {0}
        dst = list(range(80, 146))
        kv.poison(dst)
        done = worker.wait([worker.submit_load(reg, refs, dst, keys)], 120)[0]
        assert done.ok and done.failed == (), done
        assert done.nbytes == 66 * kv.layout.slot_bytes
        for i, b in enumerate(dst):
            assert torch.equal(kv.blocks_of([b]), want[i]), f"block {i} came back different"
    finally:
        worker.close(); sched.close(); kv.close()


def test_six_loads_at_once_larger_than_the_pool_each_come_up_whole(daemon_factory, tmp_path):
    """The same 66 blocks after a kill -9 that keeps the pool (some blocks still in it), asked
    for as six load jobs of 11 at once, as an engine loads six prompts in one step: each job is
    served whole, in turn (holding the pool hits of every job while the first staged its fills
    left it no room: an engine loaded 48 of 66 two prompts at a time)."""
    d = daemon_factory(pool_size="8MiB", extra=["--disk-path", str(tmp_path / "disk"),
                                                 "--disk-size", "64MiB"])
    kv, worker, reg, sched = _engine(d, layers=4, heads=16, head_dim=64, blocks=160)
    try:
        keys, want = _sixty_six_blocks_on_disk(d, kv, worker, reg, sched)
        worker, reg, sched = _restarted(d, kv, worker, sched, keys, reboot=False)
        n, refs, where = sched.find(kv.namespace, keys)
        assert f.POOL in where and f.DISK in where, "some blocks in the pool, the rest on disk"
        dst = list(range(80, 146))
        kv.poison(dst)
        jobs = [worker.submit_load(reg, refs[a:a + 11], dst[a:a + 11], keys[a:a + 11])
                for a in range(0, 66, 11)]
        done = worker.wait(jobs, 120)
        assert [(c.ok, c.failed) for c in done] == [(True, ())] * 6, done
        for i, b in enumerate(dst):
            assert torch.equal(kv.blocks_of([b]), want[i]), f"block {i} came back different"
        # Blocks the fills evicted from the pool are still on disk, and the index says so.
        n, _, where = sched.find(kv.namespace, keys)
        assert n == 66, f"the index lost blocks the disk holds: {where}"
    finally:
        worker.close(); sched.close(); kv.close()
