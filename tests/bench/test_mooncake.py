"""The test helper that runs a real ``mooncake_master``: it is up only when the master itself
listens on every port it was given."""

from __future__ import annotations

import os
import socket

import pytest

from bench.mooncake import MooncakeMaster, free_ports, listening_ports


def test_free_ports_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(p > 0 for p in ports)


def test_listening_ports_names_this_process_listeners_only():
    with socket.socket() as listener, socket.socket() as bound_only:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        bound_only.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        mine = listening_ports(os.getpid())
        assert port in mine
        assert bound_only.getsockname()[1] not in mine
    assert port not in listening_ports(os.getpid())


def test_a_master_whose_rpc_port_answers_for_someone_else_is_not_up(tmp_path):
    # Its RPC server cannot bind and it exits, after its metadata server answered: waiting
    # for the ports to answer called that master up.
    m = MooncakeMaster(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", m.rpc_port))
        taken.listen()
        try:
            with pytest.raises(AssertionError, match="mooncake_master exited with"):
                m.start()
        finally:
            m.cleanup()


def test_a_master_is_not_started_on_one_port_twice(tmp_path):
    m = MooncakeMaster(tmp_path)
    m.metrics_port = m.rpc_port
    with pytest.raises(ValueError, match="distinct"):
        m.start()
    assert m.proc is None


def test_a_started_master_listens_on_its_three_ports(tmp_path):
    m = MooncakeMaster(tmp_path).start()
    try:
        assert {m.rpc_port, m.http_port, m.metrics_port} <= listening_ports(m.proc.pid)
    finally:
        m.cleanup()
