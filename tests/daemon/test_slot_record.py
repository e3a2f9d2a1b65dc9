"""A pool slot's record and its batch passes (daemon/slot_record.py, daemon/_slot_record.c):
the compiled record and the Python one do the same to the same slots, and the whole store and
load path ends in one state on either."""

from array import array
import gc

import msgspec
import pytest

from kvpool.daemon import slot_record
from kvpool.daemon.index import FILLING, Index
from kvpool.daemon.key_table import KeyTable
from kvpool.daemon.pool import COMMITTED, FREE, WRITING, Pool
from tests.daemon.indexkit import (BIG, NS_BIG, NS_SMALL, NS_TP2, SMALL, TP2,
                                   drive_random_stores, records_match_slots, store_state)

FIELDS = ("id", "extent", "index", "offset", "size_class", "state", "ns", "key", "block_hash",
          "ref", "pins", "reads", "landed", "writing", "owner", "deadline", "last_use", "doomed",
          "void", "ticket", "generation")
NS = b"n" * 16
REF_LIMIT = 1 << 63


def _fields(s) -> tuple:
    return tuple(getattr(s, f) for f in FIELDS)


def _both():
    """(python, compiled) records, skipping where the compiled one could not be built."""
    return slot_record.PYTHON, slot_record.COMPILED


def _slots(records, n=4, gens=(0, 5, 0x7FFF_FFFF, 9)):
    return records.make_slots(64, 1, 4096, 512, "cls", list(gens[:n]))


def _rows(slots, stride=64):
    """``slots`` as the rows of ``Extents.slots`` (extent -> its slots by index)."""
    rows: list = [None] * (max(s.id for s in slots) // stride + 1)
    for s in slots:
        e, i = divmod(s.id, stride)
        row = rows[e] = rows[e] or []
        row.extend([None] * (i + 1 - len(row)))
        row[i] = s
    return rows


def test_a_record_has_the_dataclass_fields_and_defaults(slot_records):
    s = slot_records.Slot(3, 1, 2, 4096, "cls")
    want = slot_record.Slot(3, 1, 2, 4096, "cls")
    assert _fields(s) == _fields(want)
    s.doomed, s.void = 1, []             # any truth value, as the dataclass takes it
    assert bool(s.doomed) and not s.void
    s.landed = 1 << 100                  # a unit per KV head: past 64 bits for some models
    s.landed |= 1
    assert s.landed == (1 << 100) | 1
    s.ref = (7 << 32) | 3
    assert s.generation == 7
    kw = slot_records.Slot(-1, -1, -1, 0, "v", state=WRITING, ns=NS, key=NS + b"h" * 16,
                           block_hash=b"h" * 16, owner=5, deadline=2.5, void=True, ticket=99)
    assert (kw.state, kw.key, kw.owner, kw.deadline, kw.void, kw.ticket) == (
        WRITING, NS + b"h" * 16, 5, 2.5, True, 99)


def test_made_slots_have_their_ids_offsets_and_recorded_generations(slot_records):
    slots = _slots(slot_records)
    assert [(s.id, s.extent, s.index, s.offset, s.generation, s.ref & 0xFFFF_FFFF)
            for s in slots] == [(64 + i, 1, i, 4096 + 512 * i, g, 64 + i)
                                for i, g in enumerate((0, 5, 0x7FFF_FFFF, 9))]


def test_every_pass_does_the_same_to_the_same_slots(compiled_slot_record):
    """claim, end (partial, full, failed, already doomed, bindings theirs or another's),
    commit, evict and the record lists, on both kinds: every field equal after each pass, the
    same answers."""
    out = []
    for records in _both():
        slots = _slots(records)
        seen = []
        gens = records.claim(slots, [b"%016d" % i for i in range(4)], [11, 12, 13, 14], NS,
                             WRITING, 7, 9.5, 0b11, 1, REF_LIMIT)
        seen.append((gens, [_fields(s)[5:] for s in slots]))
        slots[3].doomed = True
        other = records.Slot(0, 0, 0, 0, "x")
        bound = {11: slots[0], 12: other, 14: slots[3]}
        ready, doomed = records.end(slots, 0b01, True, 0b01, bound)
        seen.append(([s.id for s in ready], [s.id for s in doomed], sorted(bound),
                     [_fields(s)[5:] for s in slots]))
        ready2, doomed2 = records.end(slots[:1], 0b10, False, 0b11, {})
        seen.append(([s.id for s in ready2], [s.id for s in doomed2], _fields(slots[0])[5:]))
        slots[2].pins = 2
        writing = {s.id: s for s in slots[1:3]}
        filling = {slots[3].id: slots[3]}
        evictable = records.commit(slots[1:], 40, COMMITTED, writing, filling)
        seen.append(([s.id for s in evictable], sorted(writing), sorted(filling),
                     [_fields(s)[5:] for s in slots]))
        seen.append((records.evict(slots[1:2], FREE), _fields(slots[1])[5:]))
        seen.append(records.record_lists(slots))
        out.append(seen)
    python, compiled = out
    for step, (p, c) in enumerate(zip(python, compiled)):
        assert p == c, f"pass {step} differs: python {p} / compiled {c}"


def test_what_a_batch_shares_is_read_alike_on_both_records(compiled_slot_record):
    """``batch_of``: one namespace (equal bytes, not only the same object), one size class (the
    same object), one extent, and the slots being read; mixed batches say None and -1."""
    out = []
    for records in _both():
        a, b = records.make_slots(0, 3, 0, 64, "cls", [0] * 3), \
            records.make_slots(64, 4, 0, 64, "other", [0])
        for s in a:
            s.ns = bytes(NS)                  # equal, separate objects (as adopted slots are)
        b[0].ns = b"m" * 16
        a[1].reads = 2
        out.append([records.batch_of(x) for x in (a, a[:1], a + b, [], a[:2] + [
            records.Slot(9, 3, 0, 0, "cls", ns=NS)])])
    python, compiled = out
    assert python == compiled
    assert python[0] == (NS, "cls", 3, 1) and python[2] == (None, None, -1, 1)
    assert python[3] == (None, None, -1, 0)


def test_the_load_passes_do_the_same_to_the_same_slots(compiled_slot_record):
    """resolve (held, stale generation, filling, free, doomed, another namespace, 0, an id no
    slot has, refs past 64 bits and negative), pin, touch and unpin (last pins, doomed, a
    draining extent, free, pinned twice in one batch) and the offsets, on both kinds: the same
    answers and every field and extent stamp equal after each pass."""
    out = []
    for records in _both():
        slots = _slots(records) + records.make_slots(68, 2, 8192, 512, "cls", [0, 0])
        for i, s in enumerate(slots):
            s.state, s.ns = COMMITTED, NS
        slots[1].state = FILLING
        slots[2].state = FREE
        slots[3].doomed = True
        slots[5].ns = b"m" * 16
        rows = _rows(slots)
        refs = [s.ref for s in slots] + [slots[0].ref + (1 << 32), 0, 999, 1 << 70, -5,
                                         (1 << 64) + slots[0].id, (7 << 32) | 70]
        found, redo = records.resolve(refs, rows, 64, NS, COMMITTED, FILLING)
        seen = [([None if s is None else s.id for s in found], redo)]
        seen.append([s.id for s in records.slots_of(rows, 64, [69, 64, 68, 64])])
        newest = [0] * 3
        seen.append(([s.id for s in records.pin(slots + slots[:1], 7, newest, COMMITTED)],
                     newest[:], [_fields(s)[5:] for s in slots]))
        seen.append(([s.id for s in records.touch(slots[4:] + slots[:1], 8, newest)],
                     newest[:], [_fields(s)[5:] for s in slots]))
        slots[4].pins += 1
        evictable, to_free = records.unpin(slots, 9, newest, COMMITTED, FREE, {2: "new size"})
        seen.append(([s.id for s in evictable], [s.id for s in to_free], newest[:],
                     [_fields(s)[5:] for s in slots]))
        evictable, to_free = records.unpin(slots[:1] + slots[4:5], 10, newest, COMMITTED, FREE,
                                           {})
        seen.append(([s.id for s in evictable], [s.id for s in to_free], newest[:],
                     [_fields(s)[5:] for s in slots]))
        seen.append([s.id for s in records.touch(slots, 11, newest)])
        seen.append(bytes(records.offsets(slots)))
        out.append(seen)
    python, compiled = out
    for step, (p, c) in enumerate(zip(python, compiled)):
        assert p == c, f"pass {step} differs: python {p} / compiled {c}"
    held, redo = python[0]
    assert held[:6] == [64, 65, None, None, 68, None]
    assert redo == [2, 3, 5, 6, 7, 8, 9, 10, 11, 12] and python[1] == [69, 64, 68, 64]
    assert python[2][0] == [64, 68, 69] and python[3][0] == []      # (pinned: not queued)
    assert python[4][:2] == ([], [67, 69]) and python[5][:2] == ([64, 68], [])


def test_a_lookups_walk_is_alike_on_both_records(compiled_slot_record):
    """``leading``: held slots from the first key on (committed and filling), up to the first
    key missing, free, doomed or writing; the same slots and refs on both kinds."""
    out = []
    for records in _both():
        slots = records.make_slots(0, 0, 0, 64, "cls", [3, 4, 5, 6, 7])
        table = KeyTable()
        table.put_many([b"h%d" % i for i in range(5)], slots)
        shards = table.shards
        for s, state in zip(slots, (COMMITTED, FILLING, COMMITTED, WRITING, COMMITTED)):
            s.state = state
        walks = [records.leading(shards, [b"h0", b"h1", b"h2", b"h3", b"h4"], COMMITTED,
                                 FILLING),
                 records.leading(shards, [b"h4", b"nope", b"h0"], COMMITTED, FILLING),
                 records.leading(shards, [], COMMITTED, FILLING)]
        slots[0].doomed = True
        walks.append(records.leading(shards, [b"h0", b"h1"], COMMITTED, FILLING))
        # what is not a key table's 256 dicts is refused
        for not_shards in ({b"h0": slots[0]}, table.shards[:255]):
            with pytest.raises(TypeError):
                records.leading(not_shards, [b"h0"], COMMITTED, FILLING)
        out.append([([s.id for s in run], refs) for run, refs in walks])
    python, compiled = out
    assert python == compiled
    assert python[0] == ([0, 1, 2], [(3 << 32) | 0, (4 << 32) | 1, (5 << 32) | 2])
    assert python[1] == ([4], [(7 << 32) | 4]) and python[2] == python[3] == ([], [])


@pytest.mark.parametrize("bad, error", [
    ("not a slot", TypeError),
    ("extent", IndexError),
])
@pytest.mark.parametrize("pass_name", ["pin", "unpin", "touch"])
def test_a_bad_load_pass_raises_and_changes_no_slot(slot_records, pass_name, bad, error):
    slots = _slots(slot_records)
    newest = [0] * 2
    if bad == "extent":
        batch = slots + slot_records.make_slots(80, 2, 0, 512, "cls", [0])
    else:
        batch = slots[:2] + [object()] + slots[2:]
    before = [_fields(s) for s in slots]
    args = {"pin": (batch, 3, newest, COMMITTED), "touch": (batch, 3, newest),
            "unpin": (batch, 3, newest, COMMITTED, FREE, {})}[pass_name]
    with pytest.raises(error):
        getattr(slot_records, pass_name)(*args)
    assert [_fields(s) for s in slots] == before and newest == [0, 0]


def test_resolve_names_a_ref_that_is_not_an_int(slot_records):
    with pytest.raises(TypeError, match=r"refs\[1\] is a str"):
        slot_records.resolve([0, "7"], [], 64, NS, COMMITTED, FILLING)


@pytest.mark.parametrize("ids", [[64, 999_999], [64, 71], [64, 69], [64, -1], [64, 1 << 70],
                                 [64, "64"], [64, 3]])
def test_slots_of_an_id_that_names_no_slot_is_a_key_error(slot_records, ids):
    """Past the rows, past a row, a gap in one, negative, too big, not an int, an extent with
    no row: each a KeyError naming the id."""
    rows = _rows(_slots(slot_records) + slot_records.make_slots(70, 1, 0, 8, "c", [0]))
    assert slot_records.slots_of(rows, 64, [70])[0].id == 70
    with pytest.raises(KeyError) as e:
        slot_records.slots_of(rows, 64, ids)
    assert e.value.args == (ids[1],)


def test_slots_of_and_resolve_refuse_bad_rows_and_strides(slot_records):
    rows = _rows(_slots(slot_records))
    for call in (lambda: slot_records.slots_of(rows, 0, [64]),
                 lambda: slot_records.resolve([65], rows, -64, NS, COMMITTED, FILLING)):
        with pytest.raises(ValueError):
            call()
    rows[1] = "not a row"
    with pytest.raises(TypeError):
        slot_records.slots_of(rows, 64, [64])


def test_a_claim_past_the_last_generation_starts_again_at_the_slot_id(slot_records):
    slots = _slots(slot_records)
    gens = slot_records.claim(slots, [b"k" * 16] * 4, None, NS, WRITING, 1, 0.0, 0, 0,
                              REF_LIMIT)
    assert gens == [1, 6, 0, 10]
    assert slots[2].ref == slots[2].id
    assert all(s.ticket == 0 and s.pins == 0 for s in slots)


@pytest.mark.parametrize("bad, error", [
    (dict(hashes=[b"k" * 16] * 3), ValueError),
    (dict(tickets=[1, 2]), ValueError),
    (dict(hashes=[b"k" * 16, b"k" * 16, "text", b"k" * 16]), TypeError),
    (dict(slots="swap"), TypeError),
])
def test_a_bad_claim_raises_and_changes_no_slot(slot_records, bad, error):
    slots = _slots(slot_records)
    args = dict(slots=slots, hashes=[b"k" * 16] * 4, tickets=[1, 2, 3, 4])
    if bad.get("slots") == "swap":
        args["slots"] = slots[:3] + [object()]
    else:
        args.update(bad)
    before = [_fields(s) for s in slots]
    with pytest.raises(error):
        slot_records.claim(args["slots"], args["hashes"], args["tickets"], NS, WRITING, 1, 0.0,
                           1, 1, REF_LIMIT)
    assert [_fields(s) for s in slots] == before


def test_the_compiled_passes_name_what_is_not_a_slot(compiled_slot_record):
    for call in (lambda: compiled_slot_record.end([1], 1, True, 1, {}),
                 lambda: compiled_slot_record.commit([None], 1, COMMITTED, {}, {}),
                 lambda: compiled_slot_record.evict([slot_record.Slot(1, 1, 1, 1, "c")], FREE)):
        with pytest.raises(TypeError, match=r"\[0\] is a .*not a slot"):
            call()


def test_a_cycle_through_a_compiled_slot_is_collected(compiled_slot_record):
    """Slots and their size class refer to each other (its free list holds them): the
    compiled record takes part in the cycle collector."""

    class SizeOfThisTest:
        pass

    size = SizeOfThisTest()
    size.free = compiled_slot_record.make_slots(0, 0, 0, 64, size, [0] * 8)
    del size
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is SizeOfThisTest], \
        "a size class and its compiled slots outlived their last outside reference"


@pytest.mark.parametrize("seed", [1, 2])
def test_the_store_path_ends_in_one_state_on_either_record(pool_config, compiled_slot_record,
                                                          monkeypatch, seed):
    """The same random stores (fresh and held keys, second ranks late or never, failed jobs,
    leases, expiries, evictions throughout) through an index on compiled slots and on the
    dataclass: every slot's fields, key, queue, count and record equal."""
    states = []
    for records in _both():
        monkeypatch.setattr(slot_record, "RECORDS", records)
        cfg = msgspec.structs.replace(pool_config,
                                      pool_name=f"{pool_config.pool_name}-{records.name}")
        pool = Pool.open(cfg)
        try:
            base = int(pool._rec_generation[0])
            ix = Index(pool, lease_ttl_s=10, write_timeout_s=60)
            assert all(type(s) is records.Slot for s in ix.table.slots.values())
            for ns, layout in ((NS_SMALL, SMALL), (NS_BIG, BIG), (NS_TP2, TP2)):
                ix.register_namespace(ns, layout)
            drive_random_stores(ix, seed)
            records_match_slots(ix)
            slots = {i: tuple(getattr(s, f) for f in FIELDS if f not in ("size_class", "ref",
                                                                          "generation"))
                     + ((s.generation - base) & 0x7FFF_FFFF, s.size_class.slot_bytes)
                     for i, s in ix.table.slots.items()}
            states.append((slots,) + store_state(ix, base))
        finally:
            pool.close(unlink=True)
    python, compiled = states
    for part, a, b in zip(("slots", "tables", "lru", "free", "bound", "counts", "records"),
                          python, compiled):
        assert a == b, f"the {part} differ between the Python and the compiled slot records"


def test_a_namespaces_queued_slots_and_committed_hashes_are_alike_on_both_records(
        compiled_slot_record):
    """``of_namespace`` keeps a queue order's slots of one namespace, in that order;
    ``committed_hashes`` the committed, undoomed blocks of one namespace, pinned or not, in
    slot order. An id that names no slot, a torn order and a namespace that is no bytes are
    refused."""
    out = []
    for records in _both():
        slots = _slots(records) + records.make_slots(70, 1, 0, 8, "c", [0, 0])
        for i, s in enumerate(slots):
            s.state, s.ns, s.block_hash = COMMITTED, b"A" * 16 if i % 3 else b"B" * 16, bytes([i])
        slots[1].pins = 1                                   # leased
        slots[2].pins, slots[2].doomed = 1, True            # reset while leased
        slots[4].pins, slots[4].state = 1, WRITING          # a store's pin: not committed
        slots[3].pins = 2                                   # of B
        rows = _rows(slots)                                 # ids 68, 69 a gap; extent 0 none
        order = array("q", [71, 64, 70, 66, 65, 67]).tobytes()
        ns = bytes(b"A" * 16)                               # equal, not the same object
        out.append(([s.id for s in records.of_namespace(rows, 64, order, ns)],
                    records.of_namespace(rows, 64, b"", ns),
                    records.committed_hashes(rows, ns, COMMITTED),
                    records.committed_hashes(rows, b"B" * 16, COMMITTED)))
        for bad, error in ((array("q", [68]).tobytes(), KeyError),
                           (array("q", [-1]).tobytes(), KeyError),
                           (array("q", [64 * 9]).tobytes(), KeyError), (b"1234", ValueError)):
            with pytest.raises(error):
                records.of_namespace(rows, 64, bad, ns)
        with pytest.raises(TypeError):
            records.of_namespace(rows, 64, order, "A" * 16)
        with pytest.raises(TypeError):
            records.committed_hashes(rows, "A" * 16, COMMITTED)
        with pytest.raises(TypeError):
            records.committed_hashes([None, "not a row"], ns, COMMITTED)
    assert out[0] == out[1]
    assert out[0] == ([71, 70, 66, 65], [], [b"\x01", b"\x05"], [b"\x00", b"\x03"])


def test_held_count_is_alike_on_both_records(compiled_slot_record):
    """``held_count``: committed slots pinned or read, over rows with gaps and extents with
    none; what is not a row is refused."""
    out = []
    for records in _both():
        slots = _slots(records) + records.make_slots(70, 1, 0, 8, "c", [0, 0])
        for s in slots:
            s.state = COMMITTED
        slots[0].pins = 1                                   # leased
        slots[1].reads = 2                                  # a lower tier reads it
        slots[2].pins, slots[2].state = 1, WRITING          # a store's pin: not committed
        slots[4].reads, slots[4].state = 1, FREE
        rows = _rows(slots)                                 # ids 68, 69 a gap; extent 0 none
        out.append(records.held_count(rows, COMMITTED))
        with pytest.raises(TypeError):
            records.held_count([None, "not a row"], COMMITTED)
    assert out == [2, 2]
