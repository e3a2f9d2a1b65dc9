"""daemon/disk_catalog.py's rules, in memory (no files, no threads): where a new block goes,
which block makes room for it, what readers protect, that the tier's bytes are never passed,
and what a restart adopts."""

from __future__ import annotations

import gc
import random

import numpy as np

from kvpool.daemon.disk_catalog import VALID, WRITING, DiskCatalog
from kvpool.daemon.disk_store import RECORD_DTYPE, Found
from kvpool.daemon.tier import TierEvents

S = 4096
NS = b"n" * 16


def key(i: int, ns: bytes = NS) -> bytes:
    return ns + i.to_bytes(16, "little")


class Heard(TierEvents):
    def __init__(self) -> None:
        self.dropped_keys: list[bytes] = []

    def dropped(self, keys: list[bytes]) -> None:
        self.dropped_keys += keys


def catalog(blocks: int, slot_bytes: int = S) -> tuple[DiskCatalog, Heard]:
    cat = DiskCatalog(blocks * slot_bytes)
    cat.events = Heard()
    return cat, cat.events


def store(cat: DiskCatalog, keys: list[bytes], slot_bytes: int = S) -> list[int]:
    """Claim and land ``keys`` as the tier would (written, then committed); their indices."""
    blocks, _ = cat.claim(keys, cat.size(slot_bytes))
    assert len(blocks) == len(keys), "no room for every key"
    for b in blocks:
        assert cat.landed(b, checksum=7)
    return [b.index for b in blocks]


def free_all(cat: DiskCatalog) -> dict[int, list[int]]:
    """What the tier frees through the store, handed back for reuse; per slot size."""
    todo = cat.take_to_free()
    for size, idx in todo.items():
        cat.reuse(size, idx)
    return {size.slot_bytes: sorted(idx) for size, idx in todo.items()}


def test_writes_fill_the_lowest_free_index_first():
    cat, _ = catalog(16)
    assert store(cat, [key(i) for i in range(8)]) == list(range(8))
    other = NS[:-1] + b"o"
    assert store(cat, [key(i, other) for i in range(8, 12)]) == [8, 9, 10, 11]
    assert cat.forget(NS) == 8
    # Released indices wait for the store: none is handed out before it has freed them.
    assert not cat.size(S).free and cat.has_to_free
    assert store(cat, [key(20)]) == [12]
    assert free_all(cat) == {S: list(range(8))}
    assert store(cat, [key(21), key(22), key(23)]) == [0, 1, 2]
    assert cat.used_bytes == 8 * S and cat.blocks == 8


def test_a_full_tier_reuses_the_oldest_unread_block_of_the_same_size_in_place():
    cat, heard = catalog(4)
    store(cat, [key(i) for i in range(4)])
    blocks, replaced = cat.claim([key(10), key(11)], cat.size(S))
    # The two oldest make room; their indices are overwritten, not freed.
    assert [b.index for b in blocks] == [0, 1] and replaced == [0, 1]
    assert heard.dropped_keys == [key(0), key(1)]
    assert not cat.has_to_free and cat.evicted_blocks == 2
    assert cat.used_bytes == 4 * S and cat.blocks == 2       # the new ones count once landed
    assert cat.leading(NS, [key(0)[16:]], S) == 0
    assert not cat.wants(key(10), S) and cat.wants(key(0), S)


def test_a_victim_of_another_size_is_freed_and_the_search_goes_on():
    cat, heard = catalog(4)
    store(cat, [key(i) for i in range(4)])                    # 4 blocks of S fill it
    blocks, replaced = cat.claim([key(10)], cat.size(2 * S))
    # A block twice as big needs two victims; neither's index can be reused in place.
    assert [b.index for b in blocks] == [0] and replaced == []
    assert heard.dropped_keys == [key(0), key(1)] and cat.evicted_blocks == 2
    assert free_all(cat) == {S: [0, 1]}
    assert cat.used_bytes == 4 * S


def test_blocks_being_read_are_never_evicted():
    cat, heard = catalog(3)
    store(cat, [key(i) for i in range(3)])
    pinned = [cat.pin(key(0), S), cat.pin(key(1), S)]
    assert all(pinned)
    assert cat.pin(key(2), 2 * S) is None, "a block of another size is not this one"
    blocks, _ = cat.claim([key(10)], cat.size(S))
    assert [b.index for b in blocks] == [2] and heard.dropped_keys == [key(2)]
    # Every other block is read or being written: nothing can make room.
    assert cat.claim([key(11)], cat.size(S)) == ([], [])
    assert cat.used_bytes == 3 * S
    # A reset while they are read drops them now and frees their space when reads end.
    assert cat.forget(NS) == 3
    assert not cat.has_to_free, "freed under a read"
    cat.unpin(pinned, bad=[])
    assert free_all(cat) == {S: [0, 1]}
    assert not cat.landed(blocks[0], 1), "forgotten while written: never served"
    assert free_all(cat) == {S: [2]} and cat.used_bytes == 0 and cat.blocks == 0


def test_the_lru_goes_past_many_blocks_being_read_keeps_use_order_and_reuses_its_ids():
    """The victim search asks the queue's head for more only past blocks being read (twelve
    here, more than its first look); a read makes a block most recently used; a full tier's
    churn reuses the queue's ids, so its arrays stay the size of what the tier holds."""
    cat, heard = catalog(20)
    store(cat, [key(i) for i in range(20)])
    pinned = [cat.pin(key(i), S) for i in range(12)]
    blocks, replaced = cat.claim([key(30)], cat.size(S))
    assert heard.dropped_keys == [key(12)] and replaced == [12]
    assert cat.landed(blocks[0], 1)
    want = [key(i) for i in range(13, 20)] + [key(i) for i in range(12)] + [key(30)]
    assert cat.held_keys() == want
    cat.unpin(pinned, bad=[])
    for i in range(100, 300):
        store(cat, [key(i)])
    assert cat.held_keys() == [key(i) for i in range(280, 300)] and cat.blocks == 20
    assert len(cat._by_id) == 20, "the queue's ids grew past what the tier holds"


def test_a_block_that_fails_verification_is_dropped_and_freed_by_its_last_reader():
    cat, heard = catalog(4)
    store(cat, [key(0), key(1)])
    first, second = cat.pin(key(0), S), cat.pin(key(0), S)
    cat.unpin([first], bad=[first])
    assert heard.dropped_keys == [key(0)] and cat.pin(key(0), S) is None
    assert not cat.has_to_free
    cat.unpin([second], bad=[])
    assert free_all(cat) == {S: [0]} and cat.used_bytes == S and cat.blocks == 1


def test_writing_blocks_are_not_served_and_a_lost_write_gives_its_bytes_back():
    cat, heard = catalog(4)
    blocks, _ = cat.claim([key(0), key(1)], cat.size(S))
    assert all(b.state == WRITING for b in blocks) and cat.leading(NS, [key(0)[16:]], S) == 0
    assert not cat.wants(key(0), S), "demoted twice while it is written"
    cat.lose(blocks)
    assert cat.used_bytes == 0 and heard.dropped_keys == [] and cat.wants(key(0), S)
    assert not cat.has_to_free, "a lost write's index is never reused (the tier is off)"


def test_the_tiers_bytes_are_never_passed():
    rng = random.Random(5)
    cat, _ = catalog(24)
    sizes = [S, 2 * S, 3 * S]
    live: list = []
    n = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.6:
            size = cat.size(rng.choice(sizes))
            blocks, _ = cat.claim([key(n + i) for i in range(rng.randint(1, 5))], size)
            n += 5
            for b in blocks:
                if rng.random() < 0.9:
                    cat.landed(b, 1)
                else:
                    cat.lose([b])
        elif op < 0.8 and live:
            cat.unpin([live.pop(rng.randrange(len(live)))], bad=[])
        elif op < 0.95:
            b = cat.pin(key(rng.randrange(max(1, n))), rng.choice(sizes))
            if b is not None:
                live.append(b)
        else:
            free_all(cat)
        assert 0 <= cat.used_bytes <= cat.capacity_bytes
        assert cat.blocks == len(cat.held_keys()) and cat.used_bytes >= cat.blocks * S


def found(slot_bytes: int, file_blocks: int, rows: list[tuple[int, bytes, int]]) -> Found:
    """What a scan finds: (index, key, seq) per valid record."""
    rec = np.zeros(len(rows), RECORD_DTYPE)
    for r, (_, k, seq) in zip(rec, rows):
        r["key"], r["checksum"], r["seq"] = k, seq * 11, seq
    return Found(slot_bytes, np.asarray([i for i, _, _ in rows], np.int64), rec, file_blocks)


def test_adopt_keeps_the_newest_copy_of_a_key_and_the_newest_blocks_that_fit():
    cat, _ = catalog(4)
    small = found(S, 8, [(0, key(0), 1), (1, key(1), 2), (2, key(0), 5), (5, key(2), 3)])
    big = found(2 * S, 3, [(0, key(3), 4), (2, key(4), 6)])
    stale = {sb: sorted(idx.tolist()) for sb, idx in cat.adopt([small, big])}
    # Newest first: key 4 (2S), key 0's copy at index 2 (S), key 3 would pass 4S: the rest go.
    assert stale == {S: [0, 1, 5], 2 * S: [0]}
    assert cat.held_keys() == [key(0), key(4)], "oldest write first"
    assert cat.adopted_blocks == cat.blocks == 2 and cat.used_bytes == 3 * S
    b = cat.pin(key(0), S)
    assert (b.index, b.checksum, b.state) == (2, 55, VALID)
    cat.unpin([b], bad=[])
    # Writes go on after the newest adopted one and fill the file's holes lowest first.
    blocks, _ = cat.claim([key(9)], cat.size(S))
    assert blocks[0].index == 0 and blocks[0].seq == 7
    assert sorted(cat.size(S).free) == [1, 3, 4, 5, 6, 7] and cat.size(2 * S).free == [0, 1]


def test_adopt_keeps_one_copy_of_a_key_even_with_room_for_both():
    cat, _ = catalog(16)
    stale = cat.adopt([found(S, 3, [(0, key(0), 3), (1, key(1), 2), (2, key(0), 1)])])
    assert [(sb, idx.tolist()) for sb, idx in stale] == [(S, [2])]
    assert cat.held_keys() == [key(1), key(0)] and cat.used_bytes == 2 * S
    assert cat.pin(key(0), S).index == 0


def test_the_collector_tracks_no_block_record():
    """A disk holds millions of blocks: none is an object the cyclic collector walks, whether
    written, adopted at a restart or churned through a full tier."""
    cat, _ = catalog(2048)
    cat.adopt([found(S, 2, [(0, key(0), 1), (1, key(1), 2)])])
    adopted = cat.pin(key(0), S)
    assert not gc.is_tracked(adopted)
    cat.unpin([adopted], bad=[])
    gc.collect()
    before = len(gc.get_objects())
    for i in range(2, 4098, 128):                           # fills, then evicts 2050
        store(cat, [key(j) for j in range(i, i + 128)])
    assert cat.evicted_blocks == 2050
    assert not any(gc.is_tracked(cat.pin(key(i), S)) for i in range(2050, 4098))
    grown = len(gc.get_objects()) - before
    assert grown < 600, f"{grown} more objects tracked after 4096 blocks written"
