"""Connected clients (owners) and the KV memory their workers registered.

An *owner* is one client connection, created by Hello and kept alive by heartbeats; everything a
client holds (registrations here, leases and prepared slots in the index, jobs in the server)
belongs to its owner and is released in one sweep when the owner goes. This module holds the
tables only; the server decides when to release.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

from kvpool.daemon.copy_engine import CopyEngine, Mapped
from kvpool.daemon.peer import Peer
from kvpool.shared.errors import (OutOfRange, PermissionDenied, ProtocolError, TooLarge,
                                  UnknownId)
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import Hello, RegisterRequest, Role


@dataclass(eq=False)
class Owner:
    id: int
    identity: bytes          # ZeroMQ routing id of its DEALER socket
    role: Role
    name: str
    pid: int
    engine_id: str
    last_seen: float
    registrations: set[int] = field(default_factory=set)
    jobs_in_flight: int = 0
    peer: "Peer | None" = None   # kernel credentials of its connection (None: unknown)


@dataclass(eq=False)
class Registration:
    id: int
    owner: Owner
    namespace: bytes
    layout: Layout
    tp_rank: int
    num_blocks: int
    engine: CopyEngine
    mapped: Mapped
    jobs_in_flight: int = 0
    closing: bool = False    # no new jobs; detach when the last one finishes

    @property
    def key(self) -> tuple[bytes, int]:
        """What a re-registration of its client replaces: (namespace, tp_rank)."""
        return self.namespace, self.tp_rank

    @property
    def mask(self) -> int:
        """The slot units this rank's stores land (0: a head replica that only loads)."""
        return self.layout.rank_mask(self.tp_rank)


class Registry:
    """Owners by id and by routing identity; registrations by id. Event-loop thread only."""

    def __init__(self) -> None:
        self.owners: dict[int, Owner] = {}
        self.by_identity: dict[bytes, Owner] = {}
        self.registrations: dict[int, Registration] = {}
        self._owner_ids = itertools.count(1)
        self._registration_ids = itertools.count(1)

    def add_owner(self, identity: bytes, hello: Hello, now: float) -> Owner:
        owner = Owner(next(self._owner_ids), identity, hello.role, hello.name, hello.pid,
                      hello.engine_id, now)
        self.owners[owner.id] = owner
        self.by_identity[identity] = owner
        return owner

    def remove_owner(self, owner: Owner) -> list[Registration]:
        """Forget ``owner``; returns its registrations, now closing, for the caller to detach."""
        self.owners.pop(owner.id, None)
        if self.by_identity.get(owner.identity) is owner:
            del self.by_identity[owner.identity]
        return [self.close_registration(rid) for rid in list(owner.registrations)]

    def add_registration(self, owner: Owner, namespace: bytes, layout: Layout, tp_rank: int,
                         num_blocks: int, engine: CopyEngine, mapped: Mapped) -> Registration:
        reg = Registration(next(self._registration_ids), owner, namespace, layout, tp_rank,
                           num_blocks, engine, mapped)
        self.registrations[reg.id] = reg
        owner.registrations.add(reg.id)
        return reg

    def find_registration(self, owner: Owner, namespace: bytes, tp_rank: int) -> Registration | None:
        for rid in owner.registrations:
            reg = self.registrations[rid]
            if reg.namespace == namespace and reg.tp_rank == tp_rank:
                return reg
        return None

    def registration(self, owner: Owner, registration_id: int) -> Registration:
        reg = self.registrations.get(registration_id)
        if reg is None or reg.owner is not owner:
            raise UnknownId(f"registration {registration_id} is not one of this client's "
                            f"(never registered, unregistered, or the daemon restarted)")
        return reg

    def check_may_reset(self, owner: Owner, ns: bytes) -> None:
        """A reset drops every block of a namespace, so it is for that namespace's engines: a
        client whose user has a live registration in it, the daemon's user, or root."""
        peer = owner.peer
        if peer is None or peer.uid in (0, os.geteuid()):
            return
        if any(r.namespace == ns and r.owner.peer is not None and r.owner.peer.uid == peer.uid
               for r in self.registrations.values()):
            return
        raise PermissionDenied(f"uid {peer.uid} has no registration in namespace {ns.hex()}: "
                               f"only its own engines may reset it")

    def close_registration(self, registration_id: int) -> Registration:
        reg = self.registrations.pop(registration_id)
        reg.owner.registrations.discard(registration_id)
        reg.closing = True
        return reg


def checked_engine(msg: RegisterRequest, engines: dict[type, CopyEngine], held: int,
                   most: int) -> CopyEngine:
    """The copy engine for a registration's regions, after the checks a registration must
    pass (``held``: the registrations its client would hold with it, at most ``most``)."""
    msg.layout.check()
    if not msg.regions:
        raise ProtocolError("a registration needs at least one region")
    if held > most:
        raise TooLarge(f"this client already holds {held - 1} registrations (at most {most}): "
                       f"unregister some first")
    kinds = {type(r) for r in msg.regions}
    engine = engines.get(next(iter(kinds))) if len(kinds) == 1 else None
    if engine is None:
        raise ProtocolError(f"no copy engine for {sorted(t.__name__ for t in kinds)} in this "
                            f"daemon (CUDA regions need a daemon started with CUDA)")
    if not 0 <= msg.tp_rank < msg.layout.tp_size:
        raise OutOfRange(f"tp_rank {msg.tp_rank} outside tp_size {msg.layout.tp_size}")
    return engine


def heads_note(layout: Layout, tp_rank: int) -> str:
    """The KV heads a rank moves, for the registration's log line ("" if not head-split)."""
    if not layout.kv_heads:
        return ""
    h0, h1 = layout.head_range(tp_rank)
    return (f", KV heads [{h0}, {h1}) of {layout.kv_heads}"
            f"{'' if layout.is_primary(tp_rank) else ' (replica: loads only)'}")
