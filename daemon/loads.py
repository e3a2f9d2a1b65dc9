"""Load jobs: find each block (pool slot, or a lower tier), copy what is there, report the rest.

Lookups no longer pin (schedulers read hits in the shared-memory index, issue 37), so a load
names what the lookup saw: per block a slot ref (0 where a lower tier held it) and its key. Each
block resolves (``Index.resolve_load``) to its ref's slot while that still holds the block, else
to the slot the pool holds its key in now; a block the pool lacks comes up from the first lower
tier that holds it; what nothing holds fails alone (``JobResult.failed``), and the engine
recomputes exactly those blocks. A reused slot is never read: refs carry generations.

The common load (every block in the pool, committed) is one copy, started in the dispatch. A
load that needs fills runs through a *staging window*: at most ``STAGING_BLOCKS`` blocks (and a
quarter of the pool's slots of its size) are brought up, copied and let go before the next
window starts, in the job's order, so a job larger than the pool is served whole instead of cut
at what fits (an 8 MiB pool under a disk tier loaded 24 of 66 blocks before, issue 37).

Runs on the daemon's event loop; copies run on the registration's engine.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import numpy as np

from kvpool.daemon.copy_engine import JobResult
from kvpool.daemon.index import COMMITTED, Index, Slot
from kvpool.daemon.registry import Registration
from kvpool.daemon.tiering import Tiering

# Blocks one window of a staged load brings up at most (each a pool slot, pinned until copied).
STAGING_BLOCKS = 64


class Loads:
    """Starts load jobs. Caller: the copy jobs, in their dispatch (event loop thread)."""

    def __init__(self, index: Index, tiering: Tiering | None) -> None:
        self.index = index
        self.tiering = tiering
        self.staged_jobs = 0          # loads that needed a lower tier (since start)

    def start(self, reg: Registration, refs: list[int], keys: list[bytes],
              blocks: np.ndarray) -> tuple[Future[JobResult], list[Slot]]:
        """Start a checked load job (``blocks``: its block ids, checked against the
        registration). Returns its future and the slots the caller ends (``end_load``) after
        its reply; a staged job ends its own windows and returns none. ``OutOfRange`` for a
        ref that names no slot of the pool (nothing started)."""
        ns = reg.namespace
        slots = self.index.resolve_load(ns, refs, keys)
        found = [s for s in slots if s is not None]
        if len(found) == len(slots) and all(s.state == COMMITTED for s in found):
            fut = reg.engine.submit_load(reg.mapped, _offsets(found), blocks)
            self.index.pin(found)     # before the loop turns: nothing can evict them meanwhile
            return fut, found
        if self.tiering is None:
            return self._partial(reg, slots, blocks), []
        self.staged_jobs += 1
        out: Future[JobResult] = Future()
        self.index.pin(found)         # the pool's hits stay until their window copies them
        asyncio.get_running_loop().create_task(self._staged(reg, slots, keys, blocks, out))
        return out, []

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
        copy = reg.engine.submit_load(reg.mapped, _offsets(held), blocks[take])
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

    async def _staged(self, reg: Registration, slots: list[Slot | None], keys: list[bytes],
                      blocks: np.ndarray, out: Future[JobResult]) -> None:
        """Window by window, in the job's order: bring up what the pool lacks, wait for the
        fills, copy, let go. ``slots``' pool hits are pinned (by ``start``) until their window
        is copied."""
        ns = reg.namespace
        n = len(slots)
        window = self._window(ns)
        nbytes = 0
        failed: list[int] = []
        lo = 0
        try:
            while lo < n:
                hi = min(n, lo + window)
                part = slots[lo:hi]
                need = [j for j, s in enumerate(part) if s is None] if keys else []
                if need and not reg.closing:
                    got = self.tiering.fetch(ns, [keys[lo + j] for j in need],  # type: ignore
                                             time.monotonic())
                    self.index.pin([g for g in got if g is not None])
                    for j, g in zip(need, got):
                        part[j] = g
                held = [s for s in part if s is not None]
                lo = hi                 # from here on, this window's pins are its own to drop
                ok = False
                try:
                    fills = self.tiering.pending(held)                           # type: ignore
                    if fills:
                        await asyncio.gather(*fills, return_exceptions=True)
                    take = [j for j, s in enumerate(part)
                            if s is not None and s.state == COMMITTED and not s.doomed]
                    base = hi - len(part)
                    failed += sorted(set(range(base, hi)) - {base + j for j in take})
                    if take and not reg.closing:
                        copy = reg.engine.submit_load(reg.mapped,
                                                      _offsets([part[j] for j in take]),
                                                      blocks[[base + j for j in take]])
                        nbytes += (await asyncio.wrap_future(copy)).nbytes
                    ok = True
                finally:
                    self.index.end_load(held, ok)
            out.set_result(JobResult(nbytes, tuple(failed)))
        except BaseException as e:
            # The windows not reached still hold the pins ``start`` took.
            self.index.unpin([s for s in slots[lo:] if s is not None])
            out.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def _window(self, ns: bytes) -> int:
        pool = self.index.pool
        slot_bytes = self.index.layout_of(ns).slot_bytes
        room = pool.geometry.num_extents * pool.slots_per_extent(slot_bytes)
        return max(1, min(STAGING_BLOCKS, room // 4))


def _offsets(slots: list[Slot]) -> np.ndarray:
    return np.fromiter((s.offset for s in slots), np.int64, len(slots))
