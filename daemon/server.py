"""kvpoold's server: the ROUTER socket, dispatch, housekeeping and the lifecycle. Store and load
jobs run in ``daemon/copy_jobs.py``; registrations' memory is attached off the loop by
``daemon/attaches.py``; clients whose process exits are released by ``daemon/exit_watch.py``.

``Server.serve()`` reads top to bottom: ``startup()`` (bind, signals) → ``main_loop()`` (receive,
dispatch, reply) beside ``housekeeping()`` (heartbeat timeouts, lease/write expiry) → ``shutdown()``
(stop accepting, let attaches and jobs finish for a grace period, abort the rest, drop leases,
close engines, unlink or keep the pool).

With tiers under the pool (``--disk-path``, ``--remote-store``), ``daemon/tiering.py`` is asked
before each lookup (lower-tier hits come up into the pool; a lookup that a remote store must be
asked about is answered when it has answered, within its tier's deadline, while the loop serves
everyone else) and when a load starts (a load of a block still coming up waits for it); the
tiers' I/O runs on their own threads.

Rules: the event loop never blocks (copies run in the engines and attaches on threads of their
own, off the loop); every request gets exactly one reply, unless its client left before it was
ready; every exception is turned into an ``ErrorReply`` (or a failed ``JobDone``) in
``_dispatch`` (a registration's: when its attach comes back), unexpected ones as INTERNAL with a
logged traceback, and the peer stays connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from kvpool.daemon.attaches import Attaches, Attaching
from kvpool.daemon.copy_engine import CopyEngine, Mapped
from kvpool.daemon.copy_jobs import CopyJobs, check_count
from kvpool.daemon.exit_watch import ExitWatch
from kvpool.daemon.heap import Heap
from kvpool.daemon.index import Index
from kvpool.daemon.index_segment import IndexSegment, KeyLocations, capacity_for
from kvpool.daemon.listen_socket import bind_router
from kvpool.daemon.loop_watch import LoopWatch
from kvpool.daemon.off_loop import off_loop
from kvpool.daemon.peer import AllowList, Peer
from kvpool.daemon.pool import Pool
from kvpool.daemon.registry import (Owner, Registration, Registry, checked_engine,
                                     heads_note)
from kvpool.daemon.replies import error_reply
from kvpool.daemon.shm_reaper import reap_engine_segments
from kvpool.daemon.telemetry import Telemetry
from kvpool.daemon.tier import LowerTier
from kvpool.daemon.tiering import Tiering
from kvpool.shared import protocol as p
from kvpool.shared.index_format import FLAG_REMOTE_TIER, segment_name
from kvpool.shared.config import DaemonConfig, parse_size
from kvpool.shared.errors import (ConfigError, HelloRequired, ProtocolError, TooLarge,
                                  VersionMismatch)

log = logging.getLogger("kvpoold")

SHUTDOWN_GRACE_S = 5.0
# Registrations one client may hold at once, those still attaching included (re-registering a
# namespace and rank replaces, and does not count). A vLLM worker holds one per KV-cache group;
# each one maps memory and may own a copy thread, so a client must not be able to open them
# without end.
MAX_REGISTRATIONS_PER_CLIENT = 64
_SEND_MORE = zmq.NOBLOCK | zmq.SNDMORE
# (plain ints: zmq's enum members make each ``&`` an enum operation in Python)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# How often abandoned engine KV segments are looked for besides start and client release.
REAP_PERIOD_S = 10.0
# A housekeeping pass that raises is logged with its traceback at most this often.
HOUSEKEEPING_ERROR_LOG_S = 10.0
# A housekeeping tick this late means the daemon itself was stopped (see _housekeeping).
STALL_S = 0.5


class Server:
    def __init__(self, config: DaemonConfig, pool: Pool, engines: dict[type, CopyEngine],
                 lowers: list[LowerTier] | None = None) -> None:
        self.config = config
        self.pool = pool
        self.engines = engines
        # Keeps the collector's full collections off what lasts (settled once serving).
        self.heap = Heap()
        self.index = Index(pool, config.lease_ttl_s, config.write_timeout_s,
                           parse_size(config.namespace_quota), config.reservation_ttl_s,
                           on_new_slots=self.heap.keep_new)
        self.registry = Registry()
        self.daemon_id = uuid.uuid4().hex[:16]
        self.started = time.monotonic()
        self.errors = 0
        self.should_exit = asyncio.Event()
        self.is_serving = False
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._lock_fd: int | None = None
        self.index_segment: IndexSegment | None = None
        self._in_drain = False
        self._next_reap = time.monotonic() + REAP_PERIOD_S
        self.allow = AllowList(config.allow_uid, config.allow_gid)
        self.exit_watch = ExitWatch(self._process_exited)
        # From the loop's start, before the socket is bound (logged at the first registration).
        self.loop_watch = LoopWatch()
        self._registered_once = False
        self.attaches = Attaches(self._attached)
        # Counts from now on; serves /metrics and events once _startup opens it.
        self.telemetry = Telemetry(config)
        if pool.adopted:
            kept = self.index.adopt()
            log.info("adopted %d committed blocks from the existing pool", kept)
        self.tiering = Tiering(self.index, lowers) if lowers else None
        self.jobs = CopyJobs(self.index, self.registry, self.tiering, self.daemon_id,
                             self.telemetry, self._send, self._detach, self._count_error,
                             _open_trace(config.trace))

    # ---- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        self.loop_watch.start()
        try:
            await self._startup()
        except BaseException:
            self._release_resources(failed_start=True)
            raise
        try:
            housekeeping = asyncio.create_task(self._housekeeping())
            await self._main_loop()
            housekeeping.cancel()
        finally:
            await self._shutdown()
            self.loop_watch.stop()

    async def _startup(self) -> None:
        path = Path(self.config.socket_path)
        loop = asyncio.get_running_loop()
        # First: a stop that comes while the start awaits the index's reservation is the
        # loop's to handle (the start completes, then the daemon stops as it would serving).
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.should_exit.set)
        self._ctx, self._sock, self._lock_fd = bind_router(self.config)
        self.index_segment = await publish_index(self.pool, self.index, self.tiering,
                                                 self.config, self.daemon_id, path)
        # After the socket lock: only the one daemon of this host sweeps.
        reap_engine_segments()
        # After the socket lock, so a second daemon reports "socket busy", not a busy port.
        self.telemetry.open()
        self.telemetry.watch(self.index.table)
        if self.tiering is not None:
            self.tiering.start()
        self.is_serving = True
        for engine in self.engines.values():
            engine.start()
        self.telemetry.serving(self.info())
        self.heap.settle()
        log.info("kvpoold %s serving ipc://%s, pool %s: %d bytes in %d extents%s", self.daemon_id,
                 path, self.pool.name, self.pool.nbytes, self.pool.geometry.num_extents,
                 " (adopted)" if self.pool.adopted else "")

    async def _main_loop(self) -> None:
        # A plain socket drained from the loop's reader callback: no future per message.
        # ZeroMQ's FD is edge-triggered, so every wake-up drains until ZMQ_EVENTS says nothing
        # waits, and a send made outside the callback reads ZMQ_EVENTS too (a send can
        # consume the edge): a drain is scheduled only where a message waits.
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        loop.call_soon(self._drain)
        try:
            await self.should_exit.wait()
        finally:
            loop.remove_reader(self._sock.getsockopt(zmq.FD))

    def _drain(self) -> None:
        sock = self._sock
        if sock is None or sock.closed or not self.is_serving:
            return
        self._in_drain = True
        # Receive while ZMQ_EVENTS says a message waits: reading it also takes in the socket's
        # pending commands, re-arming its FD. Not until EAGAIN: pyzmq builds an exception
        # object for it (an import and a strerror call in Python) once per drain, ~5% of the
        # busy loop's Python in bench/host_scale.py's host-path stores (py-spy). A request is
        # [identity, body]; the body stays a Frame: it carries its connection's kernel
        # credentials.
        recv, events = sock.recv, sock.get
        try:
            while events(_EVENTS) & _POLLIN:
                try:
                    identity = recv(zmq.NOBLOCK)
                    body = recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:      # (not after POLLIN; kept for safety)
                    return
                frames = 2
                more = body.more
                while more:          # a multi-frame message: taken in whole, then refused
                    more = recv(zmq.NOBLOCK, copy=False).more
                    frames += 1
                self._dispatch(identity, body, frames)
        finally:
            self._in_drain = False

    async def _housekeeping(self) -> None:
        await tick_forever(min(0.1, self.config.peer_timeout_ms / 4000), self._housekeeping_tick)

    def _housekeeping_tick(self, now: float, stalled: float) -> None:
        """One pass of ``_housekeeping``: ``stalled`` is how much later than its period it
        came."""
        if stalled > STALL_S:
            # This daemon did not run (SIGSTOP, a paused VM, swapped out): its clients'
            # heartbeats wait unread in the socket, so that part of their silence is ours and
            # does not count (an exited client still goes at once, by pidfd).
            log.warning("kvpoold did not run for %.1f s: not counted as its clients' silence",
                        stalled)
            for owner in self.registry.owners.values():
                owner.last_seen += stalled
        if now >= self._next_reap:
            # Engines that died while no client of theirs was connected (or before the daemon
            # started) have their KV segments removed here.
            self._next_reap = now + REAP_PERIOD_S
            reap_engine_segments()
        self.index.expire(now)
        self.telemetry.tick(now, self.info)
        limit = now - self.config.peer_timeout_ms / 1000
        for owner in [o for o in self.registry.owners.values() if o.last_seen < limit]:
            log.info("client %d (%r, pid %d) went silent: releasing what it held",
                     owner.id, owner.name, owner.pid)
            self._release_owner(owner)

    async def _shutdown(self) -> None:
        log.info("shutting down: %d jobs in flight", len(self.jobs.in_flight))
        self.is_serving = False
        self.telemetry.stopping()
        self.jobs.abort_held()
        # Before the engines close: an attach still running would open memory (and make a GPU's
        # lanes) in an engine already closed.
        await self.attaches.close(SHUTDOWN_GRACE_S)
        for engine in set(self.engines.values()):
            engine.close()
        if self.jobs.in_flight:
            await asyncio.wait(set(self.jobs.in_flight), timeout=SHUTDOWN_GRACE_S)
        for owner in list(self.registry.owners.values()):
            self._release_owner(owner)
        if self.tiering is not None:
            # Before the pool goes: the tier reads pool memory until it closes.
            await self.tiering.close(SHUTDOWN_GRACE_S)
        self._release_resources()
        if self.jobs.trace:
            self.jobs.trace.close()
        log.info("kvpoold stopped%s", "; pool kept for the next start" if self.config.keep_pool
                 else "")

    def _release_resources(self, failed_start: bool = False) -> None:
        """Close what the server holds. The pool goes unless the operator keeps it
        (``keep_pool``); a start that failed keeps only a pool it adopted (a new one holds
        nothing worth keeping)."""
        keep = self.config.keep_pool and (self.pool.adopted or not failed_start)
        if self._sock is not None:
            self._sock.close(linger=0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        if self._ctx is not None:
            self._ctx.term()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self.exit_watch.close()
        if self.index_segment is not None:
            self.index_segment.close()      # a restarted daemon rebuilds it from the pool
        self.pool.close(unlink=not keep)
        self.telemetry.close(pool_kept=keep)

    # ---- dispatch --------------------------------------------------------------------------

    def _dispatch(self, identity: bytes, frame: zmq.Frame, frames: int = 2) -> None:
        req_id = 0
        try:
            data = frame.buffer
            if frames != 2:
                req_id = p.peek_req_id(data)
                raise ProtocolError(f"expected one frame per message, got {frames - 1}")
            if len(data) > self.config.max_request_bytes:
                req_id = p.peek_req_id(data)
                raise TooLarge(f"frame of {len(data)} bytes exceeds max_request_bytes="
                               f"{self.config.max_request_bytes}")
            try:
                msg = p.decode_request(data)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
                # (msgspec lets a string that is not UTF-8 out as UnicodeDecodeError.)
                req_id = p.peek_req_id(data)
                raise ProtocolError(f"malformed request: {e}") from None
            req_id = msg.req_id
            reply = self._handle(identity, msg, frame)
        except Exception as e:   # refused, or a bug of ours (INTERNAL): answered, serving on
            reply = error_reply(req_id, e, self._count_error)
        if reply is not None:
            self._send(identity, reply)

    def _count_error(self, code: int) -> None:
        self.errors += 1
        self.telemetry.error(code)

    def _send(self, identity: bytes, reply: p.Reply) -> None:
        sock = self._sock
        if sock is None or sock.closed:
            return
        try:
            # Two plain sends: what send_multipart does, less its per-call Python.
            sock.send(identity, _SEND_MORE)
            sock.send(p.encode(reply), zmq.NOBLOCK)
        except zmq.Again:   # the peer's queue is full: it is not reading; drop, it will time out
            log.warning("reply dropped: client queue full")
        # (Reading ZMQ_EVENTS re-arms the FD when nothing waits: no drain, one loop callback
        # less per finished job.)
        if not self._in_drain and sock.get(_EVENTS) & _POLLIN:
            asyncio.get_running_loop().call_soon(self._drain)

    def _handle(self, identity: bytes, msg: p.Request, frame: zmq.Frame) -> p.Reply | None:
        now = time.monotonic()
        match msg:
            case p.Hello():
                return self._hello(identity, msg, Peer.from_frame(frame), now)
            case p.Heartbeat(owner_id=owner_id):
                if self.allow.is_active:
                    self.allow.check(Peer.from_frame(frame))
                owner = self.registry.owners.get(owner_id)
                if owner is None:
                    raise HelloRequired(f"owner {owner_id} unknown to daemon {self.daemon_id}")
                owner.last_seen = now
                return p.HeartbeatReply(msg.req_id, self.daemon_id)
            case p.Ping():
                if self.allow.is_active:
                    self.allow.check(Peer.from_frame(frame))
                return p.Pong(msg.req_id, self.daemon_id, now - self.started)
        owner = self.registry.by_identity.get(identity)
        if owner is None:
            raise HelloRequired(f"say Hello first (daemon {self.daemon_id} does not know this "
                                f"connection; it may have restarted)")
        owner.last_seen = now
        idx = self.index
        match msg:
            case p.LookupRequest():
                probing = (self.tiering.probe(msg.namespace, msg.key_lists)
                           if self.tiering is not None else None)
                if probing is not None:
                    probing.add_done_callback(lambda _f: self._lookup_later(identity, owner, msg))
                    return None
                return self._lookup(owner, msg, now)
            case p.ReserveRequest():
                check_count(msg.count, "slots")
                return p.ReserveReply(msg.req_id, idx.reserve(msg.namespace, msg.count, owner.id,
                                                              now),
                                      int(self.config.reservation_ttl_s * 1000), self.daemon_id)
            case p.TouchRequest():
                check_count(len(msg.keys), "keys")
                n = idx.touch(msg.namespace, msg.keys)
                idx.count_lookup(msg.namespace, len(msg.keys), msg.missed_blocks)
                self.telemetry.hits_read(len(msg.keys), msg.missed_blocks,
                                         idx.block_tokens(msg.namespace))
                return p.OkReply(msg.req_id, n)
            case p.AbortStoreRequest():
                return p.OkReply(msg.req_id, idx.abort_store(msg.slots, owner.id))
            case p.ReleaseRequest():
                return p.OkReply(msg.req_id, idx.release_leases(msg.leases, owner.id))
            case p.StoreRequest() | p.LoadRequest():
                return self.jobs.start(owner, msg)
            case p.RegisterRequest():
                self._register(owner, msg)
                return None
            case p.UnregisterRequest():
                reg = self.registry.registration(owner, msg.registration_id)
                self._close_registration(self.registry.close_registration(reg.id))
                return p.OkReply(msg.req_id, 1)
            case p.InfoRequest():
                return p.InfoReply(msg.req_id, self.info(now))
            case p.ByeRequest():
                self._release_owner(owner)
                return p.OkReply(msg.req_id, 1)
            case p.ResetRequest():
                self.registry.check_may_reset(owner, msg.namespace)
                n = idx.reset(msg.namespace)
                if self.tiering is not None:
                    n += self.tiering.reset(msg.namespace)
                log.info("reset of namespace %s by client %d: %d blocks forgotten",
                         msg.namespace.hex(), owner.id, n)
                return p.OkReply(msg.req_id, n)
        raise ProtocolError(f"unexpected message {type(msg).__name__}")

    def _lookup(self, owner: Owner, msg: p.LookupRequest, now: float) -> p.LookupReply:
        idx = self.index
        beyond = self.tiering.held_past if self.tiering is not None else None
        hits, leases, slots = idx.lookup(msg.namespace, msg.key_lists, msg.pin, owner.id, now,
                                         beyond)
        self.telemetry.lookup(hits, msg.key_lists, idx.block_tokens(msg.namespace))
        return p.LookupReply(msg.req_id, hits, leases, slots)

    def _lookup_later(self, identity: bytes, owner: Owner, msg: p.LookupRequest) -> None:
        """Answer a lookup whose probe of a lower tier has resolved, unless its client left
        meanwhile (its leases would only wait for their TTL)."""
        if not self.is_serving or self.registry.by_identity.get(identity) is not owner:
            return
        try:
            reply: p.Reply = self._lookup(owner, msg, time.monotonic())
        except Exception as e:
            reply = error_reply(msg.req_id, e, self._count_error, "answering a lookup")
        self._send(identity, reply)

    def _hello(self, identity: bytes, msg: p.Hello, peer: Peer | None, now: float) -> p.Reply:
        self.allow.check(peer)
        if msg.protocol_version != p.PROTOCOL_VERSION:
            raise VersionMismatch(f"client speaks kvpool protocol {msg.protocol_version}, this "
                                  f"daemon speaks {p.PROTOCOL_VERSION}: upgrade the older side")
        old = self.registry.by_identity.get(identity)
        if old is not None:
            self._release_owner(old)
        owner = self.registry.add_owner(identity, msg, now)
        owner.peer = peer
        self.exit_watch.watch(owner)
        # Operator tools (kvpool ping/info/top, a container's health check) connect often.
        log.log(logging.DEBUG if msg.role == p.Role.OPERATOR else logging.INFO,
                "client %d connected: %r role=%s pid=%d engine=%r", owner.id, msg.name,
                msg.role.name, msg.pid, msg.engine_id)
        return p.HelloReply(msg.req_id, p.PROTOCOL_VERSION, self.daemon_id, owner.id,
                            self.pool.nbytes, self.config.heartbeat_interval_ms,
                            self.config.max_request_bytes,
                            self.index_segment.name if self.index_segment is not None else "")

    def _register(self, owner: Owner, msg: p.RegisterRequest) -> None:
        """Check ``msg`` here (a refusal is answered at once), then attach its memory off the
        loop; ``_attached`` answers when that is done."""
        # One per (namespace, rank), made or attaching: a re-registration replaces.
        held = {self.registry.registrations[rid].key for rid in owner.registrations}
        held.update(a.key for a in self.attaches.of(owner))
        held.add((msg.namespace, msg.tp_rank))
        engine = checked_engine(msg, self.engines, len(held), MAX_REGISTRATIONS_PER_CLIENT)
        # Any TP size may join a head-split namespace: each rank moves its own heads.
        self.index.register_namespace(msg.namespace, msg.layout, msg.quota_bytes)
        self.attaches.start(owner, msg, engine)

    def _attached(self, attaching: Attaching, mapped: Mapped | None,
                  error: BaseException | None) -> None:
        """An attach came back (on the loop): the registration is made and answered, or its
        client is answered the error (none when it was released meanwhile)."""
        owner, msg = attaching.owner, attaching.msg
        if mapped is None:
            if error is not None:
                self._send(owner.identity, error_reply(msg.req_id, error, self._count_error,
                                                       "attaching a registration"))
            return
        try:
            reply: p.Reply = self._add_registration(attaching, mapped)
        except Exception as e:   # a bug of ours, answered as _dispatch answers one
            reply = error_reply(msg.req_id, e, self._count_error, "making a registration")
        self._send(owner.identity, reply)

    def _add_registration(self, attaching: Attaching, mapped: Mapped) -> p.RegisterReply:
        owner, msg, engine = attaching.owner, attaching.msg, attaching.engine
        old = self.registry.find_registration(owner, msg.namespace, msg.tp_rank)
        # Before closing the one it replaces, so the engine's event feed sees no removal.
        self.telemetry.registration_added(owner.engine_id, owner.pid, msg.namespace,
                                          msg.layout.block_tokens,
                                          lambda: self.index.committed_hashes(msg.namespace))
        if old is not None:   # re-registration replaces: engines re-register after restarts
            self._close_registration(self.registry.close_registration(old.id))
        reg = self.registry.add_registration(owner, msg.namespace, msg.layout, msg.tp_rank,
                                             msg.num_blocks, engine, mapped)
        log.info("client %d registered rank %d/%d of namespace %s: %d blocks%s", owner.id,
                 msg.tp_rank, msg.layout.tp_size, msg.namespace.hex(), msg.num_blocks,
                 heads_note(msg.layout, msg.tp_rank))
        if not self._registered_once:
            self._registered_once = True
            log.info("first registration: %s", self.loop_watch.summary_now())
        else:
            log.debug("registration: %s", self.loop_watch.summary_now())
        return p.RegisterReply(msg.req_id, reg.id)

    # ---- releasing -------------------------------------------------------------------------

    def _release_owner(self, owner: Owner) -> None:
        self.exit_watch.unwatch(owner)
        self.attaches.drop_owner(owner)
        regs = self.registry.remove_owner(owner)
        for reg in regs:
            self._close_registration(reg)
        self.index.release_owner(owner.id)
        if regs and self.is_serving:
            reap_engine_segments()   # a dead worker's KV segment goes with it

    def _process_exited(self, owner_ids: list[int], pid: int) -> None:
        for owner in [self.registry.owners[o] for o in owner_ids if o in self.registry.owners]:
            log.info("client %d (%r, pid %d) exited: releasing what it held", owner.id,
                     owner.name, pid)
            self._release_owner(owner)

    def _close_registration(self, reg: Registration) -> None:
        self.telemetry.registration_removed(reg.owner.engine_id, reg.owner.pid, reg.namespace,
                                            lambda: self.index.committed_hashes(reg.namespace))
        if reg.jobs_in_flight == 0:
            self._detach(reg)

    def _detach(self, reg: Registration) -> None:
        try:
            reg.engine.detach(reg.mapped)
        except Exception:
            log.exception("detaching registration %d failed", reg.id)

    # ---- info ------------------------------------------------------------------------------

    def info(self, now: float | None = None) -> p.PoolInfo:
        return pool_info(self, time.monotonic() if now is None else now)

async def publish_index(pool: Pool, index: Index, tiering: Tiering | None,
                        config: DaemonConfig, daemon_id: str, socket_path: Path) -> IndexSegment:
    """The shared-memory index schedulers read hits in: the socket's group and mode, the
    pool's committed blocks (an adopted pool) and what the lower tiers hold, then every
    change as it happens."""
    lowers = tiering.lowers if tiering is not None else []
    disk_bytes = sum(getattr(t, "capacity_bytes", 0) for t in lowers)
    # Made on a thread while the loop runs: reserving the largest table (192 MiB of /dev/shm)
    # and freeing a killed daemon's took 50-100 ms on a 2-core VM, a stall on the loop.
    segment = await off_loop(lambda: IndexSegment(
        segment_name(pool.name), capacity_for(pool.nbytes, disk_bytes, config.index_entries),
        daemon_id, mode=config.socket_mode_bits, gid=socket_path.stat().st_gid,
        flags=FLAG_REMOTE_TIER if any(t.name == "remote" for t in lowers) else 0),
        "kvpool-index-create", discard=IndexSegment.close)
    locations = KeyLocations(segment, index.namespaces, lowers,
                             defer=asyncio.get_running_loop().call_soon)
    index.table.watch(locations)

    def publish_held() -> None:
        # An adopted pool's blocks, then what the lower tiers hold, from a thread: nothing
        # changes the slots or the tiers before the daemon serves, and a thread's Python
        # hands the GIL to the loop at every switch interval, where one pass on the loop
        # held it 207-284 ms at 522K adopted blocks (fill_gaps.py --restart, this VM). The
        # writer's C calls hold the GIL, so the table's pages are mapped first (the prefault
        # thread runs without it: a put that faults its pages in was a 52 ms gap) and the
        # keys go in runs of a few thousand.
        segment.prefault_wait()
        for slots in index.table.committed_runs(per_run=4096):
            locations.committed(slots)
        if tiering is not None:
            tiering.observe(locations)

    await off_loop(publish_held, "kvpool-index-publish")
    return segment


async def tick_forever(period: float, tick: Callable[[float, float], None]) -> None:
    """Call ``tick(now, stalled)`` every ``period`` (``stalled``: how much later than the period
    it came) until cancelled. A task that raises ends silently, and the daemon would serve on
    with no lease expiry, no release of silent clients and no health beat: a tick that raises
    is logged (at most every HOUSEKEEPING_ERROR_LOG_S) and the next ones keep trying."""
    last = time.monotonic()
    failed_logged = float("-inf")
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        stalled, last = now - last - period, now
        try:
            tick(now, stalled)
        except Exception:
            if now >= failed_logged + HOUSEKEEPING_ERROR_LOG_S:
                failed_logged = now
                log.exception("housekeeping tick failed (the next ones keep trying)")


def _open_trace(path: str):
    if not path:
        return None
    try:
        return open(path, "a", buffering=1)
    except OSError as e:
        raise ConfigError(f"trace: cannot open {path}: {e.strerror}") from None


def run(server: Server) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code (0 after a clean stop)."""
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop not installed: running on the default asyncio loop")
        asyncio.run(server.serve())
    else:
        uvloop.run(server.serve())
    return 0


def pool_info(server: "Server", now: float) -> p.PoolInfo:
    """What ``kvpool info`` and the metrics read: the server's parts, counted now."""
    writing, committed, used = server.index.slot_counts()
    st, table_stats, store_stats = server.index.stats, server.index.table.stats, \
        server.index.stores.stats
    seg = server.index_segment
    clients = [p.ClientInfo(o.id, o.role, o.name, o.pid, o.engine_id, len(o.registrations),
                            server.index.leases_of(o.id), o.jobs_in_flight)
               for o in server.registry.owners.values()]
    return p.PoolInfo(server.daemon_id, now - server.started, server.pool.nbytes, used,
                      server.pool.nbytes - used, writing, committed, len(server.index.namespaces),
                      st.hit_blocks, st.miss_blocks, table_stats.evictions,
                      server.index.lease_count, table_stats.stored_blocks, st.loaded_blocks,
                      server.jobs.stored_bytes, server.jobs.loaded_bytes, server.errors, clients,
                      table_stats.adopted_blocks,
                      slots_pinned=server.index.pinned_count(), hit_tokens=st.hit_tokens,
                      miss_tokens=st.miss_tokens,
                      namespace_usage=server.index.namespaces.usage(),
                      tiers=server.tiering.info() if server.tiering is not None else [],
                      slots_reserved=server.index.ticket_count,
                      duplicate_blocks=store_stats.duplicate_blocks,
                      no_room_blocks=store_stats.no_room_blocks,
                      index_segment=seg.name if seg is not None else "",
                      index_keys=len(seg) if seg is not None else 0,
                      index_unpublished=seg.unpublished if seg is not None else 0,
                      load_stale_blocks=st.stale_blocks,
                      load_failed_blocks=server.jobs.failed_load_blocks)

