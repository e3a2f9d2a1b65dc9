"""The disk tier: pool blocks kept in files under one directory, behind ``LowerTier``.

Owns the scheduling of batched I/O on a few threads, its faults and the tier's I/O counters.
What the directory holds in memory, the tier's LRU and its space against ``disk_size`` are
``daemon/disk_catalog.py``'s; the bytes, the file format and the crash rules are
``daemon/disk_store.py``'s.

- **Down (demote).** A batch of pool blocks of one size gets block indices from the catalog
  and goes to one I/O thread as one ``DiskStore.write_data``; up to ``MAX_DEMOTES`` batches
  are written at once. When its data is on the device the pool slots are let go and the batch
  joins the next group commit (``DiskStore.commit``: one flush of the data, the records, one
  flush of the records, for every batch that landed while the previous commit ran), on a
  thread of its own. The blocks become visible (``leading``) only once their data and records
  are durable. A flush per batch, as before, left the device idle behind each flush: 3 batches
  in flight converged and waited on their flushes together (pwritev in flight 84% of a 1 GiB
  demotion, 0.56 s of 4.4 s flushing with nothing written).
- **Up (promote).** Blocks being read are pinned in the catalog. A read is cut into parts of
  ``BATCH_BYTES`` that run on all I/O threads at once; each block is verified; one that fails
  is counted, logged and dropped.
- **Freeing.** Indices the catalog releases are freed through the store (record zeroed, space
  punched) in one call per size and loop turn, then handed back to the catalog for reuse.
- **Faults.** The first I/O error (a full disk included) turns the tier off: one ERROR log
  line, ``is_enabled`` False, ``io_errors`` counted; what is in flight resolves as failed, and
  the pool keeps serving without the tier until a restart.

Everything here runs on the daemon's event loop and never blocks it, except ``open`` (the
startup scan, before the daemon serves) and ``close``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvpool.daemon.disk_catalog import DiskBlock, DiskCatalog, SizeFile
from kvpool.daemon.disk_store import DiskStore
from kvpool.daemon.tier import LowerTier, TierEvents
from kvpool.shared.config import parse_size
from kvpool.shared.protocol import TierInfo

log = logging.getLogger("kvpoold")

# A few threads keep several O_DIRECT requests queued on the device (NVMe wants depth);
# more only add contention on a host whose cores the engines need.
IO_THREADS = 4
# One write batch or read part: big enough that a system call moves many MiB, small enough
# that a batch pins little of the pool while it is written.
BATCH_BYTES = 32 << 20
# Demote batches being written at once (each on its own I/O thread); batches waiting for
# their group commit do not count, their pool slots are already free.
MAX_DEMOTES = 3
# Batches written or being written but not yet committed: at least MIN_UNCOMMITTED, more
# while they hold at most UNCOMMITTED_SHARE of the tier's bytes (their blocks hold disk space
# the LRU cannot take back until they commit, so a small tier must not fill with them), never
# more than MAX_UNCOMMITTED. A small pool writes small batches (see _batch_bytes): counted in
# batches alone, six of them let a 16-slot pool evict 8 of a 66-block burst before the disk
# took them while a group commit ran; with 64, none.
MIN_UNCOMMITTED = 2 * MAX_DEMOTES
MAX_UNCOMMITTED = 64
UNCOMMITTED_SHARE = 8


class DiskTier(LowerTier):
    name = "disk"

    def __init__(self, store: DiskStore, catalog: DiskCatalog, pool_bytes: int) -> None:
        self.store = store
        self.catalog = catalog
        # Never pin more than an eighth of the pool for writing, whatever BATCH_BYTES says.
        self._batch_bytes = max(1, min(BATCH_BYTES, pool_bytes // (8 * MAX_DEMOTES)))
        self.max_uncommitted = min(MAX_UNCOMMITTED, max(
            MIN_UNCOMMITTED, catalog.capacity_bytes // UNCOMMITTED_SHARE // self._batch_bytes))
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvpool-disk")
        # Group commits run one at a time on their own thread, beside the writes.
        self._commit_io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-disk-commit")
        self._inflight: set[Future] = set()
        self._demotes = 0                      # batches being written
        self._uncommitted = 0                  # batches being written or committed
        self._landed: dict[SizeFile, list[tuple[list[DiskBlock], np.ndarray, np.ndarray]]] = {}
        self._committing = False
        self._closing = False
        self._free_scheduled = False
        self._enabled = True
        self.status = "ok"
        self.hit_blocks = self.demoted_blocks = self.demoted_bytes = 0
        self.promoted_blocks = self.promoted_bytes = self.verify_failures = 0
        self.io_errors = 0

    # ---- start -----------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str, size: str, pool_buffer, pool_bytes: int) -> "DiskTier":
        """Open the directory, adopt every valid block a previous daemon left, size the tier.
        Raises ``ConfigError``/``DiskBusy`` (the daemon does not start)."""
        t0 = time.monotonic()
        store = DiskStore.open(path, pool_buffer)
        try:
            found = store.scan()
            held = sum(len(f.indices) * f.slot_bytes for f in found)
            capacity = held + store.free_bytes() // 2 if size == "auto" else parse_size(size)
            catalog = DiskCatalog(capacity)
            for slot_bytes, stale in catalog.adopt(found):
                store.free(slot_bytes, stale)
            tier = cls(store, catalog, pool_bytes)
        except BaseException:
            store.close()
            raise
        log.info("disk tier %s: %d blocks (%d bytes) adopted of %d bytes in %.2f s", path,
                 catalog.blocks, catalog.used_bytes, capacity, time.monotonic() - t0)
        return tier

    def bind(self, events: TierEvents) -> None:
        super().bind(events)
        self.catalog.events = events       # it announces what it drops (evictions, resets)

    # ---- LowerTier: questions --------------------------------------------------------------

    def held_keys(self) -> list[bytes]:
        return self.catalog.held_keys() if self._enabled else []

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def leading(self, ns: bytes, hashes: list[bytes], slot_bytes: int) -> int:
        return self.catalog.leading(ns, hashes, slot_bytes) if self._enabled else 0

    def wants(self, key: bytes, slot_bytes: int) -> bool:
        return self._enabled and self.catalog.wants(key, slot_bytes)

    def can_demote(self) -> bool:
        return (self._enabled and self._demotes < MAX_DEMOTES
                and self._uncommitted < self.max_uncommitted)

    def batch_blocks(self, slot_bytes: int) -> int:
        return max(1, self._batch_bytes // slot_bytes)

    # ---- LowerTier: down -------------------------------------------------------------------

    def demote(self, keys: list[bytes], offsets: list[int], slot_bytes: int
               ) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        blocks, replaced = self.catalog.claim(keys, self.catalog.size(slot_bytes))
        self._schedule_free()
        if not blocks:
            done.set_result(0)
            return done
        n = len(blocks)
        self._demotes += 1
        self._uncommitted += 1
        indices = np.fromiter((b.index for b in blocks), np.int64, n)
        f = self._submit(self._io, self.store.write_data, slot_bytes, indices,
                         np.asarray(offsets[:n], np.int64), keys[:n],
                         np.asarray(replaced, np.int64))
        f.add_done_callback(lambda f: loop.call_soon_threadsafe(
            self._written, f, blocks, indices, done))
        return done

    def _written(self, f: Future, blocks: list[DiskBlock], indices: np.ndarray,
                 done: asyncio.Future) -> None:
        """A batch's data is on the device: the pool bytes are free again (``done``), and the
        batch waits for the next group commit to become durable and visible."""
        self._demotes -= 1
        exc = f.exception()
        if exc is not None:
            self._fault("writing blocks", exc)
            self._uncommitted -= 1
            self.catalog.lose(blocks)
            done.set_result(0)
            return
        batch = (blocks, indices, f.result())
        if self._enabled or self._closing:
            self._landed.setdefault(blocks[0].size, []).append(batch)
            self._commit_next()
        else:                      # the tier went off while it was written
            self._uncommitted -= 1
            self.catalog.lose(blocks)
        done.set_result(len(blocks))

    def _commit_next(self) -> None:
        """Start one group commit of everything landed, unless one is running (its end
        starts the next, so every flush covers all the batches that landed meanwhile)."""
        if self._committing or not self._landed:
            return
        size = next(iter(self._landed))
        group = self._landed.pop(size)
        self._committing = True
        loop = asyncio.get_running_loop()
        f = self._submit(self._commit_io, self.store.commit, size.slot_bytes,
                         [(indices, [b.key for b in blocks],
                           sums, np.fromiter((b.seq for b in blocks), np.uint64, len(blocks)))
                          for blocks, indices, sums in group])
        f.add_done_callback(lambda f: loop.call_soon_threadsafe(self._committed, f, group))

    def _committed(self, f: Future, group: list[tuple[list[DiskBlock], np.ndarray,
                                                      np.ndarray]]) -> None:
        self._committing = False
        self._uncommitted -= len(group)
        exc = f.exception()
        if exc is not None:
            self._fault("writing blocks", exc)
            for blocks, _, _ in group:
                self.catalog.lose(blocks)
        else:
            servable: list[bytes] = []
            for blocks, _, sums in group:
                for b, checksum in zip(blocks, sums.tolist()):
                    if self.catalog.landed(b, checksum):
                        servable.append(b.key)
                self.demoted_blocks += len(blocks)
                self.demoted_bytes += len(blocks) * blocks[0].size.slot_bytes
            if servable:
                self.events.held(servable)
        if not self._enabled and not self._closing:
            for waiting in self._landed.values():
                self._uncommitted -= len(waiting)
                for blocks, _, _ in waiting:
                    self.catalog.lose(blocks)
            self._landed.clear()
        self._commit_next()
        self._schedule_free()
        if self.can_demote():          # max_uncommitted may have held it
            self.events.ready()

    # ---- LowerTier: up ---------------------------------------------------------------------

    def promote(self, keys: list[bytes], offsets: list[int], slot_bytes: int
                ) -> asyncio.Future[list[bool]]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[bool]] = loop.create_future()
        blocks = [self.catalog.pin(key, slot_bytes) for key in keys]
        live = [i for i, b in enumerate(blocks) if b is not None]
        self.hit_blocks += len(live)
        ok = [False] * len(blocks)
        if not live or not self._enabled:
            self._promoted(blocks, ok, done, [])
            return done
        per = self.batch_blocks(slot_bytes)
        parts = [live[a:a + per] for a in range(0, len(live), per)]
        results: list[Future] = []

        def part_done(_f: Future) -> None:
            if all(r.done() for r in results):
                loop.call_soon_threadsafe(self._promoted, blocks, ok, done, list(zip(parts,
                                                                                     results)))
        for part in parts:
            sel = [blocks[i] for i in part]
            results.append(self._submit(
                self._io, self.store.read, slot_bytes,
                np.fromiter((b.index for b in sel), np.int64, len(sel)),
                np.asarray([offsets[i] for i in part], np.int64), [b.key for b in sel],
                np.fromiter((b.checksum for b in sel), np.uint64, len(sel))))
        for r in results:
            r.add_done_callback(part_done)
        return done

    def _promoted(self, blocks: list[DiskBlock | None], ok: list[bool], done: asyncio.Future,
                  parts: list[tuple[list[int], Future]]) -> None:
        if done.done():           # several parts may finish in the same instant
            return
        bad: list[DiskBlock] = []
        for part, r in parts:
            exc = r.exception()
            if exc is not None:
                self._fault("reading blocks", exc)
                continue
            for i, good in zip(part, r.result().tolist()):
                ok[i] = bool(good)
                if not good:
                    bad.append(blocks[i])
        n_ok = sum(ok)
        self.promoted_blocks += n_ok
        if n_ok:
            self.promoted_bytes += n_ok * next(b for b in blocks if b is not None).size.slot_bytes
        if bad:
            self.verify_failures += len(bad)
            log.warning("disk tier: %d block(s) failed checksum verification on read (first: "
                        "%s at index %d of blocks-%d.dat): dropped, their loads recompute",
                        len(bad), bad[0].key.hex(), bad[0].index, bad[0].size.slot_bytes)
        self.catalog.unpin(blocks, bad)
        self._schedule_free()
        done.set_result(ok)

    # ---- LowerTier: the rest ---------------------------------------------------------------

    def forget(self, ns: bytes) -> int:
        n = self.catalog.forget(ns)
        self._schedule_free()
        return n

    def info(self) -> TierInfo:
        c = self.catalog
        return TierInfo(self.name, self._enabled, str(self.store.path), c.capacity_bytes,
                        c.used_bytes, c.blocks, self.hit_blocks, self.demoted_blocks,
                        self.demoted_bytes, self.promoted_blocks, self.promoted_bytes,
                        self.verify_failures, self.io_errors, c.evicted_blocks, 0,
                        c.adopted_blocks, self.status)

    async def close(self, timeout_s: float) -> None:
        self._flush_free()        # forgotten blocks must not come back at the next start
        self._enabled = False
        self._closing = True      # what is being written is still committed
        deadline = time.monotonic() + timeout_s
        # A write's end starts a commit (on the loop), so wait until neither is left.
        while self._busy():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._inflight:
                await asyncio.wait([asyncio.wrap_future(f) for f in set(self._inflight)],
                                   timeout=left)
            await asyncio.sleep(0)        # let the callbacks of what finished run
        if self._busy():
            log.warning("disk tier: %d I/O operations still running at exit; blocks they write "
                        "are not recorded and will not be served", len(self._inflight))
            for pool in (self._io, self._commit_io):
                pool.shutdown(wait=False, cancel_futures=True)
            return
        self._io.shutdown(wait=True)
        self._commit_io.shutdown(wait=True)
        self.store.close()

    # ---- internals -------------------------------------------------------------------------

    def _busy(self) -> bool:
        """Whether I/O is running or a written batch still waits for its commit."""
        return bool(self._inflight or self._uncommitted)

    def _submit(self, pool: ThreadPoolExecutor, fn, *args) -> Future:
        f = pool.submit(fn, *args)
        self._inflight.add(f)
        f.add_done_callback(self._inflight.discard)
        return f

    def _schedule_free(self) -> None:
        if self.catalog.has_to_free and not self._free_scheduled:
            self._free_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_free)

    def _flush_free(self) -> None:
        self._free_scheduled = False
        todo = self.catalog.take_to_free()
        if not self._enabled:
            return
        loop = asyncio.get_running_loop()
        for size, idx in todo.items():
            f = self._submit(self._io, self.store.free, size.slot_bytes, np.asarray(idx, np.int64))

            def freed(f: Future, size=size, idx=idx) -> None:
                if f.exception() is not None:
                    self._fault("freeing blocks", f.exception())
                    return
                self.catalog.reuse(size, idx)
            f.add_done_callback(lambda f, freed=freed: loop.call_soon_threadsafe(freed, f))

    def _fault(self, what: str, exc: BaseException) -> None:
        self.io_errors += 1
        if not isinstance(exc, OSError):
            log.error("disk tier: %s failed with an unexpected error", what, exc_info=exc)
        if not self._enabled:
            return
        self._enabled = False
        self.status = f"off: {what} failed: {exc}"
        self.events.dropped(self.catalog.held_keys())
        log.error("DISK TIER OFF: %s in %s failed: %s. kvpoold keeps serving from the pool "
                  "alone; no block is read from the disk tier until the daemon restarts "
                  "(free space or fix the disk first)", what, self.store.path,
                  os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else exc)
