"""Store and load jobs, from the request to its ``JobDone``: checked against the registration
and the index, handed to the registration's copy engine (after any lower-tier fill a load
waits for), a store's leading chunks committed as they land, and the end on the loop (the
index, the byte counters, the one reply, the trace line).

A big store goes to its engine with its head's offsets alone where the store path allows it
(``StorePath.open_store``'s ``head``); the rest are written in the same dispatch, after the
submit, while the head copies (``_finish_late``).

Every job ends exactly once, also when it fails before its copy starts or its worker leaves
during the copy: a store's slots are ended by ``Landing`` (chunk by chunk, then the rest), a
load's pins are dropped after its reply. ``in_flight`` is what the server's shutdown waits on.

A store that would evict blocks a lower tier has yet to write waits here first (``_held``, in
arrival order, see ``Tiering.must_hold``), and starts when the tiers' writes have made room or
its hold ran out; it is checked again as it starts, so a worker gone meanwhile gets nothing
copied.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np

from kvpool.daemon.copy_engine import JobResult, LateOffsets
from kvpool.daemon.index import Index, OpenedStore, Slot
from kvpool.daemon.loads import Loads
from kvpool.daemon.registry import Owner, Registration, Registry
from kvpool.daemon.telemetry import Telemetry
from kvpool.daemon.tiering import STORE_HOLD_S, Tiering
from kvpool.daemon.replies import job_failed
from kvpool.shared import protocol as p
from kvpool.shared.errors import (Aborted, KvpoolError, OutOfRange,
                                  ProtocolError, TooLarge, UnknownId)
from kvpool.shared.protocol import MAX_BLOCKS_PER_REQUEST

log = logging.getLogger("kvpoold")


class CopyJobs:
    def __init__(self, index: Index, registry: Registry, tiering: Tiering | None, daemon_id: str,
                 telemetry: Telemetry, send: Callable[[bytes, p.Reply], None],
                 detach: Callable[[Registration], None], count_error: Callable[[int], None],
                 trace: TextIO | None = None) -> None:
        self.index = index
        self.registry = registry
        self.tiering = tiering
        self.daemon_id = daemon_id
        self.send = send
        self.detach = detach
        self.count_error = count_error
        # One line per job with the monotonic ns of each hop (latency breakdowns).
        self.trace = trace
        self.telemetry = telemetry
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.in_flight: set[asyncio.Future] = set()
        # Stores waiting for the lower tiers: (owner, request, monotonic deadline).
        self._held: deque[tuple[Owner, p.StoreRequest, float]] = deque()
        self._hold_timer: asyncio.TimerHandle | None = None
        self.held_jobs = 0            # stores that waited, since start
        self.loads = Loads(index, tiering)
        self.failed_load_blocks = 0   # blocks of load jobs that were not loaded, since start
        self._refusal: BaseException | None = None
        if tiering is not None:
            tiering.when_progress(self.start_held)

    def start(self, owner: Owner, msg: p.StoreRequest | p.LoadRequest) -> p.Reply | None:
        if isinstance(msg, p.StoreRequest) and self.tiering is not None and self._must_hold(msg):
            self._held.append((owner, msg, time.monotonic() + STORE_HOLD_S))
            self.held_jobs += 1
            self._arm_hold_timer()
            return None
        return self._start(owner, msg)

    def _must_hold(self, msg: p.StoreRequest) -> bool:
        """Whether this store binds tickets to new slots (a first rank's) and would evict
        blocks the tiers have yet to write, or others wait already (it goes behind them)."""
        if not self._held and not self.tiering.behind:
            return False            # the common case, without a look at the job's refs
        new = self._new_slots(msg)
        return new is not None and (bool(self._held) or self.tiering.must_hold(*new))

    def _new_slots(self, msg: p.StoreRequest) -> tuple[bytes, int] | None:
        """(namespace, count) of the unbound tickets ``msg`` names: the slots its start would
        find, evicting; None if it names none (a later rank's, or tickets gone meanwhile)."""
        unbound = self.index.stores.tickets.unbound
        n = sum(map(unbound.__contains__, msg.slots))
        if not n:
            return None
        return unbound[next(r for r in msg.slots if r in unbound)].ns, n

    def start_held(self) -> None:
        """Start the held stores that may go, in arrival order: room was made, their hold ran
        out (then the tiers are overloaded and the rest go too), or the daemon stops."""
        held, tiering = self._held, self.tiering
        now = time.monotonic()
        while held:
            owner, msg, deadline = held[0]
            new = self._new_slots(msg)
            expired = new is not None and now >= deadline
            if new is not None and not expired and tiering.must_hold(*new):
                break
            if expired:
                tiering.hold_expired()
            held.popleft()
            self.telemetry.store_held(expired)
            reply = self._start(owner, msg)
            if reply is not None and self.registry.by_identity.get(owner.identity) is owner:
                self.send(owner.identity, reply)
        self._arm_hold_timer()

    def abort_held(self) -> None:
        """Answer every held store with ``ABORTED`` (the daemon is stopping; nothing was
        copied, the worker's engine keeps its blocks)."""
        held = self._held
        while held:
            owner, msg, _ = held.popleft()
            reply = job_failed(msg, Aborted("kvpoold is stopping"), self.count_error)
            if self.registry.by_identity.get(owner.identity) is owner:
                self.send(owner.identity, reply)
        self._arm_hold_timer()

    def _arm_hold_timer(self) -> None:
        """One timer, at the first held store's deadline (none while nothing is held)."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self._held:
            delay = max(0.0, self._held[0][2] - time.monotonic())
            self._hold_timer = asyncio.get_running_loop().call_later(delay, self.start_held)

    def _start(self, owner: Owner, msg: p.StoreRequest | p.LoadRequest) -> p.Reply | None:
        job = _Job(owner, msg, time.monotonic(), time.monotonic_ns() if self.trace else 0)
        try:
            reg = job.reg = self.registry.registration(owner, msg.registration_id)
            if len(msg.block_ids) != len(msg.slots):
                raise ProtocolError(f"{len(msg.block_ids)} block ids for {len(msg.slots)} slots")
            check_count(len(msg.slots), "blocks")
            blocks = _block_ids(msg.block_ids, reg.num_blocks)
            if job.is_store and not reg.mask:
                # A replica of heads that another rank of its engine stores: nothing to copy,
                # and the slot commits (or not) on that rank's store alone.
                return p.JobDone(msg.req_id, msg.job_id, 0, "", 0)
            # Checked now; what can wait (the pins, a store's bindings) is ``finish``, done
            # once the copy has gone out (a big job's first chunk is copying by then).
            if job.is_store:
                opened = self.index.open_store(reg.namespace, msg.slots, self._store_keys(msg),
                                               reg.tp_rank, reg.mask, now=job.started,
                                               head=reg.engine.store_head(len(msg.slots)))
                job.slots = opened.slots
            else:
                if msg.keys and len(msg.keys) != len(msg.slots):
                    raise ProtocolError(f"{len(msg.keys)} keys for {len(msg.slots)} blocks")
                fut, job.slots = self.loads.start(reg, msg.slots, msg.keys, blocks)
        except KvpoolError as e:
            return job_failed(msg, e, self.count_error)
        if job.is_store:
            late = (LateOffsets(np.empty(len(blocks), np.int64), len(opened.slots))
                    if opened.late else None)
            fut = self._submit_store(job, blocks, opened.has_voids, late)
            if fut is None:
                # The engine refused the job: its slots go back (its tickets have slots by
                # now, open_store found them, which only the job's end frees).
                if opened.finish is not None:
                    opened.finish()     # so that the job's end finds it as begin_store would
                self._end(job, ok=False)
                self.telemetry.job_done(True, 0, job.started, len(msg.slots), ok=False)
                e, self._refusal = self._refusal, None
                if not isinstance(e, KvpoolError):
                    raise e                                   # type: ignore[misc]
                return job_failed(msg, e, self.count_error)
            if opened.finish is not None:
                # The copy is on its way: the pins and bindings run beside it, before the loop
                # turns (so before any chunk commits or the job ends, and before another
                # request can evict, reuse or see the slots).
                if late is None:
                    opened.finish()
                else:
                    self._finish_late(opened, late)
        reg.jobs_in_flight += 1
        owner.jobs_in_flight += 1
        job.t_sub = time.monotonic_ns() if self.trace else 0
        if fut.done():
            # Done already (a small host copy run inline, an empty store, a refusal): the
            # JobDone goes out now, in this dispatch, with no loop turn and no wake-up.
            self._job_done(job, fut)
            return None
        # The engine's future resolves on its thread; one call_soon_threadsafe brings the
        # completion to the loop (asyncio.wrap_future would take two loop turns).
        loop = asyncio.get_running_loop()
        job.waiter = loop.create_future()
        self.in_flight.add(job.waiter)

        def resolved(f) -> None:
            try:
                loop.call_soon_threadsafe(self._job_done, job, f)
            except RuntimeError:   # the loop has closed: the daemon is gone
                pass
        fut.add_done_callback(resolved)
        return None

    def _submit_store(self, job: "_Job", blocks: np.ndarray, has_voids: bool,
                      late: LateOffsets | None = None) -> Future[JobResult] | None:
        """Hand a checked store to its registration's engine (``job.landing`` set): its
        future, or None (``self._refusal`` set) when the engine refused it. With ``late``,
        ``job.slots`` is the job's head: ``_finish_late`` writes the rest's offsets."""
        slots, reg = job.slots, job.reg
        if late is None:
            offsets = self.index.table.offsets(slots)
        else:
            offsets = late.offsets
            offsets[:late.head] = self.index.table.offsets(slots[:late.head])
        job.landing = Landing(slots)
        if has_voids:
            # Duplicates (keys someone else holds) are bound but written by nobody.
            keep = np.fromiter((not s.void for s in slots), bool, len(slots))
            blocks, offsets = blocks[keep], offsets[keep]
            job.landing = Landing(slots, keep)
        if not len(blocks):
            done: Future[JobResult] = Future()
            done.set_result(JobResult(0))
            return done
        try:
            return reg.engine.submit_store(reg.mapped, blocks, offsets, job.msg.wait_event,
                                           self._progress(reg, job.landing), late)
        except BaseException as e:
            self._refusal = e
            return None

    def _finish_late(self, opened: OpenedStore, late: LateOffsets) -> None:
        """A store submitted with its head's offsets: find room for the rest (while the head
        copies), write their offsets into the job's array and let the engine go on, then bind
        every ticket (the claims: bookkeeping the copy does not wait for). Where the engine
        asks for a ``step``, room up to it comes first, and the engine launches what it covers
        (``advance``) before the rest's room is found. Where no room came for some (never with
        room assured), the engine ends the job after what it was given. The engine waits for
        ``ready`` or ``fail`` in every case."""
        slots = opened.slots                      # also the job's and its landing's list
        n = len(late.offsets)
        try:
            written = late.head
            for upto in ([late.step] if late.head < late.step < n else []) + [n]:
                opened.place(upto)                # type: ignore[misc]
                if opened.short:
                    break
                late.offsets[written:upto] = self.index.table.offsets(slots[written:upto])
                written = upto
                if upto < n:
                    late.advance(upto)            # the engine's next chunk goes out now
            if opened.short:
                late.fail(Aborted("no room for the whole store: stored its first "
                                  f"{written} blocks only"))
            else:
                late.ready()
        except BaseException as e:
            late.fail(Aborted(f"the store's placement failed: {e}"))
            raise
        opened.finish()

    def _store_keys(self, msg: p.StoreRequest) -> list[bytes]:
        """The store's keys, checked: every store names one per ticket."""
        if msg.grant and msg.grant != self.daemon_id:
            raise UnknownId(f"these slot refs were granted by daemon {msg.grant}, this is daemon "
                            f"{self.daemon_id} (it restarted): reserve again")
        if len(msg.keys) != len(msg.slots):
            raise ProtocolError(f"{len(msg.keys)} keys for {len(msg.slots)} slots")
        # (Each key's length was checked as the frame was decoded: ``p.Key``.)
        return msg.keys

    def _progress(self, reg: Registration, landing: Landing):
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

    def _landed(self, reg: Registration, landing: Landing, n: int) -> None:
        # A job whose worker has gone commits nothing more: its end drops what is left.
        if reg.closing:
            return
        chunk = landing.take(n)
        if chunk:
            self.index.end_store(chunk, reg.tp_rank, True, reg.mask)

    def _job_done(self, job: "_Job", fut: Future[JobResult]) -> None:
        """A job's end, on the loop: index, counters, its JobDone."""
        t_cb = time.monotonic_ns() if self.trace else 0
        if job.waiter is not None:
            if not job.waiter.done():
                job.waiter.set_result(None)
            self.in_flight.discard(job.waiter)
        owner, reg, msg = job.owner, job.reg, job.msg
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
        t_ended = 0
        if job.is_store:
            self._end(job, ok)
            t_ended = time.monotonic_ns() if self.trace else 0
        result = fut.result() if ok else JobResult(0)
        if ok:
            self.failed_load_blocks += len(result.failed)
            reply: p.Reply = p.JobDone(msg.req_id, msg.job_id, 0, "", result.nbytes,
                                       failed=list(result.failed))
        else:
            reply = job_failed(msg, exc, self.count_error)      # type: ignore[arg-type]
        # Every request gets its one reply while its client is connected, also when the job's
        # registration was closed under it (unregistered or replaced): the worker waits for it.
        try:
            if self.registry.by_identity.get(owner.identity) is owner:
                self.send(owner.identity, reply)
        finally:
            t_sent = time.monotonic_ns() if self.trace else 0
            if not job.is_store:
                self._end(job, ok)
        if job.is_store:
            self.stored_bytes += result.nbytes
        else:
            self.loaded_bytes += result.nbytes
        self.telemetry.job_done(job.is_store, result.nbytes, job.started, len(msg.slots), ok=ok)
        if reg.closing and reg.jobs_in_flight == 0:
            self.detach(reg)
        if self.trace:
            # owner job store|load blocks recv submitted engine-stamps... callback sent
            # ended ("sent": the reply handed to the socket; a load's unpins come after it;
            # "ended": a store's last slots committed, 0 for a load), then where the engine
            # stamps its chunks: their count, each one's launch, each one's landing, then when
            # it took the job and, in its first chunk's launch, the worker's event seen done
            # and that chunk's copies enqueued
            eng = (getattr(fut, "kvpool_trace", None) or []) + [0, 0, 0, 0]
            launched, landed = getattr(fut, "kvpool_chunks", None) or ([], [])
            first = ((getattr(fut, "kvpool_launch", None) or []) + [0, 0])[:2]
            self.trace.write(" ".join(map(str, [
                owner.id, msg.job_id, "store" if job.is_store else "load", len(msg.slots),
                job.t_recv, job.t_sub, *eng[1:4], t_cb, t_sent, t_ended,
                *([len(launched), *launched, *landed, eng[0], *first] if launched else [])]))
                + "\n")

    def _end(self, job: "_Job", ok: bool) -> None:
        """Give back what the job holds in the index: a store's slots (committed where every
        unit landed, dropped on failure), a load's pins."""
        if job.is_store:
            rest = job.landing.rest() if job.landing is not None else job.slots
            self.index.end_store(rest, job.reg.tp_rank, ok, job.reg.mask)
        else:
            self.index.end_load(job.slots, ok)


@dataclass(slots=True, eq=False)
class _Job:
    """One store or load job, from its request to its JobDone."""

    owner: Owner
    msg: p.StoreRequest | p.LoadRequest
    started: float                      # monotonic seconds at receipt
    t_recv: int = 0                     # monotonic ns at receipt (with a trace file)
    t_sub: int = 0                      # ... when handed to the engine
    reg: Registration = None            # type: ignore[assignment]  (set once looked up)
    slots: list[Slot] = field(default_factory=list)   # what its end gives back
    landing: "Landing | None" = None    # a store's slots on their way to the index
    waiter: asyncio.Future | None = None  # what shutdown waits on (None: done at submission)

    @property
    def is_store(self) -> bool:
        return type(self.msg) is p.StoreRequest


class Landing:
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
    """A job's block ids as int64, each in [0, ``num_blocks``), else ``OutOfRange``. Up to
    ``_LIST_CHECKED`` they are checked on the list (numpy's min and max cost ~5 us even for
    one id, ~70 us with the array's making after a copy evicted the caches; Python's ~30 us
    for 1024), which also turns away ids too big for int64 before the array is made."""
    blocks = None
    if len(ids) <= _LIST_CHECKED:
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


# (a worker's lead request and the jobs of a vLLM step, 128-block jobs in
# bench/host_scale.py, where numpy's min and max were ~2% of the busy event loop's Python on
# the host path, py-spy)
_LIST_CHECKED = 256


def check_count(n: int, what: str) -> None:
    """Bound the work one request does on the event loop: a prepare of a whole 16 MiB frame of
    keys held every other client for over a second (measured on a 2-core host)."""
    if n > MAX_BLOCKS_PER_REQUEST:
        raise TooLarge(f"{n} {what} in one request; at most {MAX_BLOCKS_PER_REQUEST}: split it")

