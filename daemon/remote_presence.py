"""What this host knows the Mooncake Store holds, and how it learns it: ``RemotePresence``.

``present`` maps a pool key to its block's size, bounded (``PRESENT_MAX``, the oldest learnt
go first). It is learnt from this host's own publishes and fetches (``daemon/remote_tier.py``
tells it) and from existence checks: a lookup's keys that the pool and the upper tiers lack are
probed before the lookup answers, the probes of one loop turn go out as one check, and the
lookup waits for it at most the tier's deadline (the engine's scheduler polls; it never waits).
``leading`` and ``wants`` then answer from memory. Each key learnt or forgotten is told to the
shared-memory index (``events.held``/``dropped``), so schedulers here see remote blocks without
asking the daemon.

Runs on the daemon's event loop; the check itself runs where the tier puts it (its control
thread), and a check past its deadline turns the tier off through the tier's ``fault``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

from kvpool.daemon.tier import TierEvents

log = logging.getLogger("kvpoold")

# Keys checked per key list and lookup: a prompt of 512 blocks of 16 tokens is 8k tokens;
# hits further out are found by the lookups of the following steps.
PROBE_MAX_KEYS = 512
# What this host remembers the store holds (a 32-byte key and its size: ~170 B each).
PRESENT_MAX = 1 << 18


class RemotePresence:
    def __init__(self, check: Callable[[list[bytes]], Future], timeout_s: float,
                 is_up: Callable[[], bool], fault: Callable[[str, BaseException], None]
                 ) -> None:
        """``check(keys)`` starts the store's existence check of ``keys`` and returns its
        future (one bool per key); ``is_up`` says whether the tier serves; ``fault`` turns it
        off. All three are the tier's."""
        self._check = check
        self.timeout_s = timeout_s
        self._is_up = is_up
        self._fault = fault
        # The tier's listener once it is bound (``RemoteTier.bind``): nobody listens until then.
        self.events: TierEvents = TierEvents()
        self._present: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0
        self._probes: list[tuple[list[bytes], int, asyncio.Future[None]]] = []

    def __len__(self) -> int:
        return len(self._present)

    # ---- questions (from memory) ------------------------------------------------------------

    def leading(self, ns: bytes, hashes: list[bytes], slot_bytes: int) -> int:
        present = self._present
        n = 0
        for h in hashes:
            if present.get(ns + h) != slot_bytes:
                break
            n += 1
        return n

    def wants(self, key: bytes) -> bool:
        return key not in self._present

    # ---- probes -----------------------------------------------------------------------------

    def probe(self, ns: bytes, tails: list[list[bytes]], slot_bytes: int
              ) -> asyncio.Future[None] | None:
        """As ``LowerTier.probe``, for a tier that is up."""
        keys = [ns + h for tail in tails for h in tail[:PROBE_MAX_KEYS]]
        if not keys:
            return None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._probes:
            loop.call_soon(self._send_probes)
        self._probes.append((keys, slot_bytes, done))
        return done

    def _send_probes(self) -> None:
        """One existence check for every probe of this loop turn, bounded by ``timeout_s``."""
        batch, self._probes = self._probes, []
        keys = list(dict.fromkeys(k for keys, _, _ in batch for k in keys))
        loop = asyncio.get_running_loop()
        state = {"answered": False}

        def finish() -> None:
            for _, _, f in batch:
                if not f.done():
                    f.set_result(None)

        def answered(f: Future) -> None:
            if state["answered"]:            # past the deadline: the tier is off already
                return
            state["answered"] = True
            timer.cancel()
            exc = f.exception()
            log.debug("remote tier: existence check of %d keys answered (%s)", len(keys),
                      "failed" if exc is not None else "ok")
            if exc is not None:
                self._fault("an existence check", exc)
            elif self._is_up():
                there = dict(zip(keys, f.result().tolist()))
                for probed, slot_bytes, _ in batch:
                    self._learn(probed, [there[k] for k in probed], slot_bytes)
            finish()

        def late() -> None:
            if state["answered"]:
                return
            state["answered"] = True
            self._fault("an existence check", TimeoutError(
                f"no answer within remote_timeout_ms={self.timeout_s * 1000:.0f}"))
            finish()

        if not self._is_up():
            finish()
            return
        log.debug("remote tier: existence check of %d keys sent", len(keys))
        timer = loop.call_later(self.timeout_s, late)
        self._check(keys).add_done_callback(lambda f: loop.call_soon_threadsafe(answered, f))

    def _learn(self, keys: list[bytes], there: list[bool], slot_bytes: int) -> None:
        for k, yes in zip(keys, there):
            if yes:
                self.remember(k, slot_bytes)
            else:
                self.forget_key(k)

    # ---- what the tier tells ----------------------------------------------------------------

    def remember(self, key: bytes, slot_bytes: int) -> None:
        """``key`` is in the store (published by this host, or found by a probe): told to the
        shared-memory index as a remote block, so schedulers here see it without asking."""
        present = self._present
        old = present.pop(key, None)
        if old is not None:
            self.bytes -= old
        else:
            self.events.held([key])
        present[key] = slot_bytes
        self.bytes += slot_bytes
        while len(present) > PRESENT_MAX:
            gone, size = present.popitem(last=False)
            self.bytes -= size
            self.events.dropped([gone])

    def forget_key(self, key: bytes) -> None:
        size = self._present.pop(key, None)
        if size is not None:
            self.bytes -= size
            self.events.dropped([key])

    def forget_ns(self, ns: bytes) -> int:
        mine = [k for k in self._present if k[:16] == ns]
        for k in mine:
            self.forget_key(k)
        return len(mine)

    def withdraw(self) -> None:
        """The tier went off: nothing can be fetched, so the index hears every key dropped;
        they stay known (``leading`` is not asked while the tier is off) until ``clear``."""
        if self._present:
            self.events.dropped(list(self._present))

    def clear(self) -> None:
        """Forget everything (a master that restarted has lost every object)."""
        self.withdraw()
        self._present.clear()
        self.bytes = 0
