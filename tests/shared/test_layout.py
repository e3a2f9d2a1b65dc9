import pytest

from kvpool.shared.errors import LayoutMismatch, OutOfRange
from kvpool.shared.layout import Layout, SegmentPlacement, check_placement

LAYOUT = Layout(16, 2, "bfloat16", (1000, 24), "x")


def test_sizes_and_alignment():
    assert LAYOUT.shard_bytes == 1024
    assert LAYOUT.shard_stride_bytes == 4096 and LAYOUT.slot_bytes == 8192


def test_fingerprint_is_stable_and_covers_every_field():
    assert LAYOUT.fingerprint() == Layout(16, 2, "bfloat16", (1000, 24), "x").fingerprint()
    assert LAYOUT.fingerprint().hex() == "c9511c99ebf6ffc96cbe712b9c069e88"
    for other in (Layout(32, 2, "bfloat16", (1000, 24), "x"), Layout(16, 1, "bfloat16", (1000, 24), "x"),
                  Layout(16, 2, "float16", (1000, 24), "x"), Layout(16, 2, "bfloat16", (24, 1000), "x")):
        assert other.fingerprint() != LAYOUT.fingerprint()


def test_check_rejects_empty_layouts():
    with pytest.raises(LayoutMismatch):
        Layout(16, 1, "f", ()).check()
    with pytest.raises(LayoutMismatch):
        Layout(0, 1, "f", (8,)).check()


def test_placement_must_fit_its_regions():
    ok = [SegmentPlacement(0, 0, 1024), SegmentPlacement(0, 1000, 1024)]
    check_placement(LAYOUT, ok, [10 * 1024], 10)
    with pytest.raises(OutOfRange, match="ends at byte"):
        check_placement(LAYOUT, ok, [10 * 1024 - 1], 10)
    with pytest.raises(OutOfRange, match="region 3"):
        check_placement(LAYOUT, [SegmentPlacement(3, 0, 1024)] * 2, [1 << 20], 10)
    with pytest.raises(LayoutMismatch, match="1 segments"):
        check_placement(LAYOUT, ok[:1], [1 << 20], 10)
    with pytest.raises(OutOfRange, match="negative"):
        check_placement(LAYOUT, [SegmentPlacement(0, -8, 1024)] * 2, [1 << 20], 10)
    with pytest.raises(OutOfRange, match="num_blocks"):
        check_placement(LAYOUT, ok, [1 << 20], 0)
