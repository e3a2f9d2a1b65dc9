"""``client/zmq_calls.HeldSocket``: single frames sent and received without waiting, through
libzmq directly where this process's libzmq is found and through pyzmq where it is not."""

from __future__ import annotations

import pytest
import zmq

from kvpool.client import zmq_calls
from kvpool.client.zmq_calls import HeldSocket
from tests.conftest import wait_for


@pytest.fixture(params=["libzmq", "pyzmq"])
def pair(request, tmp_path, monkeypatch):
    if request.param == "pyzmq":
        monkeypatch.setattr(zmq_calls, "_lib", None)
    elif zmq_calls._lib is None:
        pytest.skip("pyzmq's libzmq is not in this process's maps: only the fallback runs here")
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind(f"ipc://{tmp_path / 's.sock'}")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"ipc://{tmp_path / 's.sock'}")
    yield server, client
    client.close(linger=0)
    server.close(linger=0)
    ctx.term()


def test_frames_go_both_ways_and_nothing_waiting_is_none(pair):
    server, client = pair
    held = HeldSocket(client)
    assert held.recv() is None
    assert wait_for(lambda: held.send(b"hello"), 5, "the frame to be queued")
    identity, frame = server.recv_multipart()
    assert frame == b"hello"
    server.send_multipart([identity, b"x" * 100_000])
    assert wait_for(held.recv, 5, "the reply") == b"x" * 100_000
    assert held.recv() is None


def test_a_socket_with_no_peer_queues_nothing(tmp_path):
    ctx = zmq.Context()
    lonely = ctx.socket(zmq.DEALER)
    try:
        assert HeldSocket(lonely).send(b"nobody") is False
    finally:
        lonely.close(linger=0)
        ctx.term()
