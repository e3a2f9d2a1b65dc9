"""``daemon/registry.py``: owners by id and routing identity, registrations by id, and what
an owner's departure hands back to the server."""

from __future__ import annotations

import pytest

from kvpool.daemon.registry import Registry
from kvpool.shared.errors import UnknownId
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import PROTOCOL_VERSION, Hello, Role

LAYOUT = Layout(16, 1, "uint8", (4096,), "registry test")


def hello(name: str = "w", pid: int = 100) -> Hello:
    return Hello(1, PROTOCOL_VERSION, Role.WORKER, name, pid, "engine-a")


def register(reg: Registry, owner, ns: bytes = b"n" * 16, rank: int = 0):
    # The engine and its mapping are the server's business; the registry only holds them.
    return reg.add_registration(owner, ns, LAYOUT, rank, 8, engine=object(), mapped=object())


def test_owners_are_found_by_id_and_identity():
    reg = Registry()
    a, b = reg.add_owner(b"id-a", hello("a"), 1.0), reg.add_owner(b"id-b", hello("b"), 2.0)
    assert a.id != b.id
    assert reg.owners[a.id] is a and reg.by_identity[b"id-b"] is b
    assert (a.name, a.pid, a.engine_id, a.role, a.last_seen) == ("a", 100, "engine-a",
                                                                 Role.WORKER, 1.0)


def test_a_registration_belongs_to_its_owner_only():
    reg = Registry()
    a, b = reg.add_owner(b"a", hello(), 0.0), reg.add_owner(b"b", hello(), 0.0)
    r = register(reg, a)
    assert reg.registration(a, r.id) is r
    with pytest.raises(UnknownId):
        reg.registration(b, r.id)
    with pytest.raises(UnknownId):
        reg.registration(a, r.id + 1)
    assert reg.find_registration(a, b"n" * 16, 0) is r
    assert reg.find_registration(a, b"n" * 16, 1) is None
    assert reg.find_registration(b, b"n" * 16, 0) is None


def test_removing_an_owner_hands_back_its_registrations_closing():
    reg = Registry()
    a, b = reg.add_owner(b"a", hello(), 0.0), reg.add_owner(b"b", hello(), 0.0)
    mine = {register(reg, a, rank=0).id, register(reg, a, rank=1).id}
    theirs = register(reg, b)
    released = reg.remove_owner(a)
    assert {r.id for r in released} == mine and all(r.closing for r in released)
    assert a.id not in reg.owners and b"a" not in reg.by_identity
    assert set(reg.registrations) == {theirs.id} and not theirs.closing
    assert reg.remove_owner(a) == []                 # a second release finds nothing


def test_a_reconnect_under_the_same_identity_survives_the_old_owners_release():
    reg = Registry()
    old = reg.add_owner(b"same", hello(), 0.0)
    new = reg.add_owner(b"same", hello(), 1.0)
    reg.remove_owner(old)
    assert reg.by_identity[b"same"] is new and new.id in reg.owners


def test_closing_a_registration_takes_it_off_its_owner():
    reg = Registry()
    a = reg.add_owner(b"a", hello(), 0.0)
    r = register(reg, a)
    assert reg.close_registration(r.id) is r and r.closing
    assert r.id not in a.registrations and r.id not in reg.registrations
    with pytest.raises(UnknownId):
        reg.registration(a, r.id)
