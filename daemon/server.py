"""kvpoold's server: the ROUTER socket, dispatch, jobs, housekeeping and the lifecycle.

``Server.serve()`` reads top to bottom: ``startup()`` (bind, signals) → ``main_loop()`` (receive,
dispatch, reply) beside ``housekeeping()`` (heartbeat timeouts, lease/write expiry) → ``shutdown()``
(stop accepting, let jobs finish for a grace period, abort the rest, drop leases, close engines,
unlink or keep the pool).

With tiers under the pool (``--disk-path``, ``--remote-store``), ``daemon/tiering.py`` is asked
before each lookup (lower-tier hits come up into the pool; a lookup that a remote store must be
asked about is answered when it has answered, within its tier's deadline, while the loop serves
everyone else) and when a load starts (a load of a block still coming up waits for it); the
tiers' I/O runs on their own threads.

Rules: the event loop never blocks (copies run in the engines, off the loop); every request gets
exactly one reply; every exception is turned into an ``ErrorReply`` (or a failed ``JobDone``) in
``_dispatch``, unexpected ones as INTERNAL with a logged traceback, and the peer stays connected.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from functools import partial
import fcntl
import logging
import os
import select
import signal
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import zmq

from kvpool.daemon.copy_engine import CopyEngine, JobResult
from kvpool.daemon.index import Index, Slot
from kvpool.daemon.peer import AllowList, Peer
from kvpool.daemon.pool import Pool
from kvpool.daemon.registry import Owner, Registration, Registry
from kvpool.daemon.shm_reaper import reap_engine_segments
from kvpool.daemon.telemetry import Telemetry
from kvpool.daemon.tier import LowerTier
from kvpool.daemon.tiering import Tiering
from kvpool.shared import protocol as p
from kvpool.shared.config import DaemonConfig, parse_size
from kvpool.shared.errors import (Aborted, BlockLost, ErrorCode, HelloRequired, KvpoolError,
                                  OutOfRange, PermissionDenied, ProtocolError, TooLarge,
                                  UnknownId, VersionMismatch)

log = logging.getLogger("kvpoold")

SHUTDOWN_GRACE_S = 5.0
# Registrations one client may hold at once (re-registering a namespace and rank replaces, and
# does not count). A vLLM worker holds one per KV-cache group; each one maps memory and may own
# a copy thread, so a client must not be able to open them without end.
MAX_REGISTRATIONS_PER_CLIENT = 64
# Blocks one store, load or prepare_store request may name (a vLLM step names a few thousand).
MAX_BLOCKS_PER_REQUEST = 65536
_SEND_MORE = zmq.NOBLOCK | zmq.SNDMORE
# How often abandoned engine KV segments are looked for besides start and client release.
REAP_PERIOD_S = 10.0
# A housekeeping tick this late means the daemon itself was stopped (see _housekeeping).
STALL_S = 0.5


class SocketBusy(KvpoolError):
    """Another live daemon serves this socket path."""


class Server:
    def __init__(self, config: DaemonConfig, pool: Pool, engines: dict[type, CopyEngine],
                 lowers: list[LowerTier] | None = None) -> None:
        self.config = config
        self.pool = pool
        self.engines = engines
        self.index = Index(pool, config.lease_ttl_s, config.write_timeout_s,
                           parse_size(config.namespace_quota), config.reservation_ttl_s)
        self.registry = Registry()
        self.daemon_id = uuid.uuid4().hex[:16]
        self.started = time.monotonic()
        self.errors = 0
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.should_exit = asyncio.Event()
        self.is_serving = False
        self._jobs: set[asyncio.Future] = set()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._lock_fd: int | None = None
        self._in_drain = False
        self.allow = AllowList(config.allow_uid, config.allow_gid)
        # pid -> pidfd and the owners of that process: readable when the process exits.
        self._exits: dict[int, tuple[int, set[int]]] = {}
        # Replaced by Telemetry.start() in _startup; hooks are safe to call before that.
        self.telemetry = Telemetry.disabled()
        # One line per job with the monotonic ns of each hop (latency breakdowns)
        self._trace = open(config.trace, "a", buffering=1) if config.trace else None
        if pool.adopted:
            kept = self.index.adopt()
            log.info("adopted %d committed blocks from the existing pool", kept)
        self.tiering = Tiering(self.index, lowers) if lowers else None

    # ---- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            self._startup()
        except BaseException:
            self._release_resources()
            raise
        try:
            housekeeping = asyncio.create_task(self._housekeeping())
            await self._main_loop()
            housekeeping.cancel()
        finally:
            await self._shutdown()

    def _startup(self) -> None:
        path = Path(self.config.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        # One daemon per socket: libzmq would silently take over a live daemon's socket file.
        self._lock_fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SocketBusy(f"another daemon is serving {path}") from None
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # replies to vanished peers are dropped
        # A hard cap well above the soft limit: frames between the two get a TOO_LARGE reply,
        # beyond it libzmq drops the connection rather than buffer them.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.config.max_request_bytes)
        old = os.umask(0o777 ^ self.config.socket_mode_bits)
        try:
            sock.bind(f"ipc://{path}")
        finally:
            os.umask(old)
        os.chmod(path, self.config.socket_mode_bits)
        self._sock = sock
        # After the socket lock: only the one daemon of this host sweeps.
        reap_engine_segments()
        # After the socket lock, so a second daemon reports "socket busy", not a busy port.
        self.telemetry = Telemetry.start(self.config)
        self.index.events = self.telemetry.index_events
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.should_exit.set)
        if self.tiering is not None:
            self.tiering.start()
        self.is_serving = True
        for engine in self.engines.values():
            engine.start()
        self.telemetry.serving(self.info())
        log.info("kvpoold %s serving ipc://%s, pool %s: %d bytes in %d extents%s", self.daemon_id,
                 path, self.pool.name, self.pool.nbytes, self.pool.geometry.num_extents,
                 " (adopted)" if self.pool.adopted else "")

    async def _main_loop(self) -> None:
        # A plain socket drained from the loop's reader callback: no future per message.
        # ZeroMQ's FD is edge-triggered, so every wake-up drains until EAGAIN, and sends made
        # outside the callback schedule one more drain (a send can consume the edge).
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
        # Receive until EAGAIN (which also takes in the socket's pending commands, re-arming
        # its FD): one libzmq call per frame and no ZMQ_EVENTS/RCVMORE look-ups per message.
        # A request is [identity, body]; the body stays a Frame: it carries its connection's
        # kernel credentials.
        recv = sock.recv
        try:
            while True:
                try:
                    identity = recv(zmq.NOBLOCK)
                    body = recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
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
        period = min(0.1, self.config.peer_timeout_ms / 4000)
        next_reap = time.monotonic() + REAP_PERIOD_S
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            stalled = now - last - period
            if stalled > STALL_S:
                # This daemon did not run (SIGSTOP, a paused VM, swapped out): its clients'
                # heartbeats wait unread in the socket, so that part of their silence is
                # ours and does not count (an exited client still goes at once, by pidfd).
                log.warning("kvpoold did not run for %.1f s: not counted as its clients' "
                            "silence", stalled)
                for owner in self.registry.owners.values():
                    owner.last_seen += stalled
            last = now
            if now >= next_reap:
                # Engines that died while no client of theirs was connected (or before the
                # daemon started) have their KV segments removed here.
                reap_engine_segments()
                next_reap = now + REAP_PERIOD_S
            self.index.expire(now)
            self.telemetry.tick(now, self.info)
            limit = now - self.config.peer_timeout_ms / 1000
            for owner in [o for o in self.registry.owners.values() if o.last_seen < limit]:
                log.info("client %d (%r, pid %d) went silent: releasing what it held",
                         owner.id, owner.name, owner.pid)
                self._release_owner(owner)

    async def _shutdown(self) -> None:
        log.info("shutting down: %d jobs in flight", len(self._jobs))
        self.is_serving = False
        self.telemetry.stopping()
        for engine in set(self.engines.values()):
            engine.close()
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=SHUTDOWN_GRACE_S)
        for owner in list(self.registry.owners.values()):
            self._release_owner(owner)
        if self.tiering is not None:
            # Before the pool goes: the tier reads pool memory until it closes.
            await self.tiering.close(SHUTDOWN_GRACE_S)
        self._release_resources()
        if self._trace:
            self._trace.close()
        log.info("kvpoold stopped%s", "; pool kept for the next start" if self.config.keep_pool
                 else "")

    def _release_resources(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        if self._ctx is not None:
            self._ctx.term()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        for fd, _ in self._exits.values():
            os.close(fd)
        self._exits.clear()
        self.pool.close(unlink=not self.config.keep_pool)
        self.telemetry.close(pool_kept=self.config.keep_pool)

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
        except KvpoolError as e:
            self.errors += 1
            self.telemetry.error(e.code)
            reply = p.ErrorReply(req_id, int(e.code), e.message)
        except Exception as e:   # a bug of ours: say so, keep serving
            self.errors += 1
            self.telemetry.error(ErrorCode.INTERNAL)
            log.exception("internal error handling a request")
            reply = p.ErrorReply(req_id, int(ErrorCode.INTERNAL), f"internal error: {e!r}")
        if reply is not None:
            self._send(identity, reply)

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
        if not self._in_drain:
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
            case p.PrepareStoreRequest():
                _check_count(len(msg.keys), "keys")
                return p.PrepareStoreReply(msg.req_id,
                                           idx.prepare_store(msg.namespace, msg.keys, owner.id, now))
            case p.ReserveRequest():
                _check_count(msg.count, "slots")
                return p.ReserveReply(msg.req_id, idx.reserve(msg.namespace, msg.count, owner.id,
                                                              now),
                                      int(self.config.reservation_ttl_s * 1000), self.daemon_id)
            case p.AbortStoreRequest():
                return p.OkReply(msg.req_id, idx.abort_store(msg.slots, owner.id))
            case p.ReleaseRequest():
                return p.OkReply(msg.req_id, idx.release_leases(msg.leases, owner.id))
            case p.StoreRequest() | p.LoadRequest():
                return self._start_job(owner, msg)
            case p.RegisterRequest():
                return self._register(owner, msg)
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
                self._check_may_reset(owner, msg.namespace)
                n = idx.reset(msg.namespace)
                if self.tiering is not None:
                    n += self.tiering.reset(msg.namespace)
                log.info("reset of namespace %s by client %d: %d blocks forgotten",
                         msg.namespace.hex(), owner.id, n)
                return p.OkReply(msg.req_id, n)
        raise ProtocolError(f"unexpected message {type(msg).__name__}")

    def _lookup(self, owner: Owner, msg: p.LookupRequest, now: float) -> p.LookupReply:
        idx = self.index
        if self.tiering is not None:
            self.tiering.before_lookup(msg.namespace, msg.key_lists, now)
        hits, leases, slots = idx.lookup(msg.namespace, msg.key_lists, msg.pin, owner.id, now)
        self.telemetry.lookup(hits, msg.key_lists, idx.block_tokens(msg.namespace))
        return p.LookupReply(msg.req_id, hits, leases, slots)

    def _lookup_later(self, identity: bytes, owner: Owner, msg: p.LookupRequest) -> None:
        """Answer a lookup whose probe of a lower tier has resolved, unless its client left
        meanwhile (its leases would only wait for their TTL)."""
        if not self.is_serving or self.registry.by_identity.get(identity) is not owner:
            return
        try:
            reply: p.Reply = self._lookup(owner, msg, time.monotonic())
        except KvpoolError as e:
            self.errors += 1
            self.telemetry.error(e.code)
            reply = p.ErrorReply(msg.req_id, int(e.code), e.message)
        except Exception as e:   # a bug of ours: say so, keep serving
            self.errors += 1
            self.telemetry.error(ErrorCode.INTERNAL)
            log.exception("internal error answering a lookup")
            reply = p.ErrorReply(msg.req_id, int(ErrorCode.INTERNAL), f"internal error: {e!r}")
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
        self._watch_exit(owner)
        log.info("client %d connected: %r role=%s pid=%d engine=%r", owner.id, msg.name,
                 msg.role.name, msg.pid, msg.engine_id)
        return p.HelloReply(msg.req_id, p.PROTOCOL_VERSION, self.daemon_id, owner.id,
                            self.pool.nbytes, self.config.heartbeat_interval_ms,
                            self.config.max_request_bytes)

    def _register(self, owner: Owner, msg: p.RegisterRequest) -> p.Reply:
        msg.layout.check()
        if not msg.regions:
            raise ProtocolError("a registration needs at least one region")
        old = self.registry.find_registration(owner, msg.namespace, msg.tp_rank)
        if old is None and len(owner.registrations) >= MAX_REGISTRATIONS_PER_CLIENT:
            raise TooLarge(f"this client already holds {len(owner.registrations)} registrations "
                           f"(at most {MAX_REGISTRATIONS_PER_CLIENT}): unregister some first")
        kinds = {type(r) for r in msg.regions}
        engine = self.engines.get(kinds.pop()) if len(kinds) == 1 else None
        if engine is None:
            raise ProtocolError(f"no copy engine for {sorted(t.__name__ for t in {type(r) for r in msg.regions})}"
                                f" in this daemon (CUDA regions need a daemon started with CUDA)")
        if not 0 <= msg.tp_rank < msg.layout.tp_size:
            raise OutOfRange(f"tp_rank {msg.tp_rank} outside tp_size {msg.layout.tp_size}")
        # Any TP size may join a head-split namespace: each rank moves its own heads.
        self.index.register_namespace(msg.namespace, msg.layout, msg.quota_bytes)
        mapped = engine.attach(msg, owner.peer)
        # Before closing the one it replaces, so the engine's event feed sees no removal.
        self.telemetry.registration_added(owner.engine_id, owner.pid, msg.namespace,
                                          msg.layout.block_tokens,
                                          lambda: self.index.committed_hashes(msg.namespace))
        if old is not None:   # re-registration replaces: engines re-register after restarts
            self._close_registration(self.registry.close_registration(old.id))
        reg = self.registry.add_registration(owner, msg.namespace, msg.layout, msg.tp_rank,
                                             msg.num_blocks, engine, mapped)
        lay = msg.layout
        heads = ""
        if lay.kv_heads:
            h0, h1 = lay.head_range(msg.tp_rank)
            heads = (f", KV heads [{h0}, {h1}) of {lay.kv_heads}"
                     f"{'' if lay.is_primary(msg.tp_rank) else ' (replica: loads only)'}")
        log.info("client %d registered rank %d/%d of namespace %s: %d blocks%s", owner.id,
                 msg.tp_rank, lay.tp_size, msg.namespace.hex(), msg.num_blocks, heads)
        return p.RegisterReply(msg.req_id, reg.id)

    # ---- jobs ------------------------------------------------------------------------------

    def _start_job(self, owner: Owner, msg: p.StoreRequest | p.LoadRequest) -> p.Reply | None:
        t_recv = time.monotonic_ns() if self._trace else 0
        is_store = isinstance(msg, p.StoreRequest)
        started = time.monotonic()
        try:
            reg = self.registry.registration(owner, msg.registration_id)
            if len(msg.block_ids) != len(msg.slots):
                raise ProtocolError(f"{len(msg.block_ids)} block ids for {len(msg.slots)} slots")
            _check_count(len(msg.slots), "blocks")
            blocks = _block_ids(msg.block_ids, reg.num_blocks)
            if is_store and not reg.mask:
                # A replica of heads that another rank of its engine stores: nothing to copy,
                # and the slot commits (or not) on that rank's store alone.
                return p.JobDone(msg.req_id, msg.job_id, 0, "", 0)
            # Checked now; what can wait (the pins, a store's bindings) is ``finish``, done
            # once the copy has gone out (a big job's first chunk is copying by then).
            if is_store:
                job = self.index.open_store(reg.namespace, msg.slots, reg.tp_rank, reg.mask,
                                            keys=self._store_keys(msg), now=started)
                slots, finish, has_voids = job.slots, job.finish, job.has_voids
            else:
                slots = self.index.check_load(reg.namespace, msg.slots)
                finish, has_voids = partial(self.index.pin, slots), False
        except KvpoolError as e:
            self.errors += 1
            self.telemetry.error(e.code)
            return p.JobDone(msg.req_id, msg.job_id, int(e.code), e.message)
        offsets = np.fromiter((s.offset for s in slots), np.int64, len(slots))
        landing = _Landing(slots) if is_store else None
        if has_voids:
            # Duplicates (keys someone else holds) are bound but written by nobody.
            keep = np.fromiter((not s.void for s in slots), bool, len(slots))
            blocks, offsets = blocks[keep], offsets[keep]
            landing = _Landing(slots, keep)
        try:
            if is_store and not len(blocks):
                fut: Future[JobResult] = Future()
                fut.set_result(JobResult(0))
            elif is_store:
                fut = reg.engine.submit_store(reg.mapped, blocks, offsets, msg.wait_event,
                                              self._progress(reg, landing))
            else:
                fills = self.tiering.pending(slots) if self.tiering is not None else []
                if fills:
                    fut = self._load_after_fills(fills, slots, lambda: reg.engine.submit_load(
                        reg.mapped, offsets, blocks))
                else:
                    fut = reg.engine.submit_load(reg.mapped, offsets, blocks)
        except BaseException as e:
            # The job's slots go back whatever went wrong: a store's tickets have slots by now
            # (open_store allocated them), which only its end frees.
            if finish is not None:
                finish()       # so that the job's end finds it as begin_store leaves it
            self._end_job(reg, slots, is_store, ok=False, landing=landing)
            if not isinstance(e, KvpoolError):
                raise
            self.errors += 1
            self.telemetry.error(e.code)
            self.telemetry.job_done(is_store, 0, started, len(slots), ok=False)
            return p.JobDone(msg.req_id, msg.job_id, int(e.code), e.message)
        if finish is not None:
            # The copy is on its way: the pins and bindings run beside it, before the loop
            # turns (so before any chunk commits or the job ends, and before another request
            # can evict, reuse or see the slots).
            finish()
        reg.jobs_in_flight += 1
        owner.jobs_in_flight += 1
        t_sub = time.monotonic_ns() if self._trace else 0
        if fut.done():
            # Done already (a small host copy run inline, an empty store, a refusal): the
            # JobDone goes out now, in this dispatch, with no loop turn and no wake-up.
            self._job_done(None, owner, reg, slots, is_store, msg, fut, started, t_recv, t_sub,
                           landing)
            return None
        # The engine's future resolves on its thread; one call_soon_threadsafe brings the
        # completion to the loop (asyncio.wrap_future would take two loop turns).
        loop = asyncio.get_running_loop()
        job = loop.create_future()
        self._jobs.add(job)

        def resolved(f) -> None:
            try:
                loop.call_soon_threadsafe(self._job_done, job, owner, reg, slots, is_store, msg,
                                          f, started, t_recv, t_sub, landing)
            except RuntimeError:   # the loop has closed: the daemon is gone
                pass
        fut.add_done_callback(resolved)
        return None

    def _store_keys(self, msg: p.StoreRequest) -> list[bytes] | None:
        """The store's keys, checked (None: every slot was bound by prepare_store)."""
        if msg.grant and msg.grant != self.daemon_id:
            raise UnknownId(f"these slot refs were granted by daemon {msg.grant}, this is daemon "
                            f"{self.daemon_id} (it restarted): reserve again")
        if not msg.keys:
            return None
        if len(msg.keys) != len(msg.slots):
            raise ProtocolError(f"{len(msg.keys)} keys for {len(msg.slots)} slots")
        # (Each key's length was checked as the frame was decoded: ``p.Key``.)
        return msg.keys

    def _load_after_fills(self, fills: list[asyncio.Future], slots: list[Slot],
                          submit) -> Future[JobResult]:
        """A load of slots a lower tier is still filling: handed to the copy engine once every
        fill has landed, so the job completes only when the bytes are in the engine's memory;
        fails with ``BlockLost`` where a fill did not land (checksum or I/O failure)."""
        out: Future[JobResult] = Future()

        def relay(f: Future) -> None:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result())

        def go(_gathered: asyncio.Future) -> None:
            if not self.index.is_loadable(slots):
                out.set_exception(BlockLost("a block could not be brought back from the disk "
                                            "tier (it failed verification, or the tier failed)"
                                            ": recompute it"))
                return
            try:
                submit().add_done_callback(relay)
            except KvpoolError as e:
                out.set_exception(e)

        asyncio.gather(*fills, return_exceptions=True).add_done_callback(go)
        return out

    def _progress(self, reg: Registration, landing: "_Landing"):
        """What a store job's engine calls, on its thread, as leading chunks land: their
        slots are committed on the loop (``_landed``) while the rest still copies, so the
        job's end has only its last chunk left to commit before the reply."""
        loop = asyncio.get_running_loop()

        def landed(n: int) -> None:
            try:
                loop.call_soon_threadsafe(self._landed, reg, landing, n)
            except RuntimeError:   # the loop has closed: the daemon is gone
                pass
        return landed

    def _landed(self, reg: Registration, landing: "_Landing", n: int) -> None:
        # A job whose worker has gone commits nothing more: its end drops what is left.
        if reg.closing:
            return
        chunk = landing.take(n)
        if chunk:
            self.index.end_store(chunk, reg.tp_rank, True, reg.mask)

    def _job_done(self, job: asyncio.Future | None, owner: Owner, reg: Registration,
                  slots: list[Slot], is_store: bool, msg: p.StoreRequest | p.LoadRequest, fut,
                  started: float, t_recv: int = 0, t_sub: int = 0,
                  landing: "_Landing | None" = None) -> None:
        """A job's end, on the loop: index, counters, its JobDone. ``job`` is what shutdown
        waits on (None for a job that was done when submitted)."""
        t_cb = time.monotonic_ns() if self._trace else 0
        if job is not None:
            if not job.done():
                job.set_result(None)
            self._jobs.discard(job)
        reg.jobs_in_flight -= 1
        owner.jobs_in_flight -= 1
        exc = fut.exception() if not fut.cancelled() else Aborted("job cancelled")
        # A job whose worker has gone is void even if its bytes landed: nobody will finish the
        # slot's other ranks or read the load.
        if exc is None and reg.closing:
            exc = Aborted("worker disconnected during the transfer")
        ok = exc is None
        # A store's slots commit before its reply goes: the worker's engine may look its blocks
        # up the moment it reads it. What no client can tell from the reply comes after the
        # send, in this same callback (so before any other request is served): a load's unpins
        # (~50 us for 1024 slots on a 2-core host) and the metrics.
        if is_store:
            self._end_job(reg, slots, is_store, ok, landing)
        nbytes = fut.result().nbytes if ok else 0
        if ok:
            reply = p.JobDone(msg.req_id, msg.job_id, 0, "", nbytes)
        else:
            code = exc.code if isinstance(exc, KvpoolError) else ErrorCode.INTERNAL
            reply = p.JobDone(msg.req_id, msg.job_id, int(code), str(exc))
        # Every request gets its one reply while its client is connected, also when the job's
        # registration was closed under it (unregistered or replaced): the worker waits for it.
        try:
            if self.registry.by_identity.get(owner.identity) is owner:
                self._send(owner.identity, reply)
        finally:
            t_sent = time.monotonic_ns() if self._trace else 0
            if not is_store:
                self._end_job(reg, slots, is_store, ok, landing)
        if ok:
            if is_store:
                self.stored_bytes += nbytes
            else:
                self.loaded_bytes += nbytes
        else:
            self.errors += 1
            if not isinstance(exc, KvpoolError):
                log.error("copy job failed", exc_info=exc)
            self.telemetry.error(code)
        self.telemetry.job_done(is_store, nbytes, started, len(slots), ok=ok)
        if reg.closing and reg.jobs_in_flight == 0:
            self._detach(reg)
        if self._trace:
            # owner job store|load blocks backend recv submitted engine-stamps... callback sent
            # ("sent": the reply handed to the socket; a load's unpins come after it)
            eng = (getattr(fut, "kvpool_trace", None) or []) + [0, 0, 0, 0]
            self._trace.write(" ".join(map(str, [
                owner.id, msg.job_id, "store" if is_store else "load", len(slots),
                t_recv, t_sub, *eng[1:4], t_cb, t_sent])) + "\n")

    def _end_job(self, reg: Registration, slots: list[Slot], is_store: bool, ok: bool,
                 landing: "_Landing | None" = None) -> None:
        if is_store:
            rest = landing.rest() if landing is not None else slots
            self.index.end_store(rest, reg.tp_rank, ok, reg.mask)
        else:
            self.index.end_load(slots, ok)

    # ---- releasing -------------------------------------------------------------------------

    def _release_owner(self, owner: Owner) -> None:
        self._unwatch_exit(owner)
        regs = self.registry.remove_owner(owner)
        for reg in regs:
            self._close_registration(reg)
        self.index.release_owner(owner.id)
        if regs and self.is_serving:
            reap_engine_segments()   # a dead worker's KV segment goes with it

    def _watch_exit(self, owner: Owner) -> None:
        """Release ``owner`` the moment its process exits, however it exits (a pidfd turns
        readable then), rather than after ``peer_timeout_ms`` of silence. The pid comes from
        the kernel (SO_PEERCRED); a peer in a PID namespace we cannot see has none, and only
        the heartbeat timeout covers it."""
        pid = owner.peer.pid if owner.peer is not None else 0
        if pid <= 0 or not hasattr(os, "pidfd_open"):
            return
        watch = self._exits.get(pid)
        if watch is not None and _readable(watch[0]):
            self._process_exited(pid)      # that process is gone; this pid is a new one
            watch = None
        if watch is None:
            try:
                fd = os.pidfd_open(pid)
            except OSError:                # exited already, or not ours to see
                return
            watch = self._exits[pid] = (fd, set())
            asyncio.get_running_loop().add_reader(fd, self._process_exited, pid)
        watch[1].add(owner.id)

    def _unwatch_exit(self, owner: Owner) -> None:
        pid = owner.peer.pid if owner.peer is not None else 0
        watch = self._exits.get(pid)
        if watch is not None:
            watch[1].discard(owner.id)
            if not watch[1]:
                self._close_exit_watch(pid)

    def _close_exit_watch(self, pid: int) -> None:
        fd, _ = self._exits.pop(pid)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _process_exited(self, pid: int) -> None:
        watch = self._exits.get(pid)
        if watch is None:
            return
        owners = [self.registry.owners[o] for o in watch[1] if o in self.registry.owners]
        self._close_exit_watch(pid)
        for owner in owners:
            log.info("client %d (%r, pid %d) exited: releasing what it held", owner.id,
                     owner.name, pid)
            self._release_owner(owner)

    def _check_may_reset(self, owner: Owner, ns: bytes) -> None:
        """A reset drops every block of a namespace, so it is for that namespace's engines: a
        client whose user has a live registration in it, the daemon's user, or root."""
        peer = owner.peer
        if peer is None or peer.uid in (0, os.geteuid()):
            return
        if any(r.namespace == ns and r.owner.peer is not None and r.owner.peer.uid == peer.uid
               for r in self.registry.registrations.values()):
            return
        raise PermissionDenied(f"uid {peer.uid} has no registration in namespace {ns.hex()}: "
                               f"only its own engines may reset it")

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
        now = time.monotonic() if now is None else now
        writing, committed, used = self.index.slot_counts()
        st = self.index.stats
        clients = [p.ClientInfo(o.id, o.role, o.name, o.pid, o.engine_id, len(o.registrations),
                                self.index.leases_of(o.id), o.jobs_in_flight)
                   for o in self.registry.owners.values()]
        return p.PoolInfo(self.daemon_id, now - self.started, self.pool.nbytes, used,
                          self.pool.nbytes - used, writing, committed, self.index.namespaces,
                          st.hit_blocks, st.miss_blocks, st.evictions, self.index.lease_count,
                          st.stored_blocks, st.loaded_blocks, self.stored_bytes,
                          self.loaded_bytes, self.errors, clients, st.adopted_blocks,
                          slots_pinned=self.index.pinned_count(), hit_tokens=st.hit_tokens,
                          miss_tokens=st.miss_tokens,
                          namespace_usage=self.index.namespace_usage(),
                          tiers=self.tiering.info() if self.tiering is not None else [],
                          slots_reserved=self.index.ticket_count,
                          duplicate_blocks=st.duplicate_blocks,
                          no_room_blocks=st.no_room_blocks)


class _Landing:
    """A store job's slots on their way to the index's ``end_store``: those the engine copies,
    in the order it was given them (chunks land as leading runs of it), and the void ones it
    skips (ended with the job). Each slot is ended exactly once: a landed chunk by ``take``,
    everything else by ``rest`` at the job's end."""

    __slots__ = ("copied", "voids", "ended")

    def __init__(self, slots: list[Slot], keep: np.ndarray | None = None) -> None:
        if keep is None:
            self.copied, self.voids = slots, []
        else:
            flags = keep.tolist()
            self.copied = [s for s, k in zip(slots, flags) if k]
            self.voids = [s for s, k in zip(slots, flags) if not k]
        self.ended = 0

    def take(self, n: int) -> list[Slot]:
        """The copied slots up to the ``n``-th not ended yet (a chunk that landed)."""
        if n <= self.ended:
            return []
        chunk = self.copied[self.ended:n]
        self.ended = n
        return chunk

    def rest(self) -> list[Slot]:
        """Every slot not ended yet; after this, none is left."""
        rest = self.copied[self.ended:] + self.voids
        self.ended = len(self.copied)
        self.voids = []
        return rest


def _block_ids(ids: list[int], num_blocks: int) -> np.ndarray:
    """A job's block ids as int64, each in [0, ``num_blocks``), else ``OutOfRange``. A few are
    checked on the list (numpy's min and max cost ~5 us even for one id; Python's ~30 us for
    1024), which also turns away ids too big for int64 before the array is made."""
    blocks = None
    if len(ids) <= 32:
        lo, hi = (min(ids), max(ids)) if ids else (0, -1)
    else:
        try:
            blocks = np.asarray(ids, dtype=np.int64)
        except OverflowError:
            raise OutOfRange(f"block ids must be in [0, {num_blocks}); one does not even fit "
                             f"64 bits") from None
        lo, hi = int(blocks.min()), int(blocks.max())
    if lo < 0 or hi >= num_blocks:
        raise OutOfRange(f"block ids must be in [0, {num_blocks}); got [{lo}, {hi}]")
    return np.array(ids, dtype=np.int64) if blocks is None else blocks


def _check_count(n: int, what: str) -> None:
    """Bound the work one request does on the event loop: a prepare of a whole 16 MiB frame of
    keys held every other client for over a second (measured on a 2-core host)."""
    if n > MAX_BLOCKS_PER_REQUEST:
        raise TooLarge(f"{n} {what} in one request; at most {MAX_BLOCKS_PER_REQUEST}: split it")


def _readable(fd: int) -> bool:
    """Whether ``fd`` is readable now (poll, not select: daemon fds pass 1024 with many
    clients)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def run(config: DaemonConfig, pool: Pool, engines: dict[type, CopyEngine],
        lowers: list[LowerTier] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code (0 after a clean stop)."""
    server = Server(config, pool, engines, lowers)
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop not installed: running on the default asyncio loop")
        asyncio.run(server.serve())
    else:
        uvloop.run(server.serve())
    return 0
