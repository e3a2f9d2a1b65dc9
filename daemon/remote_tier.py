"""The remote tier: pool blocks shared across hosts through a Mooncake Store, behind
``LowerTier``.

Owns the tier's state (connecting / up / down), the scheduling of store calls on the tier's
threads, and its counters. What this host knows the store holds, and the probes that learn it,
are ``daemon/remote_presence.py``'s; the bytes, key names and value format are
``daemon/mooncake_store.py``'s.

- **Down (publish).** Batches of committed pool blocks go to ``MooncakeStore.put`` on one of
  ``DATA_THREADS`` threads, straight from the pool; a block stored (or already there) becomes
  present. A store without room rejects a block (counted, one WARNING per outage of room).
- **Probe.** Existence checks (``batch_is_exist``) run on the control thread, bounded by
  ``remote_timeout_ms``; ``leading`` answers from what they and this host's publishes taught.
- **Up (fetch).** A hit is fetched straight into the pool's FILLING slots, the whole run in one
  call (Mooncake overlaps the transfers inside a call), each block verified; one that fails its checksum
  is a miss (counted, logged); one the store no longer has is a miss too (``lost_blocks``).
- **Faults.** A probe past its deadline, an unanswered call or a failed health check (Mooncake's
  own view of the master, every ``MONITOR_PERIOD_S``) turns the tier off: one ERROR line, ``is_enabled`` False, ``io_errors`` counted; lookups answer from
  this host alone at once and nothing is published. A monitor task checks the master every
  ``MONITOR_PERIOD_S`` (from the control thread, never more than one call at a time, so a hung
  master holds one thread, not the loop); when it answers again the tier comes back with one
  WARNING line, forgets ``present`` (a restarted master has lost every object) and calls
  ``events.restored`` so the pool's blocks are offered again. At start the tier connects the same
  way, in the background: a master that is down at start is an outage, not a failed start.

Everything here runs on the daemon's event loop and never blocks it; Mooncake calls run on the
tier's threads (``_ctl``: one thread for setup, existence checks, health, removal; ``_data``:
publishes; ``_fetch``: fetches).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from kvpool.daemon.mooncake_store import (NO_AVAILABLE_HANDLE, GetResult, MooncakeStore,
                                          RemoteFault, remote_key)
from kvpool.daemon.remote_presence import RemotePresence
from kvpool.daemon.remote_url import MOONCAKE_MISSING, RemoteUrl, parse_remote_url, resolve_local
from kvpool.daemon.tier import LowerTier, TierEvents
from kvpool.shared.config import DaemonConfig, parse_size
from kvpool.shared.errors import ConfigError
from kvpool.shared.protocol import TierInfo

log = logging.getLogger("kvpoold")

# Two publishes at once keep a TCP link busy while the other side hashes; more only add
# contention on a host whose cores the engines need. Fetches have threads of their own, so an
# engine waiting for a remote hit never queues behind publishes.
DATA_THREADS = 2
FETCH_THREADS = 2
# One publish batch: many MiB per call (Mooncake overlaps the transfers inside a call, so few
# big calls beat many small ones), and never more than a quarter of the pool pinned by the
# batches in flight.
BATCH_BYTES = 64 << 20
MAX_BATCH_BLOCKS = 512
MONITOR_PERIOD_S = 0.5
# The most a stop waits on the store. Against a dead master, leaving it (unmounting this host's
# segment) retries for 1.5 s and more, and calls in flight hang in Mooncake's retries; a stop
# waited 10-20 s for them. Past this, they are left behind and the daemon ends without them.
CLOSE_S = 0.5

CONNECTING, UP, DOWN, CLOSED = "connecting", "up", "down", "closed"


class RemoteTier(LowerTier):
    name = "remote"
    flushes_at_exit = False

    def __init__(self, store: MooncakeStore, timeout_s: float, pool_bytes: int) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self._batch_bytes = max(1, min(BATCH_BYTES, pool_bytes // (4 * DATA_THREADS)))
        self._state = CONNECTING
        self.status = f"connecting to {store.url.display()}"
        self.present = RemotePresence(
            lambda keys: self._ctl_call(store.exists, [remote_key(k) for k in keys]),
            timeout_s, lambda: self._state == UP, self._fault)
        self._ctl = ThreadPoolExecutor(1, thread_name_prefix="kvpool-remote-ctl")
        self._data = ThreadPoolExecutor(DATA_THREADS, thread_name_prefix="kvpool-remote-put")
        self._fetch = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvpool-remote-get")
        self._ctl_busy = 0
        self._data_inflight: set[Future] = set()
        self._puts = 0
        self._monitor: asyncio.Task | None = None
        self._full_warned = False
        self.hit_blocks = self.demoted_blocks = self.demoted_bytes = 0
        self.promoted_blocks = self.promoted_bytes = self.verify_failures = 0
        self.io_errors = self.lost_blocks = self.rejected_blocks = 0

    # ---- start -----------------------------------------------------------------------------

    @classmethod
    def open(cls, config: DaemonConfig, pool_buffer) -> "RemoteTier":
        """Check the URL, that the master's name resolves and that Mooncake is installed;
        ``ConfigError`` says what is wrong (the daemon does not start). Connecting happens in
        the background once the daemon serves (``start``)."""
        url = resolve_local(parse_remote_url(config.remote_store))
        # Mooncake logs through glog, which reads its flags when the library loads: below
        # debug, only its fatal lines (our own log says what an outage means, once; Mooncake
        # would say it every ping). GLOG_minloglevel in the environment wins.
        os.environ.setdefault("GLOG_minloglevel", "0" if config.log_level == "debug" else "3")
        try:
            import mooncake.store  # noqa: F401  (the wheel's binaries load here)
        except ImportError as e:
            raise ConfigError(f"{MOONCAKE_MISSING}: {e}") from None
        return cls(_new_store(url, pool_buffer, parse_size(config.remote_segment_size)),
                   config.remote_timeout_ms / 1000, len(pool_buffer))

    def start(self) -> None:
        log.info("remote tier: connecting to Mooncake master %s (metadata %s, %s, this host "
                 "%s, lending %d bytes) in the background", self.store.url.master,
                 self.store.url.metadata, self.store.url.protocol, self.store.url.local_host,
                 self.store.segment_bytes)
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    def bind(self, events: TierEvents) -> None:
        super().bind(events)
        self.present.events = events       # it tells the index what is present

    # ---- LowerTier: questions --------------------------------------------------------------

    @property
    def is_enabled(self) -> bool:
        return self._state == UP

    def leading(self, ns: bytes, hashes: list[bytes], slot_bytes: int) -> int:
        return self.present.leading(ns, hashes, slot_bytes) if self._state == UP else 0

    def probe(self, ns: bytes, tails: list[list[bytes]], slot_bytes: int
              ) -> asyncio.Future[None] | None:
        return self.present.probe(ns, tails, slot_bytes) if self._state == UP else None

    def wants(self, key: bytes, slot_bytes: int) -> bool:
        return self._state == UP and self.present.wants(key)

    def can_demote(self) -> bool:
        return self._state == UP and self._puts < DATA_THREADS

    def batch_blocks(self, slot_bytes: int) -> int:
        return max(1, min(MAX_BATCH_BLOCKS, self._batch_bytes // slot_bytes))

    # ---- LowerTier: down -------------------------------------------------------------------

    def demote(self, keys: list[bytes], offsets: list[int], slot_bytes: int
               ) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self._puts += 1
        f = self._data_call(self.store.put, keys, offsets, slot_bytes)
        f.add_done_callback(lambda f: loop.call_soon_threadsafe(
            self._published, f, keys, slot_bytes, done))
        return done

    def _published(self, f: Future, keys: list[bytes], slot_bytes: int,
                   done: asyncio.Future[int]) -> None:
        self._puts -= 1
        exc = f.exception()
        if exc is not None:
            self.io_errors += 1
            self._fault("publishing blocks", exc)
            done.set_result(0)
            return
        codes: np.ndarray = f.result()
        stored = codes == 0
        for k in np.asarray(keys, object)[stored].tolist():
            self.present.remember(k, slot_bytes)
        n = int(stored.sum())
        self.demoted_blocks += n
        self.demoted_bytes += n * slot_bytes
        full = int((codes == NO_AVAILABLE_HANDLE).sum())
        self.rejected_blocks += full
        if full and not self._full_warned:
            self._full_warned = True
            log.warning("remote tier: the Mooncake Store has no room for %d of %d blocks "
                        "published (every segment full or leased): lend more memory "
                        "(remote_segment_size) on the hosts; counted as rejected", full,
                        len(keys))
        failed = len(keys) - n - full
        if failed:
            self.io_errors += 1
            log.warning("remote tier: %d of %d blocks could not be published (codes %s)",
                        failed, len(keys), sorted(set(codes[codes < 0].tolist()))[:4])
        done.set_result(n)

    # ---- LowerTier: up ---------------------------------------------------------------------

    def promote(self, keys: list[bytes], offsets: list[int], slot_bytes: int
                ) -> asyncio.Future[list[bool]]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[bool]] = loop.create_future()
        self.hit_blocks += len(keys)
        if not keys:
            done.set_result([])
            return done
        per = self._fetch_blocks(len(keys))
        started = time.monotonic()
        parts = [(a, self._data_call(self.store.get, keys[a:a + per], offsets[a:a + per],
                                     slot_bytes, pool=self._fetch))
                 for a in range(0, len(keys), per)]

        def part_done(_f: Future) -> None:
            if all(f.done() for _, f in parts):
                loop.call_soon_threadsafe(self._fetched, parts, keys, slot_bytes, done, started)
        for _, f in parts:
            f.add_done_callback(part_done)
        return done

    def _fetched(self, parts: list[tuple[int, Future]], keys: list[bytes], slot_bytes: int,
                 done: asyncio.Future[list[bool]], started: float) -> None:
        if done.done():              # several parts may finish in the same instant
            return
        log.debug("remote tier: fetched %d blocks of %d bytes in %.1f ms (%d calls)", len(keys),
                  slot_bytes, (time.monotonic() - started) * 1e3, len(parts))
        ok = np.zeros(len(keys), bool)
        corrupt: list[bytes] = []
        per = self._fetch_blocks(len(keys))
        for a, f in parts:
            exc = f.exception()
            part = keys[a:a + per]
            if exc is not None:
                self.io_errors += 1
                self._fault("fetching blocks", exc)
                self.lost_blocks += len(part)
                continue
            r: GetResult = f.result()
            ok[a:a + len(part)] = r.ok
            self.lost_blocks += r.missing + r.failed
            if r.corrupt:
                corrupt += [k for k, good in zip(part, r.ok.tolist()) if not good]
            if r.failed:
                self.io_errors += 1
        for k, good in zip(keys, ok.tolist()):
            if not good:
                self.present.forget_key(k)
        n = int(ok.sum())
        self.promoted_blocks += n
        self.promoted_bytes += n * slot_bytes
        if corrupt:
            self.verify_failures += len(corrupt)
            log.warning("remote tier: %d block(s) fetched from the Mooncake Store failed "
                        "verification (first: %s): misses, their loads recompute; removed "
                        "from the store", len(corrupt), remote_key(corrupt[0]))
            # Useless to every host, and an existence check would find them again.
            self._ctl_call(self.store.remove, corrupt).add_done_callback(
                lambda f: f.cancelled() or f.exception())
        done.set_result(ok.tolist())

    # ---- LowerTier: the rest ---------------------------------------------------------------

    def forget(self, ns: bytes) -> int:
        """Forget ``ns`` here and remove its objects from the store (in the background): a
        reset means its KV is no longer valid, on any host."""
        n = self.present.forget_ns(ns)
        if self._state == UP:
            def removed(f: Future) -> None:
                if f.exception() is not None:
                    log.warning("remote tier: removing namespace %s from the store failed: %s",
                                ns.hex(), f.exception())
            self._ctl_call(self.store.remove_namespace, ns).add_done_callback(removed)
        return n

    def info(self) -> TierInfo:
        return TierInfo(self.name, self._state == UP, self.store.url.display(),
                        self.store.segment_bytes, self.present.bytes, len(self.present),
                        self.hit_blocks, self.demoted_blocks, self.demoted_bytes,
                        self.promoted_blocks, self.promoted_bytes, self.verify_failures,
                        self.io_errors, 0, 0, 0, self.status, self.lost_blocks,
                        self.rejected_blocks)

    async def close(self, timeout_s: float) -> None:
        reachable = self._state == UP
        self._state = CLOSED
        if self._monitor is not None:
            self._monitor.cancel()
        deadline = time.monotonic() + min(timeout_s, CLOSE_S)
        log.debug("remote tier: closing (%s, %d transfers in flight)",
                  "up" if reachable else "down", len(self._data_inflight))
        if self._data_inflight:
            await asyncio.wait([asyncio.wrap_future(f) for f in set(self._data_inflight)],
                               timeout=max(0.0, deadline - time.monotonic()))
        if self._data_inflight:
            log.warning("remote tier: %d Mooncake transfers still running at exit; left "
                        "behind", len(self._data_inflight))
            self._leave_behind(cancel=True)
            return
        if not reachable or self._ctl_busy:
            # Leaving would wait on the master (a hung one for minutes); it drops this host
            # by itself once its pings stop (mooncake_master --client_ttl).
            log.info("remote tier: leaving the Mooncake Store without telling the master")
            self._leave_behind(cancel=False)
            return
        # Leaving the store unmounts this host's segment through the master: bounded too.
        closing = asyncio.wrap_future(self._ctl.submit(self.store.close))
        try:
            await asyncio.wait_for(closing, max(0.05, deadline - time.monotonic()))
        except (asyncio.TimeoutError, Exception) as e:
            log.warning("remote tier: leaving the Mooncake Store did not finish: %r", e)
            self._leave_behind(cancel=False)
            return
        self._shutdown_threads(cancel=False)

    def _leave_behind(self, cancel: bool) -> None:
        """Stop without waiting: the threads may be inside Mooncake calls, and a store client
        that was not closed would leave the master in its destructor (the same wait)."""
        self.has_lingering_work = True
        self._shutdown_threads(cancel)

    def _shutdown_threads(self, cancel: bool) -> None:
        for pool in (self._data, self._fetch, self._ctl):
            pool.shutdown(wait=False, cancel_futures=cancel)

    # ---- state -----------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Connect, then check the master every MONITOR_PERIOD_S; turn the tier off when it
        stops answering and back on when it answers again. One call at a time."""
        while self._state != CLOSED:
            if self._ctl_busy == 0:
                f = asyncio.wrap_future(self._ctl_call(self._check, self._state != UP))
                # A check past its deadline keeps running on the control thread (and keeps
                # the next one back); its late answer is read and dropped.
                f.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.wait([f], timeout=self._check_deadline())
                if not f.done():
                    healthy: object = TimeoutError(f"the master did not answer a health check "
                                                   f"within {self._check_deadline():.1f} s")
                else:
                    healthy = f.exception() or f.result()
                if self._state == CLOSED:
                    return
                if healthy is True:
                    if self._state != UP:
                        self._restored()
                else:
                    self._fault("connecting" if self._state == CONNECTING else "a health check",
                                healthy if isinstance(healthy, BaseException)
                                else RemoteFault("the master does not answer"))
            await asyncio.sleep(MONITOR_PERIOD_S)

    def _check_deadline(self) -> float:
        # Connecting (setup, mounting the segment) takes longer than a check; it runs on the
        # control thread and only holds the monitor.
        return max(self.timeout_s, 1.0) if self.store.is_connected else 30.0

    def _check(self, full: bool) -> bool:
        """(control thread) Connect if needed; True when the master answers. While the tier is
        up, Mooncake's own view (its client pings the master) is enough, and a hung master
        shows in the next call's deadline anyway; to come back, a real call must answer."""
        if not self.store.is_connected:
            self.store.connect()
        if not self.store.healthy():
            return False
        if full:
            self.store.exists(["kvpool/health"])
        return True

    def _restored(self) -> None:
        back = self._state == DOWN
        self._state = UP
        self.status = "ok"
        self._full_warned = False
        # A master that restarted has lost every object; what we knew is no longer true.
        self.present.clear()
        if back:
            log.warning("REMOTE TIER BACK: Mooncake master %s answers again; publishing and "
                        "remote lookups resume", self.store.url.master)
        else:
            log.info("remote tier: connected to Mooncake master %s", self.store.url.master)
        self.events.restored()

    def _fault(self, what: str, exc: BaseException) -> None:
        """A call failed in a way that says the store is unusable: off, once per outage."""
        if not isinstance(exc, (RemoteFault, TimeoutError, OSError)):
            log.error("remote tier: %s failed with an unexpected error", what, exc_info=exc)
        if self._state not in (UP, CONNECTING):
            return
        self.io_errors += 1
        self.present.withdraw()
        self._state = DOWN
        self.status = f"off: {what} failed: {exc}"
        log.error("REMOTE TIER OFF: %s against Mooncake master %s failed: %s. kvpoold serves "
                  "from this host alone, publishes nothing and checks the master every %.1f s",
                  what, self.store.url.master, exc, MONITOR_PERIOD_S)

    # ---- internals -------------------------------------------------------------------------

    @staticmethod
    def _fetch_blocks(n: int) -> int:
        """Blocks per fetch call: the whole run in one call (up to MAX_BATCH_BLOCKS). Mooncake
        overlaps the transfers inside a call; 192 blocks of 2 MiB fetched at 1.44 GB/s in one
        call against 0.85 GB/s as two calls on two threads (medians of 5, loopback TCP, this
        2-core host). The slots are FILLING already, so a bigger call pins nothing more."""
        return max(1, min(MAX_BATCH_BLOCKS, n))

    def _ctl_call(self, fn: Callable, *args) -> Future:
        """Run ``fn`` on the control thread; ``_ctl_busy`` counts it until it returns."""
        loop = asyncio.get_running_loop()
        self._ctl_busy += 1

        def ended(_f: Future) -> None:
            try:
                loop.call_soon_threadsafe(self._ctl_ended)
            except RuntimeError:          # the loop has closed: the daemon is gone
                pass
        f = self._ctl.submit(fn, *args)
        f.add_done_callback(ended)
        return f

    def _ctl_ended(self) -> None:
        self._ctl_busy -= 1

    def _data_call(self, fn: Callable, *args, pool: ThreadPoolExecutor | None = None) -> Future:
        """Run a publish (or, on ``pool``, a fetch) on the tier's threads, tracked for close."""
        f = (pool or self._data).submit(fn, *args)
        self._data_inflight.add(f)
        f.add_done_callback(self._data_inflight.discard)
        return f


def _new_store(url: RemoteUrl, pool_buffer, segment_bytes: int) -> MooncakeStore:
    return MooncakeStore(url, pool_buffer, segment_bytes, lanes=DATA_THREADS + FETCH_THREADS,
                         lane_blocks=MAX_BATCH_BLOCKS)
