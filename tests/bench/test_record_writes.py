"""bench/investigations/record_writes.py times a store job's three record writes compiled and
with numpy, alternating job by job, and leaves the compiled writes in place."""

import kvpool.daemon.pool as pool_module
from bench.investigations.record_writes import run


def test_both_writers_are_timed_for_every_job(compiled_pool_records):
    times = run(slots=8, jobs=6, flush_mib=1)
    assert {k: len(v) for k, v in times.items()} == {"compiled": 6, "numpy": 6}
    assert all(t > 0 for v in times.values() for t in v), times
    assert pool_module._pool_records is compiled_pool_records
