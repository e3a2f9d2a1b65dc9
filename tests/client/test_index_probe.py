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


def test_read_only_outputs_are_refused(probe):
    table = bytes(f.HEADER_BYTES + 16 * f.ENTRY_BYTES)
    with pytest.raises(TypeError):
        probe(table, 16, f.MAX_PROBE, b"n" * 16, b"k" * 16, False, bytes(8), bytes(8))
