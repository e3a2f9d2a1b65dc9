"""The connector's scheduler-side methods under vLLM's real schedulers, ours beside vLLM's own CPU
offload connector, one load for both (``bench/control_plane.py``'s connector arm).

The load (``drive_load``), per scheduler (``Scheduler`` and ``AsyncScheduler``): ``n`` prompts of
512 tokens are stored (one token generated each), vLLM's GPU prefix cache is emptied (the
connector's cache kept), then, timed, ``n`` requests run at once whose first 384 tokens are those
prompts' (hits in the connector's cache: lookups, asynchronous loads) and 120 to 135 new ones (so
that their blocks fill on different decode steps, as in a server where requests come and go),
each decoding ``decode`` tokens: stores of every block that fills, during prefill and decode.

Timed per method: every call vLLM's scheduler makes into the connector, wall and thread CPU time
(``kvpool.client.call_timing``). The connector's ``SCHEDULER_METHODS`` (get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished) give
the figures of record; ``OTHER_METHODS`` (the hooks one connector may use for work the other does
in those: vLLM's does its per-request set-up in on_new_request) are timed apart, for both.

Imports vLLM only when an arm runs: ``bench/control_plane.py`` imports this module, and so do
the processes its lookup phases spawn.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import os
from pathlib import Path
from typing import Any, Callable

from kvpool.client.call_timing import CallTimer

CONNECTOR_REQUESTS = 256
PROMPT_TOKENS, HIT_TOKENS = 512, 384
# The GPU KV cache and batch of both arms (as a large engine has: no preemption under this load).
NUM_GPU_BLOCKS, MAX_BATCHED_TOKENS = 16384, 8192
OTHER_METHODS = ("on_new_request", "get_external_cache_hit_sources", "has_pending_push_work",
                 "take_events", "get_kv_connector_stats")
SCHEDULERS = {False: "Scheduler", True: "AsyncScheduler"}


_runs = itertools.count()


def drive_load(e, n: int, decode: int, before_timed: Callable[[], None]) -> dict[str, int]:
    """Run the load on engine ``e`` (a ``bench/vllm_driver.py`` ``SchedulerDriver``); call
    ``before_timed`` once the cache is seeded and vLLM's prefix cache emptied. Returns the timed
    phase's scheduler steps (``_steps``) and requests that loaded a hit (``_loaded_requests``).

    Each run's prompts come from token ids of its own: the pool outlives each engine (vLLM's CPU
    cache does not), and a run whose prompts shared blocks with an earlier run's would find more
    hits than the load has (before, ours under AsyncScheduler found the Scheduler run's prompts:
    412 requests loaded a hit, seeds included, for 256)."""
    base = next(_runs) * 1000 * (n + 1)
    for i in range(n):
        start = base + 1000 * i
        e.add(f"seed{i}", list(range(start, start + PROMPT_TOKENS)), max_tokens=1)
    e.run(timeout_s=600)
    assert e.sched.reset_prefix_cache(), "vLLM's prefix cache did not empty"
    before_timed()
    gc.collect()
    gc.freeze()      # as vLLM's engine core does after start-up
    try:
        steps_before, seeds_loaded = e.stats.steps, set(e.stats.loaded_reqs)
        for i in range(n):
            start = base + 1000 * i
            e.add(f"r{i}", list(range(start, start + HIT_TOKENS)) +
                  list(range(start + 600, start + 720 + i % 16)), max_tokens=decode)
        e.run(timeout_s=600)
        loaded = len(e.stats.loaded_reqs - seeds_loaded)
        assert loaded >= n // 2, f"only {loaded} of {n} requests loaded a hit"
        return {"_steps": e.stats.steps - steps_before, "_loaded_requests": loaded}
    finally:
        gc.unfreeze()


def _clear(*timers: CallTimer) -> None:
    for timer in timers:
        for bucket in [*timer.samples.values(), *timer.cpu_samples.values()]:
            bucket.clear()


def _other_timer(connector: Any, tmp: str, name: str) -> CallTimer:
    """Time ``OTHER_METHODS`` of ``connector``. vLLM's ``take_events`` is a generator, whose
    work runs as the scheduler iterates it: timed as the scheduler sees it, drained in the call."""
    take = connector.take_events
    connector.take_events = lambda: list(take())
    timer = CallTimer(os.path.join(tmp, f"{name}-other"))
    atexit.unregister(timer.dump)        # nothing to write: the caller reads its summary
    timer.wrap(connector, [m for m in OTHER_METHODS if hasattr(connector, m)])
    return timer


def _called(timer: CallTimer) -> dict[str, dict[str, float]]:
    return {k: v for k, v in timer.summary().items() if v["calls"]}


def kvpool_connector_methods(sock: str, tmp: str, async_scheduling: bool,
                             n: int = CONNECTOR_REQUESTS, decode: int = 256,
                             plan_stores: bool = True) -> dict[str, Any]:
    """Ours against the daemon on ``sock``: per method, calls and p50/p99/max us (``_other``:
    ``OTHER_METHODS``; ``_steps``: the timed phase's scheduler steps; ``_loaded_requests``).
    Without ``plan_stores`` the timed phase plans no store (the planner answers nothing): the
    cost of everything else."""
    from bench.vllm_scheduler import Engine

    e = Engine(Path(tmp), sock, async_scheduling=async_scheduling, num_blocks=NUM_GPU_BLOCKS,
               max_num_seqs=n, max_num_batched_tokens=MAX_BATCHED_TOKENS, write_kv=False,
               kv_events=False, engine_id=f"bench-{SCHEDULERS[async_scheduling]}",
               extra={"timeout_ms": 10_000,
                      "connector_timing": os.path.join(tmp, "timing")})
    timer = e.connector._timer
    assert timer is not None
    try:
        other = _other_timer(e.connector, tmp, "kvpool")

        def before_timed() -> None:
            _clear(timer, other)
            if not plan_stores:
                e.connector.scheduler.planner.plan = lambda *a, **k: ([], [])
        load = drive_load(e, n, decode, before_timed)
        return {**_called(timer), "_other": _called(other), **load}
    finally:
        e.close()
        atexit.unregister(timer.dump)   # its directory goes with the run


def vllm_connector_methods(tmp: str, async_scheduling: bool, n: int = CONNECTOR_REQUESTS,
                           decode: int = 256) -> dict[str, Any]:
    """vLLM's ``OffloadingConnector`` (``bench/connector_peer.py``) under the same load, timed
    the same way; its CPU cache holds every block the load stores (as our pool does)."""
    from bench.connector_peer import PeerEngine
    from kvpool.client.vllm.connector import SCHEDULER_METHODS

    e = PeerEngine(Path(tmp), async_scheduling=async_scheduling, num_blocks=NUM_GPU_BLOCKS,
                   max_num_seqs=n, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                   cpu_bytes=1 << 30, engine_id=f"peer-{SCHEDULERS[async_scheduling]}")
    try:
        timer = CallTimer(os.path.join(tmp, "vllm"))
        atexit.unregister(timer.dump)
        timer.wrap(e.connector, [m for m in SCHEDULER_METHODS if hasattr(e.connector, m)])
        other = _other_timer(e.connector, tmp, "vllm")
        seeded: dict[str, int] = {}

        def before_timed() -> None:
            _clear(timer, other)
            seeded.update(stored=e.stored_blocks, loaded=e.loaded_blocks)
        load = drive_load(e, n, decode, before_timed)
        assert seeded["stored"] >= n * PROMPT_TOKENS // 16 // 2, \
            f"its CPU cache took {seeded['stored']} blocks of the seed prompts"
        return {**_called(timer), "_other": _called(other), **load,
                "_loaded_blocks": e.loaded_blocks - seeded["loaded"],
                "_stored_blocks": e.stored_blocks - seeded["stored"]}
    finally:
        e.close()


def _worst(per: dict[str, dict], field: str, only: str = "") -> tuple[float, str]:
    """The largest ``field`` over every scheduler's methods (or method ``only``)."""
    return max((m[field], f"{sched}.{meth}") for sched, ms in per.items()
               for meth, m in ms.items()
               if not meth.startswith("_") and (not only or meth == only))


def _worst_other(per: dict[str, dict]) -> float:
    return max((m["p99_us"] for ms in per.values() for m in ms["_other"].values()), default=0.0)


def connector_figures(n: int = CONNECTOR_REQUESTS, decode: int = 256, *, sock: str,
                      tmp: str) -> dict[str, Any]:
    """Both connectors under both schedulers (ours, then vLLM's, per scheduler: side by side
    in time), then ours without store planning; the figures ``bench/README.md`` lists."""
    ours: dict[str, dict] = {}
    theirs: dict[str, dict] = {}
    for is_async, name in SCHEDULERS.items():
        ours[name] = kvpool_connector_methods(sock, tmp, is_async, n, decode)
        theirs[name] = vllm_connector_methods(tmp, is_async, n, decode)
    p99, p99_at = _worst(ours, "p99_us")
    vllm_p99, vllm_p99_at = _worst(theirs, "p99_us")
    return {
        "connector_requests": n,
        "connector_method_p99_us": p99, "connector_method_p99_worst": p99_at,
        "connector_method_cpu_p99_us": _worst(ours, "cpu_p99_us")[0],
        "connector_method_cpu_p99_worst": _worst(ours, "cpu_p99_us")[1],
        "build_connector_meta_p99_us": _worst(ours, "p99_us", "build_connector_meta")[0],
        "connector_other_methods_p99_us": _worst_other(ours),
        "connector_methods": ours,
        "vllm_connector": "OffloadingConnector (CPUOffloadingSpec)",
        "vllm_connector_method_p99_us": vllm_p99, "vllm_connector_method_p99_worst": vllm_p99_at,
        "vllm_connector_method_cpu_p99_us": _worst(theirs, "cpu_p99_us")[0],
        "vllm_build_connector_meta_p99_us": _worst(theirs, "p99_us", "build_connector_meta")[0],
        "vllm_connector_other_methods_p99_us": _worst_other(theirs),
        "vllm_connector_methods": theirs,
        "connector_vs_vllm_p99_ratio": p99 / vllm_p99,
        "connector_no_store_planning": {
            name: kvpool_connector_methods(sock, tmp, is_async, n, decode, plan_stores=False)
            ["build_connector_meta"] for is_async, name in SCHEDULERS.items()},
        "connector_note": "wall time per call (the figure of record) and the scheduler "
        "thread's CPU time per call; the difference is time the thread did not run (other "
        "processes on a shared host)",
        "load_average": os.getloadavg(),
    }
