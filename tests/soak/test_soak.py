"""The soak campaign at CI scale: each part of ``python -m bench.soak`` for seconds, against real
daemons, sockets and shared memory, held to the same targets as the full run (counts aside)."""

from __future__ import annotations

import os

import pytest

from bench.soak import SCALES, check, exhaustion, faults, fuzz, integrity, security

CI = SCALES["ci"]


def _met(result: dict) -> None:
    missed = {k: result[k] for k, ok in check(result, "ci").items() if ok is False}
    assert not missed, f"targets missed: {missed}\n{result}"


def test_integrity_under_constant_eviction(tmp_path):
    r = integrity.run(tmp_path, **CI["integrity"])
    assert r["transfers"] >= CI["integrity"]["transfers"]
    assert r["integrity_detail"]["after_exit"]["evictions"] > 1000, "the pool must evict all the time"
    # Loads after their lookup's block was evicted must happen, and each such block fail alone
    # (poison kept), else the optimistic-load path went untested.
    assert r["integrity_detail"]["stale_blocks"] > 0, r["integrity_detail"]
    _met(r)


def test_sigkilled_workers_are_released_and_nobody_else_notices(tmp_path):
    r = faults.worker_kills(tmp_path, **CI["worker_kills"])
    assert r["worker_kill_detail"]["bystander_corrupted"] == 0
    assert r["worker_kill_detail"]["bystander_unavailable"] == 0
    assert r["worker_kill_detail"]["leaked_after_exit"] == 0
    assert r["worker_kill_detail"]["killed_with_jobs_in_flight"] >= 1, r
    _met(r)


def test_sigkilled_daemon_comes_back_with_every_acked_block(tmp_path):
    r = faults.daemon_kills(tmp_path, **CI["daemon_kills"])
    assert r["daemon_kill_detail"]["client_loads_corrupted"] == 0
    # A call never waits for a dead daemon's timeout (2 s): it sees the connection go. (One
    # made while the new daemon adopts the pool waits for its Hello: 1.0-1.4 s seen.)
    assert r["client_block_max_s"] < r["daemon_kill_detail"]["client_timeout_ms"] / 1000, r
    _met(r)


def test_fuzzed_frames_get_answers_and_harm_nobody(tmp_path):
    r = fuzz.run(tmp_path, **CI["fuzz"])
    assert r["fuzz_frames"] == CI["fuzz"]["frames"]
    assert r["fuzz_retired_tag_refused"] == 1, r["fuzz_detail"]["retired_tag"]
    _met(r)


def test_stalled_worker_keeps_its_registration_and_misapplies_nothing(tmp_path):
    r = faults.stall(tmp_path, **CI["stall"])
    past = r["stall_detail"]["past_peer_timeout_1000ms"]
    assert past["released_after_s"] is not None, "a stall past the peer timeout releases"
    _met(r)


@pytest.mark.skipif(os.geteuid() != 0, reason="other uids and mount namespaces need root")
def test_other_uids_allow_lists_and_confused_deputies(tmp_path):
    r = security.access(tmp_path)
    assert r["security_other_uid_refused"] == 1, r


def test_crafted_names_open_and_unlink_nothing(tmp_path):
    r = security.crafted_names(tmp_path)
    assert r["security_crafted_names_refused"] == r["security_crafted_names"], r
    assert r["security_foreign_objects_touched"] == 0, r


def test_tenants_with_other_salts_never_meet(tmp_path):
    _met(security.tenants(tmp_path))


def test_full_pool_stores_nothing_evicts_nothing_and_says_so(tmp_path):
    """Every slot pinned: a store still succeeds, writes and evicts nothing, and each of its
    blocks is counted in ``no_room_blocks``; no committed block is lost."""
    r = exhaustion.pool_full(tmp_path)
    d = r["exhaustion_pool_full_detail"]
    assert d["stored_blocks"] > 100 and d["no_room_blocks"] >= 8, d
    assert d["slots_pinned"] == d["slots_committed"] == d["stored_blocks"], d
    _met(r)


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm needs root (mount namespace)")
def test_full_dev_shm_is_a_clear_error_and_loses_nothing(tmp_path):
    r = exhaustion.shm_full(tmp_path)
    assert r["exhaustion_shm_full_ok"] == 1, r


def test_maximum_size_requests(tmp_path):
    r = exhaustion.max_requests(tmp_path)
    d = r["exhaustion_max_request_detail"]
    assert d["over_limit"]["code"] == "TOO_LARGE"
    assert d["max_lookup"]["reply"] == "LookupReply"
    assert d["max_frame_store"]["code"] == "TOO_LARGE"
    assert d["max_reserve"]["reply"] == "ReserveReply" and d["max_reserve"]["granted"] > 0
    assert d["max_reserve_plus_one"]["code"] == "TOO_LARGE"
    assert d["max_tickets_store"]["code"] == "", d["max_tickets_store"]
    assert d["max_tickets_store"]["written_blocks"] > 0, d["max_tickets_store"]
    assert d["max_keys_store"]["code"] == "OUT_OF_RANGE", d["max_keys_store"]  # never granted
    assert d["max_keys_plus_one_store"]["code"] == "TOO_LARGE"
    assert d["retired_prepare"] == {**d["retired_prepare"], "reply": "ErrorReply",
                                    "code": "PROTOCOL"}
    assert d["ping_after"]["reply"] == "Pong"
    _met(r)


def test_a_thousand_clients_with_a_low_file_limit(tmp_path):
    r = exhaustion.many_clients(tmp_path, CI["security"]["clients"])
    d = r["exhaustion_clients_detail"]
    assert d["bystander_store_ok"] and d["daemon_alive"], r
    _met(r)
