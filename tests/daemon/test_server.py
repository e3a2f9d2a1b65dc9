"""The server's housekeeping in process (request paths through a real daemon are in
tests/integration/test_server.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from kvpool.daemon.server import Server


def test_housekeeping_keeps_ticking_after_a_pass_that_raises(pool, pool_config, caplog):
    # A housekeeping task that raised used to end silently, and the daemon served on with no
    # lease expiry, no release of silent clients, no stall detection and no health beat.
    cfg = msgspec.structs.replace(pool_config, peer_timeout_ms=400)     # a pass every 0.1 s
    srv = Server(cfg, pool, {})
    passes: list[float] = []

    def expire(now: float) -> None:
        passes.append(now)
        if len(passes) <= 2:
            raise RuntimeError("a bug in one pass")

    srv.index.expire = expire

    async def run() -> None:
        task = asyncio.create_task(srv._housekeeping())
        try:
            deadline = time.monotonic() + 20
            while len(passes) < 4:
                assert not task.done(), f"housekeeping ended after {len(passes)} passes"
                assert time.monotonic() < deadline, f"only {len(passes)} passes in 20 s"
                await asyncio.sleep(0.01)
        finally:
            task.cancel()

    with caplog.at_level(logging.ERROR, logger="kvpoold"):
        asyncio.run(run())
    failed = [r for r in caplog.records if "housekeeping tick failed" in r.getMessage()]
    assert len(failed) == 1, f"two failures 0.1 s apart are logged once: {len(failed)}"
    assert failed[0].exc_info is not None
