"""What the index's tests share: layouts, namespaces, keys and a few drivers (tests of
daemon/index.py, daemon/stores.py and daemon/namespaces.py)."""

import random

from kvpool.daemon.index import Index
from kvpool.daemon.pool import GENERATION_MASK
from kvpool.shared.layout import Layout

BIG = Layout(16, 1, "f16", (256 << 10,), "big")        # 4 slots per 1 MiB extent
SMALL = Layout(16, 1, "f16", (4096,), "small")
TP2 = Layout(16, 2, "f16", (4096,), "tp2")
NS_BIG, NS_SMALL, NS_TP2 = b"B" * 16, b"S" * 16, b"T" * 16
NS_A, NS_B = b"A" * 16, b"Q" * 16
OWNER, OTHER = 1, 2
NOT_STORED = -1     # what ``store`` answers for a key that got no slot (duplicate or no room)


def keys(n, prefix=b""):
    return [(prefix + b"%06d" % i).ljust(16, b"k") for i in range(n)]


def make_index(pool, **kw):
    ix = Index(pool, lease_ttl_s=10, write_timeout_s=60, **kw)
    ix.register_namespace(NS_BIG, BIG)
    ix.register_namespace(NS_SMALL, SMALL)
    ix.register_namespace(NS_TP2, TP2)
    return ix


def store(ix, ns, ks, now=0.0, ranks=(0,), owner=OWNER):
    """Store ``ks`` through tickets, every rank in turn; per key the slot ref it landed in, or
    ``NOT_STORED`` (a duplicate, or no room)."""
    tickets = ix.reserve(ns, len(ks), owner, now)
    assert len(tickets) == len(ks), "the owner's ticket cap"
    first = None
    for rank in ranks:
        slots = ix.begin_store(ns, tickets, ks, rank, now=now)
        first = first or slots
        ix.end_store(slots, rank, ok=True)
    return [NOT_STORED if s.void else s.ref for s in first]


def bind(ix, ns, ks, rank=0, now=0.0, owner=OWNER):
    """Reserve tickets for ``ks`` and open rank ``rank``'s store of them (WRITING, pinned by
    the job): (tickets, slots)."""
    tickets = ix.reserve(ns, len(ks), owner, now)
    return tickets, ix.begin_store(ns, tickets, ks, rank, now=now)


def capacity(ix, layout, ns):
    """Fill ``ns`` one block at a time, each pinned by a lease, until a store finds no room;
    returns how many fit."""
    n = 0
    while True:
        if store(ix, ns, keys(1, b"cap%d" % n))[0] == NOT_STORED:
            ix.stores.stats.no_room_blocks -= 1     # the probe is not the test's store
            return n
        ix.lookup(ns, [keys(1, b"cap%d" % n)], True, OWNER, 0)   # pin it: never evicted
        n += 1


def head_layout(tp: int, heads: int = 4, row: int = 256, rows: int = 16) -> Layout:
    """A head-split layout of ``heads`` KV heads as one rank of ``tp`` holds it."""
    local = max(1, heads // tp)
    return Layout(16, tp, "f16", (rows * local * row // 2,) * 2, "heads", heads, row)


def records_match_slots(ix):
    """Every slot's pool record says what the index would adopt: COMMITTED with its key for a
    committed slot, WRITING for one being written or filled, FREE for a free one;
    and the slot's current generation (the one in its ref)."""
    from kvpool.daemon.index import FILLING
    from kvpool.daemon.pool import COMMITTED, FREE, WRITING
    want_state = {FREE: FREE, WRITING: WRITING, FILLING: WRITING, COMMITTED: COMMITTED}
    for s in ix.table.slots.values():
        rec = ix.pool.records(s.extent)[s.index]
        assert int(rec["state"]) == want_state[s.state], (s.id, s.state)
        assert int(rec["generation"]) == s.generation, s.id
        if s.state == COMMITTED:
            assert bytes(rec["key"]) == s.key


def pins_of(ix, refs):
    slots = ix.table.slots
    return [(slots[r & 0xFFFF_FFFF].pins, slots[r & 0xFFFF_FFFF].writing) for r in refs]


def pinned_total(ix):
    return sum(s.pins for s in ix.table.slots.values())


def bound_tp2(ix, ks):
    """TP2 tickets bound to ``ks`` by rank 0's store; (refs, 1) for rank 1's."""
    refs = ix.reserve(NS_TP2, len(ks), OWNER, 0)
    ix.begin_store(NS_TP2, refs, ks, 0, now=0)
    return refs, 1


def pool_slots(pool, layout):
    return pool.geometry.num_extents * pool.slots_per_extent(layout.slot_bytes)


def fill_pool(ix, ns, n, prefix=b"full"):
    """``n`` committed blocks of ``ns``, stored in batches; their keys."""
    ks = keys(n, prefix)
    for i in range(0, n, 256):
        store(ix, ns, ks[i:i + 256])
    return ks


def store_state(ix, base: int):
    """Everything a store changes, by key and by slot id: maps, states, generations (from the
    pool's random first one, ``base``), landing, pins, owners, the LRU order, counts, tickets
    and records."""
    mask = GENERATION_MASK
    tables = {ns: {h: (s.id, s.state, (s.generation - base) & mask, s.landed, s.writing, s.pins,
                       s.owner)
                   for h, s in t.items()} for ns, t in ix.table.tables.items() if t}
    lru = {c.slot_bytes: list(c.lru) for c in ix.extents.classes.values()}
    free = {c.slot_bytes: [s.id for s in c.free] for c in ix.extents.classes.values()}
    bound = sorted((r, s.void, s.id, s.key) for r, s in ix.stores.bound.items())
    counts = (dict(ix.namespaces.bytes_used), dict(ix.namespaces.blocks), ix.slot_counts(),
              vars(ix.stores.stats), vars(ix.table.stats), ix.ticket_count)
    pool = ix.pool
    records = (pool._rec_key.tobytes(), pool._rec_state.tobytes(),
               ((pool._rec_generation.astype("int64") - base) & mask).tobytes())
    return tables, lru, free, bound, counts, records


def drive_random_stores(ix, seed: int) -> None:
    """A random mix of stores on a small pool: fresh keys and keys held already, TP2 blocks
    whose second rank lands later or never, failed jobs, leases, loads (their refs found,
    stale or 0, pinned for a while) and hits read from the shared index; evictions
    throughout."""
    rng = random.Random(seed)
    universe = keys(400, b"u")
    open_tp2: list = []
    loading: list = []
    now = 0.0
    for step in range(300):
        _random_loads(ix, rng, universe, loading, now)
        now += 0.01
        ns, layout = rng.choice([(NS_SMALL, SMALL), (NS_BIG, BIG), (NS_TP2, TP2)])
        n = rng.choice([1, 2, 5, 16, 40]) if ns != NS_BIG else rng.choice([1, 2, 5, 16])
        fresh = rng.random() < 0.6
        ks = keys(n, b"f%d-" % step) if fresh else rng.sample(universe, n)
        tickets = ix.reserve(ns, n, OWNER, now)
        slots = ix.begin_store(ns, tickets, ks, 0, now=now)
        ix.end_store(slots, 0, ok=rng.random() > 0.05)
        if ns == NS_TP2:
            open_tp2.append((tickets, ks))
        if open_tp2 and rng.random() < 0.5:
            t, k = open_tp2.pop(rng.randrange(len(open_tp2)))
            try:
                ix.end_store(ix.begin_store(NS_TP2, t, k, 1, now=now), 1, True)
            except Exception:
                pass                            # dropped meanwhile (failed rank 0, timeout)
        if rng.random() < 0.2:
            hit_ns = rng.choice([NS_SMALL, NS_BIG])
            _, leases, _ = ix.lookup(hit_ns, [rng.sample(universe, 3)], True, OWNER, now)
            if rng.random() < 0.7:
                ix.release_leases(leases, OWNER)
        if step % 50 == 49:
            ix.expire(now + 100)
    for slots in loading:
        ix.end_load(slots, True)


def _random_loads(ix, rng, universe, loading, now):
    """``drive_random_stores``'s loads and hits: a load of four keys by the refs a lookup gave
    (one made stale at times: found again by key; past the hits, 0), its slots pinned until a
    later step ends it; hits of a scheduler's index read made recent."""
    ns = rng.choice([NS_SMALL, NS_BIG, NS_TP2])
    if rng.random() < 0.3:
        ks = rng.sample(universe, 4)
        refs = ix.lookup(ns, [ks], False, OWNER, now)[2][0]
        refs = refs + [0] * (len(ks) - len(refs))
        if refs[0] and rng.random() < 0.3:
            refs[0] += 1 << 32
        found = [s for s in ix.resolve_load(ns, refs, ks) if s is not None]
        ix.pin(found)
        loading.append(found)
    if loading and rng.random() < 0.3:
        ix.end_load(loading.pop(rng.randrange(len(loading))), rng.random() < 0.9)
    if rng.random() < 0.2:
        ix.touch(ns, rng.sample(universe, 5))
