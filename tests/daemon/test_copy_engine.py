"""The copy-engine interface's shared helpers."""

import pytest

from kvpool.daemon.copy_engine import chunk_bounds


@pytest.mark.parametrize("n, chunk, bounds", [
    (0, 128, [0, 0]), (5, 0, [0, 5]), (128, 128, [0, 128]), (129, 128, [0, 64, 129]),
    (1024, 128, [0, 128, 256, 384, 512, 640, 768, 896, 1024]), (40, 7, [0, 6, 13, 20, 26, 33, 40]),
])
def test_chunks_are_near_equal_and_at_most_the_chunk_size(n, chunk, bounds):
    got = chunk_bounds(n, chunk)
    assert got == bounds
    sizes = [b - a for a, b in zip(got[:-1], got[1:])]
    assert chunk <= 0 or n <= chunk or max(sizes) <= chunk
