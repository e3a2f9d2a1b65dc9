"""What a copy job checks before its copy starts, and how a store's slots end (the whole job's
path through a real daemon is in tests/integration/test_server.py)."""

import numpy as np
import pytest

from kvpool.daemon.copy_jobs import MAX_BLOCKS_PER_REQUEST, Landing, _block_ids, check_count
from kvpool.shared.errors import OutOfRange, TooLarge


def test_landing_ends_every_slot_once_in_chunks_then_the_rest():
    slots = list("abcdefg")
    keep = np.array([1, 1, 0, 1, 1, 1, 0], dtype=bool)
    landing = Landing(slots, keep)          # c and g are void: never copied
    assert landing.take(2) == ["a", "b"]
    assert landing.take(2) == []             # told twice: nothing more
    assert landing.take(4) == ["d", "e"]
    assert landing.rest() == ["f", "c", "g"]
    assert landing.rest() == [] and landing.take(5) == []


def test_a_landing_without_voids_ends_its_slots_in_order():
    landing = Landing([1, 2, 3])
    assert landing.take(1) == [1]
    assert landing.rest() == [2, 3]


@pytest.mark.parametrize("ids", [[0, 5, 15], list(range(16)) * 4])
def test_block_ids_in_range_come_back_as_int64(ids):
    out = _block_ids(ids, 16)
    assert out.dtype == np.int64 and out.tolist() == ids


@pytest.mark.parametrize("ids", [[-1], [16], [0] * 40 + [16], [0] * 40 + [-3], [2 ** 70],
                                 [0] * 40 + [2 ** 70]])
def test_block_ids_out_of_range_are_refused_by_name(ids):
    with pytest.raises(OutOfRange, match=r"block ids must be in \[0, 16\)"):
        _block_ids(ids, 16)


def test_a_request_naming_too_many_blocks_is_refused():
    check_count(MAX_BLOCKS_PER_REQUEST, "blocks")
    with pytest.raises(TooLarge, match="split it"):
        check_count(MAX_BLOCKS_PER_REQUEST + 1, "blocks")
