"""Load jobs: find each block (pool slot, or a lower tier), copy what is there, report the rest.

Lookups no longer pin (schedulers read hits in the shared-memory index, issue 37), so a load
names what the lookup saw: per block a slot ref (0 where a lower tier held it) and its key. Each
block resolves (``Index.resolve_load``) to its ref's slot while that still holds the block, else
to the slot the pool holds its key in now; a block the pool lacks comes up from the first lower
tier that holds it; what nothing holds fails alone (``JobResult.failed``), and the engine
recomputes exactly those blocks. A reused slot is never read: refs carry generations.

The common load (every block in the pool, committed) is one copy, started in the dispatch; a
big one (``CopyEngine.load_head``) starts copying its head before the rest is found, and where
some of the rest is not in the pool, the rest runs as a load of its own once the head landed. A
load that needs fills runs through a *staging window*: at most ``STAGING_BLOCKS`` blocks (and a
quarter of the pool's slots of its size) are resolved, brought up, copied and let go before the
next window starts, in the job's order, so a job larger than the pool is served whole instead of
cut at what fits (an 8 MiB pool under a disk tier loaded 24 of 66 blocks before, issue 37).
Staged windows take turns daemon-wide, in arrival order, and pin nothing before their turn:
several loads that together outgrow the pool are served one window after another, where each
holding its later blocks' slots while waiting left the others no room (two of an engine's
prompts at once, 11 blocks each through 24 slots, loaded 48 of 66).

Runs on the daemon's event loop; copies run on the registration's engine.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import numpy as np

from kvpool.daemon.copy_engine import JobResult, LateOffsets
from kvpool.daemon.index import COMMITTED, Index, Slot
from kvpool.daemon.registry import Registration
from kvpool.daemon.tiering import Tiering
from kvpool.shared.errors import Aborted

# Blocks one window of a staged load brings up at most (each a pool slot, pinned until copied).
STAGING_BLOCKS = 64
# A window that finds no room for a block a lower tier holds waits this long for slots to be
# let go (asking again every ROOM_POLL_S) before the block fails (the engine recomputes it).
ROOM_WAIT_S = 5.0
ROOM_POLL_S = 0.01


class Loads:
    """Starts load jobs. Caller: the copy jobs, in their dispatch (event loop thread)."""

    def __init__(self, index: Index, tiering: Tiering | None) -> None:
        self.index = index
        self.tiering = tiering
        self.staged_jobs = 0          # loads that needed a lower tier (since start)
        self._turns = asyncio.Lock()  # staged windows, one at a time, first come first served

    def start(self, reg: Registration, refs: list[int], keys: list[bytes],
              blocks: np.ndarray) -> tuple[Future[JobResult], list[Slot]]:
        """Start a checked load job (``blocks``: its block ids, checked against the
        registration). Returns its future and the slots the caller ends (``end_load``) after
        its reply; a staged job ends its own windows and returns none. ``OutOfRange`` for a
        ref that names no slot of the pool (nothing started), or, for a ref past a late
        load's head, as the future's error once the head has landed."""
        ns = reg.namespace
        head = reg.engine.load_head(len(refs))
        if head:
            started = self._start_late(reg, refs, keys, blocks, head)
            if started is not None:
                return started
        slots = self.index.resolve_load(ns, refs, keys)
        if _all_committed(slots):
            found: list[Slot] = slots      # type: ignore[assignment]
            fut = reg.engine.submit_load(reg.mapped, self.index.table.offsets(found), blocks)
            self.index.pin(found)     # before the loop turns: nothing can evict them meanwhile
            return fut, found
        if self.tiering is None:
            return self._partial(reg, slots, blocks), []
        self.staged_jobs += 1
        out: Future[JobResult] = Future()
        # Each window finds its blocks again in its turn: a slot found now and evicted
        # meanwhile is looked up by key, and brought up again where a lower tier holds it.
        refs = [s.ref if s is not None else 0 for s in slots]
        asyncio.get_running_loop().create_task(self._staged(reg, refs, keys, blocks, out))
        return out, []

    def _start_late(self, reg: Registration, refs: list[int], keys: list[bytes],
                    blocks: np.ndarray, head: int
                    ) -> tuple[Future[JobResult], list[Slot]] | None:
        """``start`` for a big load whose first ``head`` blocks are in the pool: their copy
        goes out before the rest is found (a 1024-block job's resolve, ~0.3 ms on an H200
        host, no longer comes before its first byte moves). None, having done nothing, where
        the head is not all there."""
        ns = reg.namespace
        first = self.index.resolve_load(ns, refs[:head], keys[:head])
        if not _all_committed(first):
            return None
        held: list[Slot] = first        # type: ignore[assignment]
        late = LateOffsets(np.empty(len(refs), np.int64), head)
        late.offsets[:head] = self.index.table.offsets(held)
        fut = reg.engine.submit_load(reg.mapped, late.offsets, blocks, late)
        self.index.pin(held)            # before the loop turns, as ``start``'s
        try:
            rest = self.index.resolve_load(ns, refs[head:], keys[head:])
        except Exception as e:
            late.fail(e)        # (OutOfRange: a ref that names no slot) once the head landed
            return fut, held
        except BaseException:
            late.fail(Aborted("the load was interrupted"))    # no engine thread waits forever
            raise
        if _all_committed(rest):
            late.offsets[head:] = self.index.table.offsets(rest)    # type: ignore[arg-type]
            late.ready()
            self.index.pin(rest)                        # type: ignore[arg-type]
            return fut, held + rest                     # type: ignore[operator]
        # Some of the rest is elsewhere (evicted, in a lower tier, filling): once the head has
        # landed, the rest is a load of its own, by the rules of any load.
        late.fail(_RestApart())
        out: Future[JobResult] = Future()
        loop = asyncio.get_running_loop()
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(
            self._load_rest, f, reg, refs[head:], keys[head:], blocks[head:], head, out))
        return out, held

    def _load_rest(self, head_job: Future[JobResult], reg: Registration, refs: list[int],
                   keys: list[bytes], blocks: np.ndarray, head: int,
                   out: Future[JobResult]) -> None:
        """The rest of a late load whose head has landed (``head_job`` ended with
        ``_RestApart``), on the loop; ``out`` gets the whole job's result."""
        try:
            err = head_job.exception()
            if not isinstance(err, _RestApart):
                raise err or Aborted("a load's head ended without its rest")
            if reg.closing:
                raise Aborted("worker disconnected during the transfer")
            head_bytes = head * reg.layout.shard_bytes
            rest, slots = self.start(reg, refs, keys, blocks)
        except BaseException as e:
            out.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        loop = asyncio.get_running_loop()

        def done(f: Future[JobResult]) -> None:
            ok = not f.cancelled() and f.exception() is None
            self.index.end_load(slots, ok)
            if ok:
                r = f.result()
                out.set_result(JobResult(head_bytes + r.nbytes,
                                         tuple(head + i for i in r.failed)))
            else:
                out.set_exception(f.exception() or Aborted("a load's rest was cancelled"))
        rest.add_done_callback(lambda f: loop.call_soon_threadsafe(done, f))

    def _partial(self, reg: Registration, slots: list[Slot | None],
                 blocks: np.ndarray) -> Future[JobResult]:
        """No tier to bring the missing blocks from: copy the committed ones, report the rest
        failed. Pins and unpins its own slots."""
        take = [i for i, s in enumerate(slots) if s is not None and s.state == COMMITTED]
        failed = tuple(sorted(set(range(len(slots))) - set(take)))
        out: Future[JobResult] = Future()
        if not take:
            out.set_result(JobResult(0, failed))
            return out
        held = [slots[i] for i in take]   # type: ignore[misc]
        copy = reg.engine.submit_load(reg.mapped, self.index.table.offsets(held), blocks[take])
        self.index.pin(held)
        loop = asyncio.get_running_loop()

        def done(f: Future) -> None:
            ok = not f.cancelled() and f.exception() is None
            self.index.end_load(held, ok)
            if ok:
                out.set_result(JobResult(f.result().nbytes, failed))
            else:
                out.set_exception(f.exception() or asyncio.CancelledError())
        copy.add_done_callback(lambda f: loop.call_soon_threadsafe(done, f))
        return out

    async def _staged(self, reg: Registration, refs: list[int], keys: list[bytes],
                      blocks: np.ndarray, out: Future[JobResult]) -> None:
        """Window by window, in the job's order, each in its turn: find the window's blocks,
        bring up what the pool lacks, wait for the fills, copy, let go. ``refs``: the slots
        ``start`` found (0 where the pool held none then)."""
        ns = reg.namespace
        n = len(refs)
        window = self._window(ns)
        nbytes = 0
        failed: list[int] = []
        try:
            for lo in range(0, n, window):
                hi = min(n, lo + window)
                async with self._turns:
                    got, lost = await self._window_copy(reg, refs[lo:hi], keys[lo:hi],
                                                        blocks[lo:hi])
                nbytes += got
                failed += [lo + j for j in lost]
            out.set_result(JobResult(nbytes, tuple(failed)))
        except BaseException as e:
            out.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def _window_copy(self, reg: Registration, refs: list[int], keys: list[bytes],
                           blocks: np.ndarray) -> tuple[int, list[int]]:
        """One window: (bytes copied, positions in it that failed)."""
        ns = reg.namespace
        if reg.closing:
            return 0, list(range(len(refs)))
        part = self.index.resolve_load(ns, refs, keys)
        # Every pin from here on is in ``held`` before anything can raise or be cancelled:
        # the finally gives each back (a cancelled wait for room leaked its pool hits' pins).
        held = [s for s in part if s is not None]
        self.index.pin(held)
        ok, nbytes, take = False, 0, []
        try:
            need = [j for j, s in enumerate(part) if s is None] if keys else []
            deadline = time.monotonic() + ROOM_WAIT_S
            while need:
                got, short = self.tiering.fetch(ns, [keys[j] for j in need],  # type: ignore
                                                time.monotonic())
                fetched = [g for g in got if g is not None]
                self.index.pin(fetched)
                held += fetched
                for j, g in zip(need, got):
                    part[j] = g
                if not short or reg.closing or time.monotonic() > deadline:
                    break
                # Slots pinned elsewhere (other loads' copies, a tier writing blocks out) are
                # let go within milliseconds; this window keeps its turn meanwhile.
                await asyncio.sleep(ROOM_POLL_S)
                need = [j for j in need if part[j] is None]
            fills = self.tiering.pending(held)                                   # type: ignore
            if fills:
                await asyncio.gather(*fills, return_exceptions=True)
            take = [j for j, s in enumerate(part)
                    if s is not None and s.state == COMMITTED and not s.doomed]
            if take and not reg.closing:
                offsets = self.index.table.offsets([part[j] for j in take])
                copy = reg.engine.submit_load(reg.mapped, offsets, blocks[take])
                nbytes = (await asyncio.wrap_future(copy)).nbytes
            else:
                take = []
            ok = True
        finally:
            self.index.end_load(held, ok)
        return nbytes, sorted(set(range(len(part))) - set(take))

    def _window(self, ns: bytes) -> int:
        pool = self.index.pool
        slot_bytes = self.index.layout_of(ns).slot_bytes
        room = pool.geometry.num_extents * pool.slots_per_extent(slot_bytes)
        return max(1, min(STAGING_BLOCKS, room // 4))


class _RestApart(Aborted):
    """A late load's rest is not all in the pool: its head's copy ends with this, then the
    rest runs as a load of its own (``Loads._load_rest``)."""


def _all_committed(slots: list[Slot | None]) -> bool:
    """Whether every block resolved to a committed slot (a load that is one copy)."""
    return all(s is not None and s.state == COMMITTED for s in slots)

