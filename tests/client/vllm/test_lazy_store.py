"""``LazyStore`` against vLLM 0.33's real KVCacheManager and block pool, on CPU.

Requests are "computed" by allocating their slots as vLLM's scheduler does (which caches their
full blocks) and finished by freeing them, so the free queue's order is vLLM's own: uncached
blocks at the head, cached ones appended in the order they were freed, each request's last
block first.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.request import Request  # noqa: E402

from kvpool.client.vllm.lazy_store import (EVICTED, RESET, Due, LazyStore,  # noqa: E402
                                           eviction_horizon, horizon_for)

pytestmark = pytest.mark.vllm

BS = 4
_tokens = itertools.count(1000, 7)   # every request its own tokens: no accidental prefix hits


@pytest.fixture(autouse=True, scope="module")
def _none_hash():
    init_none_hash(sha256)


def manager(num_blocks: int) -> KVCacheManager:
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS,
                          enable_caching=True)


def request(name: str, num_tokens: int, prompt: list[int] | None = None) -> Request:
    tokens = prompt if prompt is not None else [next(_tokens) for _ in range(num_tokens)]
    return Request(request_id=name, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def compute(mgr: KVCacheManager, req: Request) -> list[int]:
    """Schedule the whole prompt in one step, as vLLM's scheduler does; its block ids."""
    hit_blocks, hit_tokens = mgr.get_computed_blocks(req)[:2]
    assert mgr.allocate_slots(req, req.num_tokens - hit_tokens, hit_tokens, hit_blocks)
    req.num_computed_tokens = req.num_tokens
    return list(mgr.get_block_ids(req.request_id)[0])


def keys(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def free_order(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def scenario(num_blocks: int = 16):
    """Free queue ``[d1, a2, a1, a0, c2, c1, c0, e2, e1, e0, d0]``: d1 uncached, A and E
    remembered, C not; the other blocks held by a running request ``b``."""
    mgr = manager(num_blocks)
    lazy = LazyStore(horizon_blocks=3)
    ids = {}
    for name in "ace":
        req = request(name, 3 * BS)
        ids[name] = compute(mgr, req)
        if name != "c":
            assert lazy.remember(mgr.block_pool, 0, ids[name], keys(name, 3)) == []
        mgr.free(req)
    # d: one full block (cached, to the tail) and one partial block (uncached, to the head).
    d = request("d", BS + 2)
    ids["d"] = compute(mgr, d)
    b = request("b", (mgr.block_pool.get_num_free_blocks() - 9) * BS)   # the uncached ones
    ids["b"] = compute(mgr, b)
    mgr.free(d)
    a, c, e, dd = ids["a"], ids["c"], ids["e"], ids["d"]
    assert free_order(mgr) == [dd[1], a[2], a[1], a[0], c[2], c[1], c[0], e[2], e[1], e[0],
                               dd[0]]
    return mgr, lazy, ids


def allocate(mgr: KVCacheManager, num_blocks: int) -> list[int]:
    """A new request takes ``num_blocks`` blocks from the head of the free queue."""
    return compute(mgr, request(f"n{next(_tokens)}", num_blocks * BS))


def test_nothing_is_due_while_uncached_free_blocks_absorb_the_next_step():
    mgr = manager(64)
    lazy = LazyStore(horizon_blocks=8)
    req = request("a", 8 * BS)
    a = compute(mgr, req)
    lazy.remember(mgr.block_pool, 0, a, keys("a", 8))
    mgr.free(req)
    # 55 uncached free blocks lie between the head and a's blocks.
    assert lazy.due(mgr.block_pool) == []
    assert not lazy.at_risk(mgr.block_pool)
    assert lazy.num_pending == 8 and lazy.num_in_flight == 0
    assert all(mgr.block_pool.blocks[b].ref_cnt == 0 for b in a)


def test_due_names_the_remembered_blocks_the_next_allocation_would_evict():
    # Without due(): a 3-block allocation evicts d1 (uncached), a2 and a1.
    mgr, lazy, ids = scenario()
    a = ids["a"]
    held = {b: mgr.block_pool.blocks[b].block_hash for b in a + ids["e"]}
    allocate(mgr, 3)
    gone = [b for b, h in held.items() if mgr.block_pool.blocks[b].block_hash != h]
    assert gone == [a[1], a[2]]

    # With it: a2 and a1 are due, and so is a0, which the pins bring within the horizon.
    mgr, lazy, ids = scenario()
    a, e = ids["a"], ids["e"]
    due = lazy.due(mgr.block_pool)
    assert due == [Due(0, a[2], b"a2"), Due(0, a[1], b"a1"), Due(0, a[0], b"a0")]
    assert [mgr.block_pool.blocks[b].ref_cnt for b in a] == [1, 1, 1]
    assert lazy.num_pending == 3 and lazy.num_in_flight == 3
    # The next step takes d1, c2 and c1: no remembered block is lost.
    new = allocate(mgr, 3)
    assert new == [ids["d"][1], ids["c"][2], ids["c"][1]]
    lazy.note_allocated(mgr.block_pool, new)
    assert lazy.dropped_total == 0
    assert lazy.num_pending == 3 and all(mgr.block_pool.blocks[b].ref_cnt == 0 for b in e)
    # e comes due one step later, behind c0.
    assert lazy.due(mgr.block_pool) == [Due(0, e[2], b"e2"), Due(0, e[1], b"e1"),
                                        Due(0, e[0], b"e0")]
    assert lazy.num_pending == 0


def test_pinned_blocks_survive_until_released_then_rejoin_the_tail_still_cached():
    mgr, lazy, ids = scenario()
    a = ids["a"]
    held = {b: mgr.block_pool.blocks[b].block_hash for b in a}
    due = lazy.due(mgr.block_pool)
    # A step far beyond the horizon takes everything vLLM may take: e's blocks are lost (and
    # counted), the pinned ones are not.
    new = allocate(mgr, mgr.block_pool.get_num_free_blocks())
    assert mgr.block_pool.get_num_free_blocks() == 0
    lazy.note_allocated(mgr.block_pool, new)
    assert lazy.dropped[EVICTED] == 3 and lazy.num_pending == 0
    assert {b: mgr.block_pool.blocks[b].block_hash for b in a} == held
    lazy.release(mgr.block_pool, [d.block_id for d in due])
    assert lazy.num_in_flight == 0
    assert free_order(mgr) == [a[2], a[1], a[0]]
    assert {b: mgr.block_pool.blocks[b].block_hash for b in a} == held
    # Stored, so no longer remembered: nothing of a comes due again.
    assert lazy.due(mgr.block_pool) == [] and lazy.all_pending(mgr.block_pool) == []


def test_blocks_evicted_before_they_came_due_are_counted():
    mgr, lazy, ids = scenario()
    lazy.horizon_blocks = 1     # too short for the 4-block step below
    assert lazy.due(mgr.block_pool) == []
    new = allocate(mgr, 4)      # d1, a2, a1, a0
    lazy.note_allocated(mgr.block_pool, new)
    assert lazy.dropped == {EVICTED: 3, RESET: 0}
    assert lazy.num_pending == 3   # e's blocks


def test_idle_stores_every_remembered_block_still_cached():
    mgr, lazy, ids = scenario()
    a, e = ids["a"], ids["e"]
    allocate(mgr, 3)                        # evicts a2 and a1 unseen
    mgr.evict_blocks({e[1]})                # vLLM drops e1's cache entry in place
    pending = lazy.all_pending(mgr.block_pool)
    assert pending == [Due(0, a[0], b"a0"), Due(0, e[0], b"e0"), Due(0, e[2], b"e2")]
    assert lazy.dropped[EVICTED] == 3
    assert [mgr.block_pool.blocks[b].ref_cnt for b in (a[0], e[0], e[2])] == [1, 1, 1]
    assert lazy.num_pending == 0 and lazy.num_in_flight == 3
    lazy.release(mgr.block_pool, [d.block_id for d in pending])
    assert lazy.num_in_flight == 0 and lazy.all_pending(mgr.block_pool) == []


def test_blocks_without_a_cache_entry_are_handed_back_to_store_now():
    mgr = manager(16)
    lazy = LazyStore(horizon_blocks=4)
    req = request("g", BS + 2)
    g = compute(mgr, req)
    untracked = lazy.remember(mgr.block_pool, 0, [0] + g, [b"null", b"g0", b"g1"])
    assert untracked == [Due(0, g[1], b"g1")]      # the partial block has no hash
    assert lazy.num_pending == 1                   # g0; the null block is skipped
    # Remembering again changes nothing.
    assert lazy.remember(mgr.block_pool, 0, g[:1], [b"g0"]) == []
    assert lazy.num_pending == 1


def test_a_prefix_hit_on_a_remembered_block_is_not_an_eviction():
    mgr = manager(16)
    lazy = LazyStore(horizon_blocks=16)
    prompt = [next(_tokens) for _ in range(2 * BS)]
    first = request("a", 0, prompt)
    a = compute(mgr, first)
    lazy.remember(mgr.block_pool, 0, a, keys("a", 2))
    mgr.free(first)
    again = request("a2", 0, prompt + [1, 2, 3, 4, 5])
    a2 = compute(mgr, again)
    assert a2[:2] == a
    lazy.note_allocated(mgr.block_pool, a2)
    assert lazy.dropped_total == 0
    assert lazy.due(mgr.block_pool) == []          # in use again, so not evictable
    mgr.free(again)
    assert [d.key for d in lazy.due(mgr.block_pool)] == [b"a1", b"a0"]


def test_forgotten_keys_and_second_copies_are_not_stored():
    mgr, lazy, ids = scenario()
    a, c, e = ids["a"], ids["c"], ids["e"]
    lazy.forget([b"a2"])
    # c0 holds a second copy of e0's key (two requests computed the same block).
    lazy.remember(mgr.block_pool, 0, [c[0]], [b"e0"])
    lazy.horizon_blocks = 8
    assert lazy.due(mgr.block_pool) == [Due(0, a[1], b"a1"), Due(0, a[0], b"a0"),
                                        Due(0, c[0], b"e0"), Due(0, e[2], b"e2"),
                                        Due(0, e[1], b"e1")]
    assert lazy.num_pending == 0 and lazy.dropped_total == 0
    assert mgr.block_pool.blocks[e[0]].ref_cnt == 0


def test_at_risk_when_freed_blocks_would_land_inside_the_horizon():
    mgr, lazy, ids = scenario()
    assert mgr.block_pool.get_num_free_blocks() == 11
    lazy.horizon_blocks = 11
    assert not lazy.at_risk(mgr.block_pool)
    lazy.horizon_blocks = 12
    assert lazy.at_risk(mgr.block_pool)


def test_reset_drops_every_remembered_block_and_keeps_pins():
    mgr, lazy, ids = scenario()
    due = lazy.due(mgr.block_pool)
    lazy.reset()
    assert lazy.dropped[RESET] == 3 and lazy.num_pending == 0 and lazy.num_in_flight == 3
    lazy.release(mgr.block_pool, [d.block_id for d in due])


def test_eviction_horizon_covers_tokens_requests_and_lookahead_of_every_group():
    assert eviction_horizon(8192, 256, [16]) == 512 + 256
    assert eviction_horizon(8192, 256, [16, 32], lookahead_tokens=3) == (
        512 + 256 * 2) + (256 + 256 * 2)
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=64,
                                                           max_num_seqs=4),
                          num_lookahead_tokens=0)
    kv = manager(8)   # only for its config's groups
    assert horizon_for(cfg, kv.kv_cache_config) == 16 + 4
    with pytest.raises(ValueError):
        LazyStore(0)


def test_a_key_taken_for_a_store_from_one_block_is_not_kept_pending_in_another():
    mgr, lazy, ids = scenario()
    a, c, e = ids["a"], ids["c"], ids["e"]
    # c2 holds a second copy of e0's key, ahead of e0 in the free queue.
    lazy.remember(mgr.block_pool, 0, [c[2]], [b"e0"])
    assert lazy.due(mgr.block_pool) == [Due(0, a[2], b"a2"), Due(0, a[1], b"a1"),
                                        Due(0, a[0], b"a0"), Due(0, c[2], b"e0")]
    # e0's key is on its way to the pool from c2: its own block is no longer needed.
    assert lazy.num_pending == 2
    new = allocate(mgr, 7)                  # reaches e0 at the queue's head
    assert e[0] in new
    lazy.note_allocated(mgr.block_pool, new)
    # e2 and e1 were lost (reused before they came due); e0's key is stored from c2.
    assert lazy.dropped == {EVICTED: 2, RESET: 0}
    assert b"e0" not in [d.key for d in lazy.all_pending(mgr.block_pool)]
