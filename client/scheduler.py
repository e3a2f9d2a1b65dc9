"""``SchedulerClient``: what an engine's scheduler uses to find, pin and store blocks.

Called from the scheduler's thread only. Two kinds of methods:

- *Waiting* ones (``lookup``, ``reserve``, ``release``, ``abort_store``, ``reset``,
  ``info``, ``ping``): one round trip each, bounded by ``timeout_ms``, raising
  ``DaemonUnavailable`` past it. For tools, tests and benchmarks.
- *Never-waiting* ones, for schedulers that must not block (vLLM's): ``ready`` (connects without
  waiting), ``find`` (hits read in the daemon's shared-memory index, in the same call: no round
  trip, no pin), ``touch_nowait`` (those hits made recent and counted by the daemon),
  ``lookup_start`` (a ``PendingCall`` to poll on later steps: the round trip, for a client that
  cannot map the index or a remote tier to probe), ``take_slots`` (writable
  slots from a local stock of reservations), ``release_nowait``, ``abort_nowait`` and
  ``reset_nowait`` (sent; their answers are folded into the next ``poll``). ``poll`` takes in
  every answer that has arrived: lookup replies, reservation grants, acknowledgements.

The stock: per namespace, slot refs the daemon reserved for this client ahead of need (bound to
no key). ``take_slots`` hands them out and asks for more, without waiting, when the stock runs
below half of its target; the target follows demand (twice the largest recent take). A
reservation is used only within half of the daemon's TTL, so a store never races its expiry;
older ones are given back. A new connection (a daemon restart, or a reconnect after a timeout)
empties the stock: what the earlier connection held is released by the daemon with it, and
stores that still name such slots are refused there (``StoreRequest.grant``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvpool.client.index_reader import IndexReader
from kvpool.client.transport import Transport
from kvpool.shared import index_format, protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import DaemonUnavailable, ErrorCode, error_from_code

log = logging.getLogger(__name__)

# Stock targets per namespace (slots): a floor so the first steps after start find slots, a
# ceiling so one engine's burst never holds much of the pool unbound (the daemon caps it too).
STOCK_MIN = 64
STOCK_MAX = 8192
# After a reservation came back empty (this client holds as many tickets as the daemon lets
# it) or refused, wait this long before asking again, instead of asking every step.
RESERVE_RETRY_S = 0.02
# A reservation refused because no worker has registered the namespace yet is asked for again
# at the next poll: after a daemon restart the scheduler often reconnects before its workers
# re-register, and a scheduler built before them must not lose its first request's stores
# (vLLM builds it after them, but either side may come back first). The stock stays
# "reserving" meanwhile, so the planner keeps those blocks waiting instead of skipping them.
RESERVE_RETRY_UNREGISTERED_S = 0.0
# A send this soon after ``ready()`` said True trusts that answer instead of checking the
# connection again: a scheduler step checks once and then sends several requests, and each
# check reads the monitor socket through libzmq (~7 us). A send on a connection lost in that
# window fails or is refused as it would a moment after a fresh check.
READY_TRUSTED_S = 0.002


class PendingCall:
    """A request in flight. ``result()`` returns its reply, None while waiting, or raises."""

    def __init__(self, client: "SchedulerClient", req_id: int, deadline: float,
                 epoch: int) -> None:
        self._client = client
        self.req_id = req_id
        self._deadline = deadline
        self._epoch = epoch

    def result(self) -> p.Reply | None:
        return self._client._collect(self)


@dataclass
class _Stock:
    """Reserved slot refs of one namespace, oldest first, in batches of one grant."""

    batches: deque[tuple[float, list[int]]] = field(default_factory=deque)  # (use-by, refs)
    count: int = 0
    target: int = STOCK_MIN
    asked: int = 0             # req_id of the reservation in flight (0: none)
    asked_until: float = 0.0   # its answer counts as lost after this
    retry_at: float = 0.0
    starved: bool = False      # the last answer was an error (no slots will come)
    unregistered: bool = False  # the last answer: no worker registered the namespace yet


class SchedulerClient:
    def __init__(self, config: ClientConfig, name: str = "", engine_id: str = "",
                 heartbeat: bool = True) -> None:
        self._t = Transport(config, p.Role.SCHEDULER, name, engine_id, heartbeat=heartbeat)
        self._timeout_s = config.timeout_ms / 1000
        self._replies: dict[int, p.Reply] = {}
        self._pending: set[int] = set()
        self._stocks: dict[bytes, _Stock] = {}
        self._reserving: dict[int, bytes] = {}    # req_id -> namespace
        self._epoch = 0
        self._grant = ""                          # daemon_id of the stock's grants
        self._lost: DaemonUnavailable | None = None
        self._ready_at = float("-inf")            # when ready() last said True
        self._index: IndexReader | None = None    # the connected daemon's shared-memory index
        self._index_failed = ""                   # why it could not be mapped (logged once)

    # ---- waiting calls (tools, tests, benchmarks) ------------------------------------------

    def lookup(self, namespace: bytes, key_lists: Sequence[Sequence[bytes]],
               pin: bool = False) -> p.LookupReply:
        """Leading hits of many requests in one round trip; with ``pin``, one lease each."""
        reply = self._t.call(lambda rid: p.LookupRequest(rid, namespace, key_lists, pin))
        assert isinstance(reply, p.LookupReply)
        return reply

    def reserve(self, namespace: bytes, count: int) -> p.ReserveReply:
        """Up to ``count`` reserved slots of ``namespace`` (see ``take_slots``), waiting."""
        reply = self._t.call(lambda rid: p.ReserveRequest(rid, namespace, count))
        assert isinstance(reply, p.ReserveReply)
        return reply

    def abort_store(self, slots: Sequence[int]) -> int:
        return self._ok(lambda rid: p.AbortStoreRequest(rid, list(slots)))

    def release(self, leases: Sequence[int]) -> int:
        return self._ok(lambda rid: p.ReleaseRequest(rid, [x for x in leases if x]))

    def reset(self, namespace: bytes) -> int:
        return self._ok(lambda rid: p.ResetRequest(rid, namespace))

    def info(self) -> p.PoolInfo:
        reply = self._t.call(lambda rid: p.InfoRequest(rid))
        assert isinstance(reply, p.InfoReply)
        return reply.info

    def ping(self) -> p.Pong:
        reply = self._t.call(lambda rid: p.Ping(rid))
        assert isinstance(reply, p.Pong)
        return reply

    # ---- never-waiting calls (the scheduler's step) ----------------------------------------

    def connect(self) -> bool:
        """Connect now, waiting up to ``timeout_ms`` (at start-up, before any step: the
        heartbeat then keeps the connection while the engine idles). False if the daemon is
        not there; ``ready`` tries again later without waiting."""
        try:
            self._t.ensure_connected()
        except DaemonUnavailable:
            return False
        return True

    def ready(self) -> bool:
        """Connected (True), or connecting without waiting (False: ask again next step).
        Raises ``DaemonUnavailable`` when the daemon is missing or did not answer in time."""
        ok = self._t.connect_nowait()
        self._ready_at = time.monotonic() if ok else float("-inf")
        return ok

    def poll(self, just_ready: bool = False) -> None:
        """Take in every answer that has arrived, without waiting: lookup replies (for their
        ``PendingCall``), reservation grants (into the stock), acknowledgements of
        ``*_nowait`` calls. Raises ``DaemonUnavailable`` (after dropping the connection) when
        a reservation went unanswered for ``timeout_ms``. ``just_ready``: the caller's
        ``ready()`` has just returned True, so the connection is not checked again (a check
        reads the monitor socket through libzmq, several us)."""
        t = self._t
        if not just_ready:
            if t.is_stale or (t.is_connected and t.connection_lost()):
                t.disconnect(backoff=False)     # restarted or gone: the next ``ready`` finds out
            elif t.is_connecting:
                t.connect_nowait()
        self._check_epoch()
        for reply in t.drain(owed_only=True):
            rid = reply.req_id
            if rid in self._pending:
                self._pending.discard(rid)
                self._replies[rid] = reply
            elif rid in self._reserving:
                self._granted(self._reserving.pop(rid), reply)
            elif isinstance(reply, p.ErrorReply):
                # An answer to a *_nowait call: nobody waits for it.
                if reply.code == ErrorCode.HELLO_REQUIRED:
                    t.disconnect(backoff=False)    # the daemon restarted: connect again
                else:
                    log.debug("kvpool: a request was refused: %s", reply.message)
        now = time.monotonic()
        for ns, st in self._stocks.items():
            if st.asked and now > st.asked_until:
                self._reserving.pop(st.asked, None)
                st.asked = 0
                t.disconnect()
                raise DaemonUnavailable(f"kvpoold did not answer a reservation within "
                                        f"{self._timeout_s * 1000:.0f} ms")
            self._refill(ns, st, now)

    def index(self) -> IndexReader | None:
        """The connected daemon's shared-memory index, mapped read-only on first use after each
        (re)connection; None while not connected, where this process may not map it (another
        user without the socket's group, a CPU whose memory order the reader cannot rely on),
        or with a daemon that publishes none (then ``lookup_start`` asks it). Never raises."""
        t = self._t
        self._check_epoch()
        if not t.is_connected or not t.index_segment:
            return None
        ix = self._index
        if ix is not None and not ix.superseded and ix.daemon_id == t.daemon_id:
            return ix
        if ix is not None:
            ix.close()
            self._index = None
        if not index_format.reader_supported():
            self._index_unusable("this CPU's memory ordering is not x86-64's")
            return None
        try:
            ix = IndexReader.open(t.index_segment)
        except (OSError, ValueError) as e:
            self._index_unusable(str(e))
            return None
        if ix.daemon_id != t.daemon_id or ix.superseded:
            ix.close()              # a daemon's segment, not yet the connected one's
            return None
        self._index = ix
        return ix

    def index_pending(self) -> bool:
        """No index to read only because the connection is being made or remade (a daemon
        restart): ``find`` answers once it is, a step or two later."""
        t = self._t
        return not t.is_connected or t.is_stale

    def find(self, namespace: bytes, hashes: Sequence[bytes]
             ) -> tuple[int, list[int], list[int]] | None:
        """The leading hits of ``hashes`` in the shared-memory index, read now: (how many,
        their slot refs, their locations), a ref 0 where a lower tier holds the block. None
        when there is no usable index (see ``index``). Pins nothing: a block evicted before
        its load fails that block alone."""
        ix = self.index()
        got = ix.leading_lists(namespace, hashes) if ix is not None else None
        if got is None:
            return None
        n, refs, locs = got
        if locs.count(index_format.POOL) != n:
            refs = [r if where == index_format.POOL else 0 for r, where in zip(refs, locs)]
        return n, refs, locs

    def find_each(self, namespace: bytes, hashes: Sequence[bytes]) -> list[int] | None:
        """Every key of ``hashes`` read in the index now, hits past a miss too (a state
        group's keys stand alone): per key, its slot ref, 0 where a lower tier holds it, -1 for
        a miss. None when there is no usable index. Pins nothing."""
        ix = self.index()
        got = ix.find(namespace, hashes) if ix is not None else None
        if got is None:
            return None
        loc, ref = got
        refs = np.where(loc == index_format.POOL, ref, 0).astype(np.int64)
        refs[loc == index_format.EMPTY] = -1
        return refs.tolist()

    def touch_nowait(self, namespace: bytes, hashes: Sequence[bytes], missed_blocks: int) -> None:
        """Tell the daemon about hits read in the index (most recently used now) and misses
        (counted), without waiting."""
        self._send(lambda rid: p.TouchRequest(rid, namespace, list(hashes), missed_blocks))

    def _index_unusable(self, why: str) -> None:
        if why != self._index_failed:
            self._index_failed = why
            log.warning("kvpool: cannot read the daemon's shared-memory index (%s): lookups go "
                        "to the daemon instead, a step later", why)

    def keep_stock(self, namespace: bytes) -> None:
        """Keep a stock of reserved slots of ``namespace`` from now on (refilled by ``poll``
        whenever connected), so the first stores find slots."""
        self._stocks.setdefault(namespace, _Stock())

    def wait_stock(self) -> None:
        """Start-up only: wait until the reservations the stocks have in flight are answered
        (at most ``timeout_ms``), so that an engine's first steps find tickets. Without it,
        on a loaded host the grant came after the first step: that step's stores waited for
        the next, and the blocks that left a sliding window meanwhile were never stored.
        Never raises: a daemon that does not answer is the caller's next poll's to find."""
        deadline = time.monotonic() + self._timeout_s
        # Those in flight now, answered or not: one round trip, whatever the answer (a refusal
        # says no worker registered the namespace yet; the stock asks again later).
        asked = [(st, st.asked) for st in self._stocks.values() if st.asked and not st.count]
        while any(st.asked == req_id for st, req_id in asked):
            left = deadline - time.monotonic()
            if left <= 0 or not self._t.is_connected:
                return
            self._t.wait_readable(min(left, 0.05))
            try:
                self.poll()
            except DaemonUnavailable:
                return

    def lookup_start(self, namespace: bytes, key_lists: Sequence[Sequence[bytes]],
                     pin: bool = False) -> PendingCall:
        """Send a lookup and return at once; poll ``PendingCall.result()`` later. Raises
        ``DaemonUnavailable`` when not connected (see ``ready``)."""
        req_id = self._send(lambda rid: p.LookupRequest(rid, namespace, key_lists, pin))
        self._pending.add(req_id)
        return PendingCall(self, req_id, time.monotonic() + self._timeout_s, self._t.epoch)

    def take_slots(self, namespace: bytes, n: int) -> tuple[list[int], str]:
        """Up to ``n`` reserved slot refs of ``namespace`` from the stock, and the daemon id
        that granted them (``StoreRequest.grant``); fewer (possibly none) while the stock is
        short. Never waits: asks for more in the background. The caller binds each ref to a
        key by naming it in a store, or gives it back with ``abort_nowait``."""
        st = self._stocks.get(namespace)
        if st is None:
            st = self._stocks[namespace] = _Stock()
        self._check_epoch()
        if st.count < n and st.asked and self._t.is_connected:
            try:
                self.poll()     # the grant may be waiting in the socket
            except DaemonUnavailable:
                pass            # the caller's next poll finds out and says so
        now = time.monotonic()
        while st.batches and st.batches[0][0] <= now:
            _, old = st.batches.popleft()
            st.count -= len(old)
            self._abort_quietly(old)
        st.target = min(STOCK_MAX, max(st.target, 2 * n))
        out: list[int] = []
        while len(out) < n and st.batches:
            use_by, refs = st.batches[0]
            k = n - len(out)
            out.extend(refs[:k])
            if k >= len(refs):
                st.batches.popleft()
            else:
                st.batches[0] = (use_by, refs[k:])
        st.count -= len(out)
        self._refill(namespace, st, now)
        return out, self._grant

    def stock(self, namespace: bytes) -> int:
        st = self._stocks.get(namespace)
        return st.count if st is not None else 0

    def reserving(self, namespace: bytes) -> bool:
        """A reservation for ``namespace`` is in flight, or will be asked for shortly: slots
        are coming, unless the daemon refused the last one (``starved``)."""
        st = self._stocks.get(namespace)
        return st is not None and (bool(st.asked) or not st.starved)

    def starved(self, namespace: bytes) -> bool:
        """The daemon refused the last reservation for ``namespace`` (an error, not an empty
        grant: that one only means this client's tickets are at their cap)."""
        st = self._stocks.get(namespace)
        return st is not None and st.starved and not st.count

    def release_nowait(self, leases: Sequence[int]) -> None:
        """Unpin leases without waiting (raises ``DaemonUnavailable`` if not connected: the
        daemon releases a lost connection's leases itself)."""
        self._send(lambda rid: p.ReleaseRequest(rid, [x for x in leases if x]))

    def abort_nowait(self, slots: Sequence[int]) -> None:
        """Give back prepared or reserved slots without waiting."""
        self._send(lambda rid: p.AbortStoreRequest(rid, list(slots)))

    def reset_nowait(self, namespace: bytes) -> None:
        """Forget every block of ``namespace`` without waiting for the answer. Lookups sent
        afterwards on this connection see the reset (the daemon handles one client's requests
        in order)."""
        self._send(lambda rid: p.ResetRequest(rid, namespace))

    @property
    def owner_id(self) -> int | None:
        return self._t.owner_id

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None
        self._t.close()

    # ---- internals -------------------------------------------------------------------------

    def _ok(self, make) -> int:
        reply = self._t.call(make)
        assert isinstance(reply, p.OkReply)
        return reply.count

    def _send(self, make) -> int:
        t = self._t
        if not (t.is_connected and time.monotonic() - self._ready_at < READY_TRUSTED_S) \
                and not t.connect_nowait():
            raise DaemonUnavailable("still connecting to kvpoold")
        self._check_epoch()
        return self._t.send_connected(make)

    def _check_epoch(self) -> None:
        """A new connection: what the earlier one was granted is gone with it."""
        if self._t.epoch == self._epoch:
            return
        self._epoch = self._t.epoch
        self._grant = self._t.daemon_id or ""
        self._reserving.clear()
        for st in self._stocks.values():
            st.batches.clear()
            st.count, st.asked, st.starved, st.retry_at = 0, 0, False, 0.0
            st.unregistered = False

    def _refill(self, namespace: bytes, st: _Stock, now: float) -> None:
        if st.asked or st.count * 2 > st.target or now < st.retry_at \
                or not self._t.is_connected:
            return
        count = st.target - st.count
        try:
            req_id = self._send(lambda rid: p.ReserveRequest(rid, namespace, count))
        except DaemonUnavailable:
            return    # the next lookup or poll finds out and says so
        st.asked, st.asked_until = req_id, now + self._timeout_s
        self._reserving[req_id] = namespace

    def _granted(self, namespace: bytes, reply: p.Reply) -> None:
        st = self._stocks.get(namespace)
        if st is None:
            return
        st.asked = 0
        now = time.monotonic()
        if isinstance(reply, p.ReserveReply) and reply.slots:
            if reply.daemon_id != self._grant:   # granted to another life: never use them
                return
            st.batches.append((now + reply.ttl_ms / 2000, list(reply.slots)))
            st.count += len(reply.slots)
            st.starved = st.unregistered = False
            return
        if isinstance(reply, p.ErrorReply) and reply.code == ErrorCode.UNKNOWN_ID:
            # No worker registered the namespace yet: slots will come once one does.
            if not st.unregistered:
                log.info("kvpool: no worker has registered namespace %s with kvpoold yet; "
                         "stores wait for it", namespace.hex()[:16])
            st.unregistered = True
            st.starved = False
            st.retry_at = now + RESERVE_RETRY_UNREGISTERED_S
            return
        st.unregistered = False
        st.retry_at = now + RESERVE_RETRY_S
        if isinstance(reply, p.ReserveReply):
            # Nothing granted: this client holds as many tickets as it may. They take no
            # room (a ticket finds its slot when its store arrives, evicting if it must), so
            # more come as the workers' stores spend them: slots are still coming.
            st.starved = False
            return
        st.starved = True
        if isinstance(reply, p.ErrorReply):
            if reply.code == ErrorCode.HELLO_REQUIRED:
                self._t.disconnect(backoff=False)
            log.debug("kvpool: reservation refused: %s", reply.message)

    def _abort_quietly(self, refs: list[int]) -> None:
        try:
            self._send(lambda rid: p.AbortStoreRequest(rid, refs))
        except DaemonUnavailable:
            pass    # the daemon takes them back at their TTL

    def _collect(self, call: PendingCall) -> p.Reply | None:
        if call._epoch == self._t.epoch and self._t.is_connected:
            self.poll()
        reply = self._replies.pop(call.req_id, None)
        if reply is None:
            if (self._t.is_stale or call._epoch != self._t.epoch or not self._t.is_connected
                    or self._t.connection_lost()
                    or time.monotonic() > call._deadline):
                self._pending.discard(call.req_id)
                if call._epoch == self._t.epoch:
                    self._t.disconnect()
                raise DaemonUnavailable("kvpoold did not answer the lookup in time")
            return None
        if isinstance(reply, p.ErrorReply):
            if reply.code == ErrorCode.HELLO_REQUIRED:
                # The daemon released this client (silent too long, or restarted): the next
                # call says Hello again instead of being refused the same way.
                self._t.disconnect(backoff=False)
            raise error_from_code(reply.code, reply.message)
        return reply
