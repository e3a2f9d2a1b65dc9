"""bench/gpu_transfer.py's reading of the daemon's trace file (no GPU: the rows are written
here as the daemon's copy jobs write them)."""

from __future__ import annotations

from bench.gpu_transfer import big_jobs, read_trace

MS = 1_000_000


def _row(owner: int, job: int, kind: str, n: int, recv: int, launched: list[int],
         landed: list[int]) -> str:
    # owner job kind blocks recv submitted launch-start first-launched done callback sent
    # ended count launched... landed...
    done = landed[-1]
    return " ".join(map(str, [owner, job, kind, n, recv, recv + 3 * MS, recv + MS // 2,
                              launched[0], done, done + MS // 10, done + MS // 5,
                              done + 3 * MS // 20, len(launched), *launched, *landed]))


def test_big_jobs_reads_each_chunks_launch_and_landing_as_gpu_idle_time(tmp_path):
    t0 = 10 * MS
    # chunk 2 went out 1 ms after chunk 1 landed; chunk 3 before chunk 2 landed
    rows = [_row(7, 1, "store", 1024, t0, [t0 + MS, t0 + 4 * MS, t0 + 5 * MS],
                 [t0 + 3 * MS, t0 + 8 * MS, t0 + 12 * MS]),
            # a load without chunk stamps (the host engine's): no idle figure from it
            " ".join(map(str, [7, 2, "load", 1024, t0, t0 + MS, t0, t0 + MS, t0 + 9 * MS,
                               t0 + 9 * MS, t0 + 10 * MS, 0]))]
    path = tmp_path / "trace.txt"
    path.write_text("\n".join(rows) + "\n")
    out = big_jobs(read_trace(path), 7, 1024)
    assert out["store_gpu_idle_ms_each"] == [1.0]
    assert out["store_all_launched_ms"] == 4.0 and out["store_chunks"] == 3
    assert out["store_copy_ms_each"] == [11.0]
    assert out["store_last_chunk_ms"] == 4.0
    assert out["store_done_to_loop_ms"] == 0.1 and out["store_loop_to_sent_ms"] == 0.1
    assert out["store_end_commit_ms"] == 0.05
    assert "load_gpu_idle_ms_each" not in out and out["load_jobs"] == 1


def test_big_jobs_splits_the_clients_hop_at_its_submit_stamp(tmp_path):
    t0 = 10 * MS
    path = tmp_path / "trace.txt"
    path.write_text(_row(7, 1, "store", 1024, t0, [t0 + MS, t0 + 2 * MS],
                         [t0 + 20 * MS, t0 + 40 * MS]) + "\n")
    sent = t0 + 40 * MS + MS // 5
    # (job, before the submit, completion seen, submit returned)
    client = {"owner": 7, "jobs": [(1, t0 - MS, sent + MS // 4, t0 - 3 * MS // 4)]}
    out = big_jobs(read_trace(path), 7, 1024, client)
    assert out["store_client_to_recv_ms"] == 1.0
    assert out["store_client_submit_ms"] == 0.25 and out["store_submitted_to_recv_ms"] == 0.75
    assert out["store_sent_to_seen_ms"] == 0.25
    # a worker's stamps without the submit stamp: the hop stays whole
    client = {"owner": 7, "jobs": [(1, t0 - MS, sent + MS // 4)]}
    out = big_jobs(read_trace(path), 7, 1024, client)
    assert out["store_client_to_recv_ms"] == 1.0 and "store_client_submit_ms" not in out


def test_big_jobs_splits_the_wait_for_the_first_copy_where_the_daemon_stamped_it(tmp_path):
    t0 = 10 * MS
    row = _row(7, 1, "store", 1024, t0, [t0 + MS, t0 + 4 * MS], [t0 + 3 * MS, t0 + 8 * MS])
    # the engine took the job 0.2 ms after receipt (its launch started 0.5 ms after it), the
    # worker's event was seen done 0.6 ms after it, the first chunk enqueued 0.9 ms after it
    path = tmp_path / "trace.txt"
    path.write_text(row + " " + " ".join(map(str, [t0 + MS // 5, t0 + 3 * MS // 5,
                                                    t0 + 9 * MS // 10])) + "\n")
    out = big_jobs(read_trace(path), 7, 1024)
    assert out["store_to_engine_ms"] == 0.2 and out["store_engine_to_launch_ms"] == 0.3
    assert out["store_launch_to_event_ms"] == 0.1 and out["store_first_enqueue_ms"] == 0.3
    assert out["store_first_mark_ms"] == 0.1
    assert out["store_chunks"] == 2 and out["store_gpu_idle_ms_each"] == [1.0]
    # rows of an older daemon (nothing after the chunks): no such figures
    path.write_text(row + "\n")
    assert "store_to_engine_ms" not in big_jobs(read_trace(path), 7, 1024)


def test_a_job_sent_as_a_lead_and_the_rest_reads_as_one(tmp_path):
    t0 = 10 * MS
    lead = _row(7, 1, "store", 64, t0, [t0 + MS], [t0 + 3 * MS])
    # the rest's first chunk went out 0.5 ms after the lead landed: the GPU idled that long
    rest = _row(7, 1, "store", 960, t0 + MS // 5, [t0 + 7 * MS // 2, t0 + 5 * MS],
                [t0 + 6 * MS, t0 + 40 * MS])
    path = tmp_path / "trace.txt"
    path.write_text(lead + " " + " ".join(map(str, [t0 + MS // 5, t0 + 3 * MS // 5,
                                                     t0 + 9 * MS // 10])) + "\n" + rest + "\n")
    out = big_jobs(read_trace(path), 7, 1024)
    assert out["store_jobs"] == 1 and out["store_chunks"] == 3
    assert out["store_to_copy_ms"] == 1.0 and out["store_copy_ms_each"] == [39.0]
    assert out["store_gpu_idle_ms_each"] == [0.5]
    assert out["store_to_engine_ms"] == 0.2 and out["store_first_enqueue_ms"] == 0.3
    assert out["store_total_ms_each"] == [40.2]
