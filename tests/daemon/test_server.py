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


def test_a_reply_sent_outside_a_drain_looks_for_requests_that_came_meanwhile(pool, pool_config,
                                                                            tmp_path):
    """ZeroMQ's FD is edge-triggered and a send can take the edge with it: a request that came
    before a reply sent outside the socket's drain (a finished job's) may never wake the loop.
    After such a send the server reads ZMQ_EVENTS: it drains where a request waits (with no
    reader on the FD here, nothing else would read it) and schedules nothing where none does
    (one loop callback less per finished job)."""
    import zmq

    from kvpool.shared import protocol as p
    from tests.conftest import wait_for

    srv = Server(pool_config, pool, {})
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(f"ipc://{tmp_path}/s")
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    dealer.connect(f"ipc://{tmp_path}/s")
    srv._sock, srv.is_serving = router, True
    got, drains = [], []
    srv._dispatch = lambda identity, body, frames=2: got.append(bytes(body.buffer))
    drain = srv._drain
    srv._drain = lambda: (drains.append(1), drain())

    async def run() -> None:
        dealer.send(b"request")
        wait_for(lambda: router.get(zmq.EVENTS) & zmq.POLLIN, 10, "the request's arrival")
        srv._send(b"peer", p.Pong(1, "d", 0.0))
        for _ in range(3):
            await asyncio.sleep(0)
        assert got == [b"request"], "the request that came before the reply was not read"
        srv._send(b"peer", p.Pong(2, "d", 0.0))
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(drains) == 1, "a drain was scheduled where no request waited"

    try:
        asyncio.run(run())
        assert dealer.poll(5000) and p.decode_reply(dealer.recv()).req_id == 1
    finally:
        srv._sock = None
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_an_adopted_pools_blocks_are_published_off_the_loop(pool, pool_config, tmp_path,
                                                            monkeypatch):
    """A (re)started daemon publishes every committed block of its pool in the shared-memory
    index from a thread of its own, run by run: on the loop, the one pass held it 207-284 ms
    at 522K adopted blocks (fill_gaps.py --restart). Every committed block is published,
    pinned or not, and no block being written."""
    import threading

    from kvpool.daemon.index_segment import KeyLocations
    from kvpool.daemon.server import publish_index
    from kvpool.shared import index_format as f
    from tests.daemon.indexkit import NS_SMALL, OWNER, SMALL, bind, keys, store

    srv = Server(pool_config, pool, {})
    srv.index.register_namespace(NS_SMALL, SMALL)
    ks = keys(40, b"a")
    store(srv.index, NS_SMALL, ks)
    srv.index.lookup(NS_SMALL, [ks[:3]], True, OWNER, 0)      # leased: published too
    writing = keys(2, b"w")
    bind(srv.index, NS_SMALL, writing)
    callers: list[str] = []
    real = KeyLocations.committed

    def committed(self, slots):
        callers.append(threading.current_thread().name)
        real(self, slots)

    monkeypatch.setattr(KeyLocations, "committed", committed)
    sock = tmp_path / "kvpoold.sock"
    sock.touch()
    segment = asyncio.run(publish_index(pool, srv.index, None, pool_config, "d", sock))
    try:
        segment.prefault_wait()
        assert callers and set(callers) == {"kvpool-index-publish"}, callers
        assert [segment.location(NS_SMALL + k) for k in ks] == [f.POOL] * len(ks)
        assert [segment.location(NS_SMALL + k) for k in writing] == [f.EMPTY] * 2
    finally:
        segment.close()
