"""The key table (daemon/key_table.py): a dict's behaviour over 256 dicts, the same on the C and
the Python passes, and each dict a 256th of the keys (what bounds the loop's stall when one
rebuilds)."""

from __future__ import annotations

import random

import pytest

from kvpool.daemon import key_table
from kvpool.daemon.key_table import EMPTY, SHARDS, KeyTable, shard_index


def _kinds():
    return [key_table.PYTHON] + ([key_table.COMPILED] if key_table.COMPILED else [])


@pytest.fixture(params=["python", "compiled"])
def passes(request):
    if request.param == "compiled" and key_table.COMPILED is None:
        pytest.skip("daemon/_key_table.c is not built")
    return getattr(key_table, request.param.upper())


def _contents(table: KeyTable) -> list[dict]:
    return [dict(d) for d in table.shards]


def test_random_use_leaves_both_kinds_alike_and_a_dict_alike():
    """Batches and single keys, in a random mix: every answer, and every key's dict, the same
    on both kinds of passes, and the same answers as one plain dict."""
    rng = random.Random(7)
    universe = [rng.randbytes(16) for _ in range(3000)] + [b"%016d" % i for i in range(3000)]
    tables = [KeyTable(p) for p in _kinds()]
    plain: dict[bytes, int] = {}
    for step in range(400):
        op = rng.choice(["put", "delete", "find", "holds", "one"])
        batch = rng.sample(universe, rng.randint(0, 64))
        if op == "put":
            values = [rng.randint(0, 1 << 40) for _ in batch]
            for t in tables:
                t.put_many(batch, values)
            plain.update(zip(batch, values))
        elif op == "delete":
            held = [k for k in batch if k in plain]
            for t in tables:
                t.delete_many(held)
            for k in held:
                del plain[k]
        elif op == "find":
            want = [plain.get(k) for k in batch]
            assert all(t.find(batch) == want for t in tables), f"step {step}"
        elif op == "holds":
            want = any(k in plain for k in batch)
            assert all(t.holds_any(batch) is want for t in tables), f"step {step}"
        else:
            k = batch[0] if batch else universe[0]
            for t in tables:
                t[k] = step
            plain[k] = step
            assert all(t.get(k) == step and k in t and t[k] == step for t in tables)
    contents = [_contents(t) for t in tables]
    assert all(c == contents[0] for c in contents), "a key sits in another dict on one kind"
    for t in tables:
        assert len(t) == len(plain) and bool(t) == bool(plain)
        assert dict(t.items()) == plain and set(t) == set(t.keys()) == set(plain)
        assert sorted(t.values()) == sorted(plain.values())
        for k in plain:
            assert k in t.shards[shard_index(k)]


def test_each_dict_holds_about_a_256th_of_the_keys():
    """Random hashes and counters alike (tests' keys are counters): no dict holds more than
    twice its share, so a dict's rebuild moves about 1/256 of a namespace's blocks."""
    rng = random.Random(1)
    for keys in ([rng.randbytes(16) for _ in range(200_000)],
                 [b"%016d" % i for i in range(200_000)],
                 [(b"%06d" % i).ljust(16, b"k") for i in range(200_000)]):
        t = KeyTable()
        t.put_many(keys, range(len(keys)))
        sizes = [len(d) for d in t.shards]
        assert len(sizes) == SHARDS and sum(sizes) == len(keys)
        assert max(sizes) < 2 * len(keys) / SHARDS, f"largest dict {max(sizes)} of {len(keys)}"


def test_a_missing_key_in_a_delete_raises_after_the_keys_before_it(passes):
    t = KeyTable(passes)
    t.put_many([b"a" * 16, b"b" * 16, b"c" * 16], [1, 2, 3])
    with pytest.raises(KeyError):
        t.delete_many([b"a" * 16, b"nope" * 4, b"c" * 16])
    assert dict(t.items()) == {b"b" * 16: 2, b"c" * 16: 3}
    with pytest.raises(KeyError):
        del t[b"nope" * 4]
    with pytest.raises(KeyError):
        t[b"nope" * 4]


def test_unhashable_keys_and_bad_tables_are_refused(passes):
    t = KeyTable(passes)
    t.put_many([b"a" * 16], [1])
    for call in (lambda: t.find([b"a" * 16, []]), lambda: t.put_many([[]], [2]),
                 lambda: t.holds_any([{}]), lambda: t.delete_many([[]])):
        with pytest.raises(TypeError):
            call()
    assert dict(t.items()) == {b"a" * 16: 1}, "a refused batch changed the table"
    with pytest.raises(TypeError):
        passes.find({}, [b"a" * 16])
    with pytest.raises(TypeError):
        passes.find(t.shards[:-1], [b"a" * 16])


def test_put_stops_at_the_shorter_and_takes_any_iterable(passes):
    t = KeyTable(passes)
    t.put_many(iter([b"a" * 16, b"b" * 16, b"c" * 16]), (v for v in [1, 2]))
    assert dict(t.items()) == {b"a" * 16: 1, b"b" * 16: 2}
    t.delete_many(k for k in [b"a" * 16])
    assert t.find(iter([b"a" * 16, b"b" * 16])) == [None, 2]


def test_the_empty_table_is_empty():
    assert not EMPTY and len(EMPTY) == 0 and EMPTY.find([b"a" * 16]) == [None]
    assert not EMPTY.holds_any([b"a" * 16]) and list(EMPTY.values()) == []
