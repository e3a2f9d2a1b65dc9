"""bench/investigations/claim_churn.py times a claim's pass over cold slots with every field
and without each object it replaces: every variant, every job."""

from bench.investigations.claim_churn import VARIANTS, Slot, claim, run


def test_every_variant_is_timed_for_every_job():
    times = run(slots=8, jobs=5, flush_mib=1, table=1000)
    assert {k: len(v) for k, v in times.items()} == {v: 5 for v in VARIANTS}
    assert all(t > 0 for v in times.values() for t in v), times


def test_both_full_passes_write_the_same_ref_and_key():
    """The pass as it was (a generation of its own) and as it is (the ref's upper half)."""
    old, new = Slot(5, generation=0x7FFF_FFFF), Slot(5, ref=(0x7FFF_FFFF << 32) | 5)
    claim([old], [b"h" * 16], "gen+ref+key")
    claim([new], [b"h" * 16], "ref+key")
    for s in (old, new):
        assert (s.ref, s.key, s.block_hash, s.pins) == (5, b"n" * 16 + b"h" * 16, b"h" * 16, 1)
