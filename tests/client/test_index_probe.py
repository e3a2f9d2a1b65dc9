"""The compiled probe (client/_index_probe.c) refuses arguments it cannot read safely, with a
clear error, instead of reading past a buffer. What it finds is tested in test_index_reader.py
and tests/daemon/test_index_segment.py, with numpy's probe beside it."""

import numpy as np
import pytest

from kvpool.shared import index_format as f


@pytest.fixture
def probe(compiled_index_probe):
    return compiled_index_probe.probe


def _out(n):
    return np.zeros(n, np.uint64), np.zeros(n, np.uint64)


def test_a_well_formed_call_on_an_empty_table_finds_nothing(probe):
    table = bytes(f.HEADER_BYTES + 16 * f.ENTRY_BYTES)
    locs, refs = _out(3)
    assert probe(table, 16, f.MAX_PROBE, b"n" * 16, b"k" * 48, False, locs, refs) == 3
    assert locs.tolist() == [0, 0, 0] and refs.tolist() == [0, 0, 0]
    assert probe(table, 16, f.MAX_PROBE, b"n" * 16, b"k" * 48, True, locs, refs) == 0
    # without outputs: lists; hashes as a list of bytes read like them joined
    assert probe(table, 16, f.MAX_PROBE, b"n" * 16, [b"k" * 16] * 3, False) == \
        (3, [0, 0, 0], [0, 0, 0])
    assert probe(table, 16, f.MAX_PROBE, b"n" * 16, (b"k" * 16,), True) == (0, [], [])


@pytest.mark.parametrize("capacity, table_entries, ns, hashes, out_n, why", [
    (12, 16, 16, 32, 2, "power of two"),
    (32, 16, 16, 32, 2, "shorter than its capacity"),
    (16, 16, 15, 32, 2, "16 bytes"),
    (16, 16, 16, 33, 2, "16 bytes each"),
    (16, 16, 16, 48, 2, "locs: needs 3"),
])
def test_malformed_arguments_raise_value_error(probe, capacity, table_entries, ns, hashes,
                                               out_n, why):
    table = bytes(f.HEADER_BYTES + table_entries * f.ENTRY_BYTES)
    locs, refs = _out(out_n)
    with pytest.raises(ValueError, match=why):
        probe(table, capacity, f.MAX_PROBE, b"n" * ns, b"k" * hashes, False, locs, refs)


@pytest.mark.parametrize("hashes, why", [
    ([b"k" * 16, b"k" * 15], r"hashes\[1\]: not 16 bytes"),
    ([b"k" * 16, "k" * 16], r"hashes\[1\]: not 16 bytes"),
])
def test_a_hash_list_with_a_bad_item_raises_value_error(probe, hashes, why):
    table = bytes(f.HEADER_BYTES + 16 * f.ENTRY_BYTES)
    with pytest.raises(ValueError, match=why):
        probe(table, 16, f.MAX_PROBE, b"n" * 16, hashes, False)


def test_one_output_without_the_other_raises_value_error(probe):
    table = bytes(f.HEADER_BYTES + 16 * f.ENTRY_BYTES)
    with pytest.raises(ValueError, match="both or neither"):
        probe(table, 16, f.MAX_PROBE, b"n" * 16, b"k" * 16, False, np.zeros(1, np.uint64))


def test_more_hashes_than_fit_on_the_stack_are_read_too(probe):
    table = bytes(f.HEADER_BYTES + 16 * f.ENTRY_BYTES)
    n, refs, locs = probe(table, 16, f.MAX_PROBE, b"n" * 16, [b"k" * 16] * 2000, False)
    assert n == 2000 and refs == [0] * 2000 and locs == [0] * 2000


def test_read_only_outputs_are_refused(probe):
    table = bytes(f.HEADER_BYTES + 16 * f.ENTRY_BYTES)
    with pytest.raises(BufferError, match="not writable"):
        probe(table, 16, f.MAX_PROBE, b"n" * 16, b"k" * 16, False, bytes(8), bytes(8))
