"""Blocks across TP sizes over a real daemon and the host copy path: writers at one TP size,
readers at another, byte for byte; replicated GQA heads and MLA stored once; a rank that dies
after its head range; bad input. Fake ranks are ``HeadKv`` workers (vLLM 0.33 layer views)."""

from __future__ import annotations

import pytest

from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.errors import LayoutMismatch
from kvpool.shared.layout import Layout
from tests.conftest import wait_for
from bench.kvtest import HeadKv

SEED = 7


class Engine:
    """``tp`` fake ranks of one model, each its own worker client."""

    def __init__(self, daemon, tp: int, **kw) -> None:
        self.ranks = [HeadKv(tp, r, **kw) for r in range(tp)]
        self.clients = [k.register(daemon.client_config(), name=f"tp{tp}") for k in self.ranks]
        self.namespace = self.ranks[0].namespace

    def store(self, block_ids: list[int], grant, keys: list[bytes]) -> list:
        """Every rank stores ``block_ids`` into the tickets of ``grant`` (a ReserveReply)."""
        for k in self.ranks:
            k.fill(block_ids, SEED)
        jobs = [(c, c.submit_store(reg, block_ids, grant.slots, keys=keys,
                                   grant=grant.daemon_id)) for c, reg in self.clients]
        return [c.wait([j], 20)[0] for c, j in jobs]

    def load(self, slots: list[int], block_ids: list[int]) -> list:
        for k in self.ranks:
            k.poison(block_ids)
        jobs = [(c, c.submit_load(reg, slots, block_ids)) for c, reg in self.clients]
        return [c.wait([j], 20)[0] for c, j in jobs]

    def close(self) -> None:
        for (c, _), k in zip(self.clients, self.ranks):
            c.close()
            k.close()


def hand_off(daemon, sched, writer_tp: int, reader_tp: int, tag: int, **kw) -> None:
    """Writer ranks store 5 blocks, reader ranks load them elsewhere: each reader rank must
    hold exactly its heads of what the writers stored."""
    w, r = Engine(daemon, writer_tp, **kw), Engine(daemon, reader_tp, **kw)
    try:
        assert w.namespace == r.namespace, "TP must not be part of the namespace"
        src, dst = [3, 0, 9, 4, 21], [10, 11, 12, 13, 30]
        keys = w.ranks[0].keys(list(range(tag * 1000, tag * 1000 + 5 * 16)))
        grant = sched.reserve(w.namespace, len(keys))
        assert all(d.ok for d in w.store(src, grant, keys)), "a writer rank's store failed"
        hit = sched.lookup(r.namespace, [keys], pin=True)
        assert hit.hits == [5], f"TP={writer_tp} -> TP={reader_tp}: blocks did not commit"
        done = r.load(hit.slots[0], dst)
        assert all(d.ok for d in done), [d.message for d in done]
        for k in r.ranks:
            k.check(dst, SEED, stored_as=src)
        sched.release(hit.leases)
    finally:
        w.close()
        r.close()


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC"])
def test_tp_cross_host_byte_exact(daemon, order):
    """1<->2, 2<->4, 1<->4 over the host path for a token-major (NHD), a head-major (HND) and
    a block-outermost cache: 4 KV heads, one pool namespace for every TP size."""
    sched = SchedulerClient(daemon.client_config(), "sched")
    try:
        for tag, (a, b) in enumerate([(2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (4, 1)]):
            hand_off(daemon, sched, a, b, tag, order=order)
        info = sched.info()
        assert info.errors == 0 and info.slots_committed == 6 * 5
        assert len(info.namespace_usage) == 1      # every TP size in one namespace
    finally:
        sched.close()


def test_tp_cross_tp8(daemon):
    """8 KV heads: TP=8 -> TP=1 and TP=2 -> TP=8 (one head per rank)."""
    sched = SchedulerClient(daemon.client_config(), "sched")
    try:
        hand_off(daemon, sched, 8, 1, 0, heads=8, cell=16)
        hand_off(daemon, sched, 2, 8, 1, heads=8, cell=16, order="BLHNC")
    finally:
        sched.close()


def test_tp_cross_gqa_replicated_heads_are_stored_once(daemon):
    """2 KV heads at TP=4: ranks 1 and 3 replicate the heads of ranks 0 and 2; their stores
    copy nothing, the blocks commit on the primaries, and TP=1, 2 and 8 read them back."""
    sched = SchedulerClient(daemon.client_config(), "sched")
    try:
        hand_off(daemon, sched, 4, 1, 0, heads=2)
        before = sched.info().stored_bytes
        hand_off(daemon, sched, 4, 2, 1, heads=2)
        slot = Layout(16, 1, "float16", (2 * 2 * 16 * 32 * 2,), "", 2, 64).slot_bytes
        assert sched.info().stored_bytes - before == 5 * slot, "replicas must not store"
        hand_off(daemon, sched, 2, 8, 2, heads=2)
        hand_off(daemon, sched, 1, 4, 3, heads=2)
    finally:
        sched.close()


def test_tp_cross_mla_one_copy_for_every_rank(daemon):
    """MLA (one latent per layer, ``kv_heads=1``): rank 0 of any TP size stores it once, every
    rank of any TP size loads all of it."""
    sched = SchedulerClient(daemon.client_config(), "sched")
    try:
        hand_off(daemon, sched, 2, 1, 0, heads=1, cell=48)
        before = sched.info().stored_bytes
        hand_off(daemon, sched, 4, 2, 1, heads=1, cell=48)
        assert sched.info().stored_bytes - before == 5 * 2 * 16 * 48 * 2
    finally:
        sched.close()


def test_tp_cross_rank_dying_after_its_head_range_never_commits(daemon_factory):
    """TP=2 writer: rank 0 lands its heads, rank 1 dies before its store. The blocks never
    become visible and are dropped at the write timeout; storing them again works."""
    d = daemon_factory(extra=["--write-timeout-s", "1"])
    sched = SchedulerClient(d.client_config(), "sched")
    w = Engine(d, 2)
    try:
        keys = w.ranks[0].keys(list(range(4 * 16)))
        grant = sched.reserve(w.namespace, len(keys))
        w.ranks[0].fill([0, 1, 2, 3], SEED)
        c0, reg0 = w.clients[0]
        assert c0.wait([c0.submit_store(reg0, [0, 1, 2, 3], grant.slots, keys=keys,
                                        grant=grant.daemon_id)], 20)[0].ok
        w.clients[1][0].close()                 # rank 1 gone without storing
        assert sched.lookup(w.namespace, [keys]).hits == [0]
        wait_for(lambda: sched.info().slots_writing == 0, 20, "the write timeout to drop them")
        assert sched.lookup(w.namespace, [keys]).hits == [0]
        again = sched.reserve(w.namespace, len(keys))
        done = c0.wait([c0.submit_store(reg0, [0, 1, 2, 3], again.slots, keys=keys,
                                        grant=again.daemon_id)], 20)[0]
        assert done.ok and done.nbytes > 0, "the keys were free again: stored from scratch"
        done = c0.wait([c0.submit_store(reg0, [0, 1, 2, 3], grant.slots, keys=keys,
                                        grant=grant.daemon_id)], 20)[0]
        assert not done.ok and "not reserved" in done.message    # the stale tickets are refused
    finally:
        sched.close()
        w.close()


def test_tp_cross_bad_input(daemon):
    """Overlapping head ranges in one slot, heads that do not divide, and an engine whose
    blocks are shaped otherwise each get a clear error; nothing is committed wrongly."""
    sched = SchedulerClient(daemon.client_config(), "sched")
    two, four = Engine(daemon, 2), Engine(daemon, 4)
    try:
        keys = two.ranks[0].keys(list(range(2 * 16)))
        grant = sched.reserve(two.namespace, len(keys))
        c, reg = two.clients[0]                       # heads 0-1
        two.ranks[0].fill([0, 1], SEED)
        assert c.wait([c.submit_store(reg, [0, 1], grant.slots, keys=keys,
                                      grant=grant.daemon_id)], 20)[0].ok
        c4, reg4 = four.clients[1]                    # head 1: overlaps
        done = c4.wait([c4.submit_store(reg4, [0, 1], grant.slots, keys=keys,
                                        grant=grant.daemon_id)], 20)[0]
        assert not done.ok and "overlapping head ranges" in done.message
        assert sched.lookup(two.namespace, [keys]).hits == [0]
        k = two.ranks[0]
        with pytest.raises(LayoutMismatch, match="6 KV heads cannot be split over tp_size=4"):
            c.register(k.namespace, Layout(16, 4, "float16", (3072,), "x", 6, 64), 0,
                       k.blocks, [k.mem.region], k.placement[:1])
        other = HeadKv(2, 0, cell=16)                 # same model name, other block shape
        try:
            with pytest.raises(LayoutMismatch, match="registered with another layout"):
                c.register(two.namespace, other.layout, 0, other.blocks, [other.mem.region],
                           other.placement)
        finally:
            other.close()
        assert c.is_registered(reg)                   # the refusals cost nothing
    finally:
        sched.close()
        two.close()
        four.close()
