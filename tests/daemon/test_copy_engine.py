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


@pytest.mark.parametrize("n, chunk, tail, bounds", [
    (128, 128, 32, [0, 128]), (129, 128, 32, [0, 97, 129]), (100, 10, 10, [0] + list(range(10, 101, 10))),
    (1024, 128, 32, [0, 124, 248, 372, 496, 620, 744, 868, 992, 1024]), (40, 7, 0, [0, 6, 13, 20, 26, 33, 40]),
])
def test_a_store_ends_with_a_small_chunk_when_it_reports_its_chunks(n, chunk, tail, bounds):
    """What is left to commit after a store's last copy is its tail (TAIL_BLOCKS), not a
    whole chunk; no chunk passes the chunk size, and a tail no smaller than a chunk is none."""
    got = chunk_bounds(n, chunk, tail)
    assert got == bounds
    sizes = [b - a for a, b in zip(got[:-1], got[1:])]
    assert max(sizes) <= max(chunk, 1) or n <= chunk
    assert not 0 < tail < chunk < n or sizes[-1] == tail


@pytest.mark.parametrize("n, chunk, tail, head, bounds", [
    (128, 128, 32, 32, [0, 128]), (129, 128, 0, 32, [0, 32, 129]),
    (1024, 128, 0, 32, [0, 32, 156, 280, 404, 528, 652, 776, 900, 1024]),
    (1024, 128, 32, 32, [0, 32] + [32 + b for b in chunk_bounds(992, 128, 32)[1:]]),
    (300, 128, 0, 128, chunk_bounds(300, 128)), (300, 128, 0, 0, chunk_bounds(300, 128)),
])
def test_a_cuda_job_starts_with_a_small_chunk(n, chunk, tail, head, bounds):
    """The first chunk of a big job, launched on the event loop, is at most ``head`` items, so
    the first bytes move after a small table; the rest keeps the chunk size and the tail."""
    got = chunk_bounds(n, chunk, tail, head)
    assert got == bounds
    sizes = [b - a for a, b in zip(got[:-1], got[1:])]
    assert got[0] == 0 and got[-1] == n and all(s > 0 for s in sizes)
    assert max(sizes) <= chunk or n <= chunk
    if 0 < head < chunk < n:
        assert sizes[0] == head
    if 0 < tail < chunk < n - head:
        assert sizes[-1] == tail
