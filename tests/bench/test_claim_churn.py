"""bench/investigations/claim_churn.py times a claim's pass over cold slots with every field
and without each object it replaces: every variant, every job."""

from bench.investigations.claim_churn import VARIANTS, claim, run
from kvpool.daemon.extents import Slot, SizeClass


def test_every_variant_is_timed_for_every_job():
    times = run(slots=8, jobs=5, flush_mib=1, table=1000)
    assert {k: len(v) for k, v in times.items()} == {v: 5 for v in VARIANTS}
    assert all(t > 0 for v in times.values() for t in v), times


def test_the_full_pass_writes_what_the_slot_table_claim_writes():
    s = Slot(5, 0, 5, 0, SizeClass(4096), generation=0x7FFF_FFFF)
    claim([s], [b"h" * 16], "gen+ref+key")
    assert (s.generation, s.ref, s.key, s.block_hash, s.pins) == (0, 5, b"n" * 16 + b"h" * 16,
                                                                   b"h" * 16, 1)
