"""bench/investigations/slot_columns.py times a store's per-slot passes in a real index on a
full pool, and their fields as numpy columns: every pass is timed, warm and cold."""

from bench.investigations.slot_columns import run


def test_every_pass_is_timed_as_objects_and_as_columns():
    for flush_mib in (0, 1):
        figures = run(slots=16, jobs=60, flush_mib=flush_mib)
        passes = {f"{kind}_{step}" for kind in ("objects", "columns")
                  for step in ("claim", "evict", "commit")}
        assert set(figures) == passes, f"passes timed: {sorted(figures)}"
        assert all(v > 0 for v in figures.values()), figures
