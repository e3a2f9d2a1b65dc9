"""Who is on the other end of a connection, and what that peer may do.

ZeroMQ reads the kernel's ``SO_PEERCRED`` of every ipc:// connection and hands it out as the
``Peer-Address`` property of each message (``"<host>:<uid>:<gid>:<pid>"``): credentials the
kernel vouches for, unlike anything a client writes in its own ``Hello``. This module parses
them and answers three questions for the server:

- may this peer talk to the daemon at all (``AllowList``: ``allow_uid``/``allow_gid``)?
- may it make the daemon open a shared-memory object on its behalf (``check_may_open``)? The
  daemon runs as its own user or root, so without this check it would be a confused deputy that
  maps another tenant's KV for anyone who names it;
- which process to watch for exit (``pid``), so a dead engine is released at once instead of
  after a heartbeat timeout.

Never blocks beyond a passwd/group lookup, done once per distinct (uid, gid) and cached.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from functools import lru_cache

from kvpool.shared.errors import ConfigError, PermissionDenied


@dataclass(frozen=True, slots=True)
class Peer:
    uid: int
    gid: int
    pid: int      # 0 when the peer is in a PID namespace the daemon cannot see

    @classmethod
    def from_frame(cls, frame) -> "Peer | None":
        """The credentials of the connection ``frame`` (a ``zmq.Frame``) arrived on; None where
        the transport has none (a libzmq without SO_PEERCRED, or not an ipc:// socket)."""
        try:
            _, uid, gid, pid = frame.get("Peer-Address").rsplit(":", 3)
            return cls(int(uid), int(gid), int(pid))
        except Exception:
            return None


@lru_cache(maxsize=1024)
def groups_of(uid: int, gid: int) -> frozenset[int]:
    """``gid`` plus the supplementary groups of ``uid``'s account (as ``initgroups`` gives a
    login); just ``gid`` for a uid without a passwd entry."""
    try:
        name = pwd.getpwuid(uid).pw_name
        return frozenset(os.getgrouplist(name, gid))
    except (KeyError, OSError):
        return frozenset((gid,))


def _ids(text: str, lookup, what: str) -> frozenset[int]:
    out = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item.isdigit():
            out.add(int(item))
            continue
        try:
            out.add(lookup(item))
        except KeyError:
            raise ConfigError(f"allow_{what}: no {'user' if what == 'uid' else 'group'} "
                              f"named {item!r}") from None
    return frozenset(out)


class AllowList:
    """``allow_uid``/``allow_gid``: when either is set, only these users, members of these
    groups, the daemon's own user and root may connect. Empty: whoever can open the socket."""

    def __init__(self, allow_uid: str, allow_gid: str) -> None:
        self.uids = _ids(allow_uid, lambda n: pwd.getpwnam(n).pw_uid, "uid")
        self.gids = _ids(allow_gid, lambda n: grp.getgrnam(n).gr_gid, "gid")
        self.is_active = bool(self.uids or self.gids)
        self._always = {0, os.geteuid()}

    def check(self, peer: Peer | None) -> None:
        """Raise ``PermissionDenied`` unless ``peer`` may talk to this daemon."""
        if not self.is_active:
            return
        if peer is None:
            raise PermissionDenied("this daemon accepts only listed users (allow_uid/allow_gid)"
                                   " and cannot read the peer's credentials")
        if peer.uid in self._always or peer.uid in self.uids:
            return
        if self.gids & groups_of(peer.uid, peer.gid):
            return
        raise PermissionDenied(f"uid {peer.uid} (gid {peer.gid}) may not use this kvpoold: it "
                               f"accepts uids {sorted(self.uids)} and members of gids "
                               f"{sorted(self.gids)} (allow_uid/allow_gid)")


def check_may_open(st: os.stat_result, peer: Peer | None, what: str) -> None:
    """Raise ``PermissionDenied`` unless ``peer`` could open the file ``st`` describes for
    reading and writing itself (the kernel's owner/group/other rule; root may)."""
    if peer is None or peer.uid == 0:
        return
    mode = st.st_mode
    if peer.uid == st.st_uid:
        ok = mode & stat.S_IRUSR and mode & stat.S_IWUSR
    elif st.st_gid in groups_of(peer.uid, peer.gid):
        ok = mode & stat.S_IRGRP and mode & stat.S_IWGRP
    else:
        ok = mode & stat.S_IROTH and mode & stat.S_IWOTH
    if not ok:
        raise PermissionDenied(f"{what} belongs to uid {st.st_uid} (mode {stat.S_IMODE(mode):o})"
                               f": the registering process (uid {peer.uid}) could not open it "
                               f"itself, so kvpoold will not open it for it")
