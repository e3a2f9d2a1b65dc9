"""Peer credentials and what they allow, without sockets (the soak campaign's security part
runs the same rules across real uids)."""

import os
import stat

import pytest

from kvpool.daemon.peer import AllowList, Peer, check_may_open
from kvpool.shared.errors import ConfigError, PermissionDenied


class _Frame:
    def __init__(self, value):
        self.value = value

    def get(self, prop):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_peer_credentials_come_from_zeromq_peer_address():
    assert Peer.from_frame(_Frame("localhost:1000:1001:4242")) == Peer(1000, 1001, 4242)
    assert Peer.from_frame(_Frame("")) is None
    assert Peer.from_frame(_Frame(OSError("no such property"))) is None


def test_empty_allow_list_lets_everyone_the_socket_lets_in():
    AllowList("", "").check(Peer(12345, 12345, 1))
    AllowList("", "").check(None)


def test_allow_list_admits_listed_users_groups_the_daemon_user_and_root():
    allow = AllowList("4000,4001", "5000")
    for peer in (Peer(4000, 1, 1), Peer(4001, 1, 1), Peer(7000, 5000, 1), Peer(0, 0, 1),
                 Peer(os.geteuid(), 99, 1)):
        allow.check(peer)
    for peer in (Peer(4002, 4002, 1), None):
        with pytest.raises(PermissionDenied):
            allow.check(peer)


def test_allow_list_names_must_exist():
    assert AllowList("root", "root").uids == {0}
    with pytest.raises(ConfigError, match="no user named"):
        AllowList("no-such-user-kvpool", "")


def _st(uid, gid, mode):
    return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


def test_a_peer_may_have_opened_for_it_only_what_it_could_open_itself():
    me = Peer(4000, 4000, 1)
    check_may_open(_st(4000, 4000, 0o600), me, "x")
    check_may_open(_st(1, 4000, 0o660), me, "x")
    check_may_open(_st(1, 1, 0o666), me, "x")
    check_may_open(_st(1, 1, 0o600), Peer(0, 0, 1), "x")         # root may
    for st in (_st(1, 1, 0o600), _st(1, 4000, 0o640), _st(4000, 1, 0o400)):
        with pytest.raises(PermissionDenied, match="could not open it"):
            check_may_open(st, me, "x")
