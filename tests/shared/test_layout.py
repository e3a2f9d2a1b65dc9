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


def test_tp_cross_head_split_layout_is_one_slot_for_every_tp_size():
    def rank(tp):   # 8 KV heads, cells of 256 bytes, 32 rows (tokens x layers) per block
        local = max(1, 8 // tp)
        return Layout(16, tp, "bfloat16", (16 * local * 256,) * 2, "llama", 8, 256)

    layouts = [rank(tp) for tp in (1, 2, 4, 8, 16)]
    for lay in layouts:
        lay.check()
    assert len({lay.canonical() for lay in layouts}) == 1
    assert len({lay.fingerprint() for lay in layouts}) == 1
    assert {lay.slot_bytes for lay in layouts} == {32 * 8 * 256}
    assert [rank(4).head_range(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [rank(16).head_range(r) for r in range(3)] == [(0, 1), (0, 1), (1, 2)]
    assert [rank(16).rank_mask(r) for r in range(3)] == [1, 0, 2]
    assert rank(2).rank_mask(1) == 0xF0 and rank(2).full_mask == 0xFF
    # a rank-sharded layout keeps TP in its fingerprint and a bit per rank
    assert LAYOUT.canonical() is LAYOUT and LAYOUT.full_mask == 0b11 and LAYOUT.rank_mask(1) == 2


@pytest.mark.parametrize("bad,why", [
    (Layout(16, 3, "f", (4096,), "", 8, 256), "8 KV heads cannot be split over tp_size=3"),
    (Layout(16, 16, "f", (4096,), "", 6, 256), "6 KV heads cannot be split"),
    (Layout(16, 2, "f", (4000,), "", 8, 256), "not whole rows"),
    (Layout(16, 2, "f", (4096,), "", 8, 0), "needs head_bytes > 0"),
    (Layout(16, 2, "f", (4096,), "", 1 << 13, 1), "kv_heads must be in"),
    (Layout(16, 2, "f", (1 << 30,), "", 8, 16), "rows of heads is more than"),
])
def test_tp_cross_bad_head_split_layouts_are_refused(bad, why):
    with pytest.raises(LayoutMismatch, match=why):
        bad.check()
