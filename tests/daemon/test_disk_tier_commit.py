"""daemon/disk_tier.py's write pipeline, without a daemon: a demoted batch frees its pool
slots once its data is written, becomes visible only after a group commit, and batches that
land while a commit runs share the next one."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading

from kvpool.daemon import disk_tier
from kvpool.daemon.tier import TierEvents
from kvpool.daemon.disk_tier import DiskTier

S = 8192
NS = b"n" * 16
POOL_BLOCKS = 160


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_batches_landing_during_a_commit_share_the_next_and_show_only_once_durable(tmp_path):
    pool = mmap.mmap(-1, POOL_BLOCKS * S)
    pool.write(os.urandom(POOL_BLOCKS * S))
    tier = DiskTier.open(str(tmp_path / "d"), "64MiB", pool, POOL_BLOCKS * S)
    cap = tier.max_uncommitted
    assert 2 * cap <= POOL_BLOCKS
    entered, release = threading.Event(), threading.Event()
    commits: list[int] = []
    real_commit = tier.store.commit

    def gated_commit(slot_bytes, batches):
        commits.append(len(batches))
        entered.set()
        assert release.wait(30), "the test never opened the gate"
        return real_commit(slot_bytes, batches)
    tier.store.commit = gated_commit
    ready: list[int] = []
    class Events(TierEvents):
        def ready(self):
            ready.append(len(commits))
    tier.bind(Events())

    async def demote(first: int, n: int) -> int:
        return await asyncio.wait_for(tier.demote(
            [key(i) for i in range(first, first + n)], [i * S for i in range(first, first + n)],
            S), 30)

    def visible() -> int:
        return tier.leading(NS, [key(i)[16:] for i in range(POOL_BLOCKS)], S)

    async def main() -> None:
        assert await demote(0, 2) == 2             # written: its pool slots may go
        assert await _in_thread(entered.wait, 30), "the first commit never started"
        # The commit is held: more batches are written meanwhile, their slots let go...
        assert await demote(2, 2) == 2 and await demote(4, 2) == 2
        # ...but nothing is visible or counted before it is durable.
        assert visible() == 0 and tier.demoted_blocks == 0
        # Batches waiting for a commit are bounded (the tier's space is held by them).
        n = 6
        while tier.can_demote():
            assert await demote(n, 2) == 2
            n += 2
        assert n == 2 * cap and not tier._demotes
        release.set()
        for _ in range(3000):                      # bounded: 30 s
            if tier.demoted_blocks == n:
                break
            await asyncio.sleep(0.01)
        assert tier.demoted_blocks == n and visible() == n
        # One flush for the first batch, one for everything that landed behind it.
        assert commits == [1, cap - 1]
        assert ready and tier.can_demote()         # the pump was told it may go on
        await tier.close(30)

    asyncio.run(main())
    again = DiskTier.open(str(tmp_path / "d"), "64MiB", pool, POOL_BLOCKS * S)
    try:
        assert again.info().adopted_blocks == 2 * cap
    finally:
        asyncio.run(again.close(30))
        pool.close()


def test_uncommitted_batches_are_bounded_by_the_tiers_bytes_not_only_their_count(tmp_path):
    def cap(pool_bytes: int, tier_size: str) -> tuple[int, int]:
        pool = mmap.mmap(-1, pool_bytes)
        tier = DiskTier.open(str(tmp_path / tier_size), tier_size, pool, pool_bytes)
        try:
            return tier.max_uncommitted, tier.batch_blocks(128 << 10)
        finally:
            asyncio.run(tier.close(30))
            pool.close()

    # A 4 MiB pool writes one 128 KiB block per batch: 48 may await a commit on a 64 MiB disk
    # (an eighth of it), not six.
    assert cap(4 << 20, "64MiB") == (48, 1)
    # A tiny tier keeps the floor; a large one the ceiling.
    assert cap(4 << 20, "2MiB")[0] == disk_tier.MIN_UNCOMMITTED
    assert cap(4 << 20, "1GiB")[0] == disk_tier.MAX_UNCOMMITTED
