"""``WorkerClient``: what one engine worker (one TP rank) uses to move its KV through kvpool.

Called from the worker's own thread (vLLM's model-runner thread). ``submit_*`` and ``poll`` never
wait on the daemon once connected; the only calls that wait (bounded by ``timeout_ms``) are
``register`` and the reconnect that a ``submit_*`` makes after the daemon came back.

Registrations get a local id that stays valid across daemon restarts: on reconnect the client
replays them and maps local ids to the new daemon's ids. Jobs in flight when the daemon vanished
or restarted complete with ``ok=False`` (code ABORTED), so the engine recomputes instead of
waiting forever.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import msgspec

from kvpool.client.transport import Transport
from kvpool.shared import protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import DaemonUnavailable, ErrorCode, KvpoolError, error_from_code
from kvpool.shared.layout import Layout, SegmentPlacement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobCompletion:
    job_id: int
    ok: bool
    code: int = 0
    message: str = ""
    nbytes: int = 0
    # A load's blocks that were not loaded (positions in the job): the engine recomputes them.
    failed: tuple[int, ...] = ()


@dataclass
class _Parts:
    """A job sent as several requests (``p.LEAD_BLOCKS``): what their answers add up to."""

    left: int
    code: int = 0                   # the first failure's, 0 while none failed
    message: str = ""
    nbytes: int = 0
    failed: list[int] = field(default_factory=list)


@dataclass
class _Registration:
    request: p.RegisterRequest       # req_id is refreshed on each (re)send
    daemon_id: int = 0


class WorkerClient:
    def __init__(self, config: ClientConfig, name: str = "", engine_id: str = "",
                 heartbeat: bool = True) -> None:
        self._t = Transport(config, p.Role.WORKER, name, engine_id, on_connect=self._replay,
                            heartbeat=heartbeat)
        self._registrations: dict[int, _Registration] = {}
        self._local_ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        self._in_flight: set[int] = set()
        # req_id of each request in flight -> (its job, the job's position of its first block)
        self._job_of_req: dict[int, tuple[int, int]] = {}
        self._parts: dict[int, _Parts] = {}      # jobs sent as several requests, not done
        self._done: list[JobCompletion] = []

    def register(self, namespace: bytes, layout: Layout, tp_rank: int, num_blocks: int,
                 regions: Sequence[p.Region], placement: Sequence[SegmentPlacement], *,
                 quota_bytes: int = 0) -> int:
        """Register this rank's KV memory; returns a local registration id.

        ``quota_bytes`` caps the namespace in the pool (0: none). Ranks of any TP size may
        register a head-split layout of one namespace (``kvpool.shared.layout``).

        Raises ``LayoutMismatch``/``OutOfRange``/``UnknownId`` for a registration the daemon
        refuses. A daemon that is not there raises nothing: the registration is kept and sent
        when the daemon appears (``is_registered`` says whether it has been).
        """
        local = next(self._local_ids)
        req = p.RegisterRequest(0, namespace, layout, tp_rank, num_blocks, list(regions),
                                list(placement), quota_bytes)
        self._registrations[local] = reg = _Registration(req)
        try:
            if self._t.is_connected and not self._t.is_stale:
                reg.daemon_id = self._send_registration(reg)
            else:
                self._t.ensure_connected()   # replays, including this one
        except DaemonUnavailable:
            log.warning("kvpoold unavailable: registration kept, sent when it is back")
        except Exception:
            del self._registrations[local]   # refused: forget it
            raise
        return local

    def is_registered(self, registration_id: int) -> bool:
        """Whether the daemon currently holds this registration."""
        reg = self._registrations.get(registration_id)
        return reg is not None and bool(reg.daemon_id) and self._t.is_connected

    def unregister(self, registration_id: int) -> None:
        reg = self._registrations.pop(registration_id, None)
        if reg is not None and reg.daemon_id and self._t.is_connected:
            self._t.call(lambda rid: p.UnregisterRequest(rid, reg.daemon_id))

    def submit_store(self, registration_id: int, block_ids: Sequence[int], slots: Sequence[int],
                     wait_event: bytes = b"", *, keys: Sequence[bytes] = (),
                     grant: str = "") -> int:
        """Copy ``block_ids`` into the slots that the tickets ``slots`` (from
        ``SchedulerClient.reserve``) bind to ``keys`` (one block hash per ticket); returns the
        job id (see ``poll``). ``grant`` is the daemon id that reserved them (see
        ``StoreRequest``)."""
        blocks, refs, hashes = list(block_ids), list(slots), list(keys)
        n = len(refs) if len(blocks) == len(hashes) == len(refs) else -1
        return self._submit(registration_id, n, lambda rid, job, reg, lo, hi: p.StoreRequest(
            rid, reg, job, blocks[lo:hi], refs[lo:hi], wait_event, hashes[lo:hi], grant))

    def submit_load(self, registration_id: int, slots: Sequence[int],
                    block_ids: Sequence[int], keys: Sequence[bytes] = ()) -> int:
        """Copy blocks into ``block_ids``: per block, the slot ref a lookup found (0: none)
        and, optionally, its block hash (a block whose ref went stale is then found by key,
        in the pool or a lower tier). Returns the job id (see ``poll``); blocks that could not
        be loaded are listed in the completion's ``failed``."""
        refs, blocks, hashes = list(slots), list(block_ids), list(keys)
        n = len(refs) if len(blocks) == len(refs) and len(hashes) in (0, len(refs)) else -1
        return self._submit(registration_id, n, lambda rid, job, reg, lo, hi: p.LoadRequest(
            rid, reg, job, refs[lo:hi], blocks[lo:hi], hashes[lo:hi]))

    def poll(self) -> list[JobCompletion]:
        """Completions that have arrived since the last call. Never blocks."""
        if self._t.is_stale:
            self._fail_in_flight("kvpoold vanished or restarted during the transfer")
            self._t.disconnect(backoff=False)
        elif self._in_flight and not self._t.is_connected:
            # The socket was dropped (a send found the daemon gone): no answer can come.
            self._fail_in_flight("kvpoold went away during the transfer")
        replies = self._t.drain()
        if self._t.connection_lost():
            # Replies already read still count; what is still in flight never will.
            self._collect(replies)
            self._fail_in_flight("kvpoold closed the connection during the transfer")
            self._t.disconnect(backoff=False)
            replies = []
        self._collect(replies)
        self._reconnect_nowait()
        out, self._done = self._done, []
        return out

    def _reconnect_nowait(self) -> None:
        """Register again once the connection was dropped (the daemon restarted, or released
        this worker), without waiting for the next submit: until a worker of the namespace is
        registered the daemon refuses the scheduler's reservations, so no submit would come.
        Never waits for an absent daemon (``connect_nowait``; the transport's backoff paces the
        tries); the registrations are replayed the moment the Hello is answered."""
        if not self._registrations or self._t.is_connected:
            return
        try:
            self._t.connect_nowait()
        except KvpoolError as e:     # absent, backing off, or refusing us: the next poll again
            log.debug("kvpool: worker not reconnected yet: %s", e)

    def _collect(self, replies: list[p.Reply]) -> None:
        for reply in replies:
            if isinstance(reply, p.JobDone) and reply.job_id in self._in_flight:
                _, first = self._job_of_req.pop(reply.req_id, (0, 0))
                self._answered(reply.job_id, reply.code, reply.message, reply.nbytes,
                               [first + k for k in reply.failed] if first else reply.failed)
            elif isinstance(reply, p.ErrorReply) and reply.req_id in self._job_of_req:
                # The request was refused before it became a job (say, HELLO_REQUIRED: the
                # daemon restarted or released us). Its job fails now, not at some timeout.
                job, _ = self._job_of_req.pop(reply.req_id)
                if job in self._in_flight:
                    self._answered(job, reply.code or int(ErrorCode.INTERNAL), reply.message)
                if reply.code == ErrorCode.HELLO_REQUIRED:
                    # Nothing else in flight on this connection will be answered either; the
                    # next submit reconnects and replays the registrations.
                    self._fail_in_flight(reply.message)
                    self._t.disconnect(backoff=False)

    def _answered(self, job: int, code: int, message: str, nbytes: int = 0,
                  failed: Sequence[int] = ()) -> None:
        """One request of ``job`` answered: its completion once every request of it is (the
        first failure's code and message; the blocks not loaded, as positions in the job)."""
        parts = self._parts.get(job)
        if parts is not None:
            parts.left -= 1
            parts.nbytes += nbytes
            parts.failed += failed
            if code and not parts.code:
                parts.code, parts.message = code, message
            if parts.left:
                return
            del self._parts[job]
            code, message, nbytes, failed = (parts.code, parts.message, parts.nbytes,
                                             sorted(parts.failed))
        self._in_flight.discard(job)
        self._done.append(JobCompletion(job, code == 0, code, message,
                                        nbytes if code == 0 else 0,
                                        tuple(failed) if code == 0 else ()))

    def wait(self, job_ids: Sequence[int], timeout_s: float, *,
             check: bool = False) -> list[JobCompletion]:
        """Completions of ``job_ids``, waiting at most ``timeout_s`` (for tools and tests);
        ``TimeoutError`` past it. With ``check``, a job that failed raises its error instead
        (the ``KvpoolError`` subclass of its code, saying which job and why)."""
        want = set(job_ids)
        got: dict[int, JobCompletion] = {}
        deadline = time.monotonic() + timeout_s
        while want - got.keys():
            for c in self.poll():
                if c.job_id in want:
                    got[c.job_id] = c
                else:
                    self._done.append(c)
            if not want - got.keys():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"jobs {sorted(want - got.keys())} not done in {timeout_s} s")
            # Block on the socket, waking at least every 50 ms to notice a vanished daemon.
            self._t.wait_readable(min(left, 0.05))
        out = [got[j] for j in job_ids]
        if check:
            for c in out:
                if not c.ok:
                    name = ErrorCode(c.code).name if c.code in ErrorCode._value2member_map_ \
                        else str(c.code)
                    raise error_from_code(c.code, f"kvpool job {c.job_id} failed ({name}): "
                                                  f"{c.message}")
        return out

    @property
    def jobs_in_flight(self) -> int:
        return len(self._in_flight)

    def close(self) -> None:
        self._t.close()

    # ---- internals -------------------------------------------------------------------------

    def _submit(self, registration_id: int, n: int, make) -> int:
        """Send ``make(req_id, job, daemon registration, lo, hi)``: blocks [lo, hi) of a job
        of ``n`` blocks; one request, or the lead and the rest (``p.LEAD_BLOCKS``) where
        ``n`` is big enough (-1: its lists disagree in length, sent whole, ``hi`` None, for the
        daemon to refuse). The job id is returned once its first request is sent: a later one that
        cannot go fails the job when its others are answered (they may be copying), it never
        makes this call raise."""
        reg = self._registrations.get(registration_id)
        if reg is None:
            raise KeyError(f"unknown local registration {registration_id}")
        if self._t.is_stale or not self._t.is_connected or self._t.connection_lost():
            self._fail_in_flight("kvpoold vanished or restarted during the transfer")
            self._t.disconnect(backoff=False)
        self._t.ensure_connected()
        job = next(self._job_ids)
        split = p.SPLIT_MIN_BLOCKS <= n <= p.MAX_BLOCKS_PER_REQUEST
        lead = p.LEAD_BLOCKS if split else None
        # (connected just now: ``send`` would read the monitor socket a third time)
        req_id = self._t.send_connected(lambda rid: make(rid, job, reg.daemon_id, 0, lead))
        self._in_flight.add(job)
        self._job_of_req[req_id] = (job, 0)
        if split:
            self._parts[job] = _Parts(2)
            try:
                req_id = self._t.send_connected(
                    lambda rid: make(rid, job, reg.daemon_id, p.LEAD_BLOCKS, n))
            except DaemonUnavailable as e:
                self._answered(job, int(ErrorCode.ABORTED), f"part of the job not sent: {e}")
            else:
                self._job_of_req[req_id] = (job, p.LEAD_BLOCKS)
        return job

    def _send_registration(self, reg: _Registration) -> int:
        reply = self._t.call(lambda rid: _with_req_id(reg.request, rid))
        assert isinstance(reply, p.RegisterReply)
        return reply.registration_id

    def _replay(self) -> None:
        # Runs inside ensure_connected, right after Hello: the new daemon (or connection)
        # knows none of our registrations.
        self._fail_in_flight("kvpoold restarted during the transfer")
        for reg in self._registrations.values():
            reg.daemon_id = self._send_registration(reg)

    def _fail_in_flight(self, why: str) -> None:
        for job in self._in_flight:
            self._done.append(JobCompletion(job, False, int(ErrorCode.ABORTED), why))
        self._in_flight.clear()
        self._job_of_req.clear()
        self._parts.clear()


def _with_req_id(req: p.RegisterRequest, req_id: int) -> p.RegisterRequest:
    return msgspec.structs.replace(req, req_id=req_id)
