"""The remote tier's Mooncake Store client: key names, the value format, batched transfers.

A pool block ``key`` (namespace + block hash, 32 bytes) is the Mooncake object
``kvpool/v1/<namespace hex>/<block hash hex>``: every host computes the same name for the same
tokens under the same model and layout, which is what makes a block stored on host A a hit on
host B. The value is the block's pool bytes followed by a 32-byte trailer::

    magic "kvpoolR1" | slot_bytes (u64 LE) | checksum (u64 LE, daemon/checksum.py) | 0 (u64)

Both directions are zero-copy: the whole pool is registered with Mooncake's transfer engine, so
``batch_put_from_multi_buffers`` sends [pool slot, trailer] straight from the pool and
``batch_get_into_multi_buffers`` lands a value straight in the pool slot that will hold it
(trailers go to a small registered staging array, one lane per call in flight). A value whose
length, trailer or checksum is off is a miss: its pool bytes are garbage and must not commit.

Everything here blocks (network round trips, hashing) and runs on the remote tier's threads;
policy (what, when, what a failure means for the tier) is ``daemon/remote_tier.py``'s. Mooncake
releases the GIL in its calls, so these threads do not hold up the event loop.
"""

from __future__ import annotations

import logging
import queue
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from kvpool.daemon.checksum import block_checksums
from kvpool.daemon.remote_url import RemoteUrl

log = logging.getLogger("kvpoold")

KEY_PREFIX = "kvpool/v1/"
MAGIC = np.frombuffer(b"kvpoolR1", "V8")[0]
TRAILER_DTYPE = np.dtype([("magic", "V8"), ("slot_bytes", "<u8"), ("checksum", "<u8"),
                          ("reserved", "<u8")])
TRAILER_BYTES = TRAILER_DTYPE.itemsize
assert TRAILER_BYTES == 32
# Mooncake's own buffer serves copies of unregistered memory; every transfer here is from or
# into registered memory, so it only needs to exist.
LOCAL_BUFFER_BYTES = 16 << 20
CONNECT_TIMEOUT_S = 2.0
# A stop's look at the master before leaving the store (RemoteTier.CLOSE_S bounds the stop).
CLOSE_CHECK_TIMEOUT_S = 0.2
# Mooncake store error codes (mooncake-store/include/types.h) that this module tells apart.
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
NO_AVAILABLE_HANDLE = -200      # the store is full (every segment taken or leased)


class RemoteFault(Exception):
    """The store cannot be used now (master unreachable, setup failed): the tier goes off."""


def remote_key(key: bytes) -> str:
    """The Mooncake object name of pool block ``key`` (namespace + block hash)."""
    return f"{KEY_PREFIX}{key[:16].hex()}/{key[16:].hex()}"


def namespace_pattern(ns: bytes) -> str:
    """A regex matching every object of namespace ``ns`` (for ``remove_by_regex``)."""
    return f"^{KEY_PREFIX}{ns.hex()}/"


@dataclass(frozen=True)
class GetResult:
    ok: np.ndarray           # bool per block: in the pool and verified
    missing: int             # not in the store (evicted, never published, master restarted)
    corrupt: int             # a value came, but its length, trailer or checksum is wrong
    failed: int              # another error (a transfer from the holding host failed)


class MooncakeStore:
    """One Mooncake client over the daemon's pool. ``connect`` before anything else; after it,
    ``exists``/``put``/``get`` may run on several threads at once (each takes its own trailer
    lane; at most ``lanes`` calls in flight, ``lane_blocks`` blocks each)."""

    def __init__(self, url: RemoteUrl, pool_buffer, segment_bytes: int, lanes: int,
                 lane_blocks: int) -> None:
        self.url = url
        self._pool = memoryview(pool_buffer)
        self._pool_u8 = np.frombuffer(pool_buffer, np.uint8)
        self._pool_base = self._pool_u8.ctypes.data
        self.segment_bytes = segment_bytes
        self.lane_blocks = lane_blocks
        self._trailers = np.zeros((lanes, lane_blocks), TRAILER_DTYPE)
        self._lanes: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(lanes):
            self._lanes.put(i)
        self._store = None

    # ---- lifecycle -------------------------------------------------------------------------

    def connect(self) -> None:
        """Set up the client (mounts ``segment_bytes`` of this host's memory into the store),
        register the pool and the trailers. Raises ``RemoteFault``; ``ImportError`` when the
        ``kvpool[mooncake]`` extra is missing."""
        from mooncake.store import MooncakeDistributedStore
        # Mooncake's setup holds the GIL, hence the daemon's event loop, for as long as it
        # retries: 20 tries of ~4 s against an absent master (measured). So it only runs once
        # the master's ports take connections; against a live master it returns in ~50 ms.
        self._check_reachable(CONNECT_TIMEOUT_S)
        u = self.url
        store = MooncakeDistributedStore()
        rc = store.setup(u.local_host, u.metadata, self.segment_bytes, LOCAL_BUFFER_BYTES,
                         u.protocol, u.device, u.master)
        if rc != 0:
            raise RemoteFault(f"Mooncake client setup against master {u.master} (metadata "
                              f"{u.metadata}) failed with code {rc}")
        for what, ptr, size in (("pool", self._pool_base, len(self._pool_u8)),
                                ("trailers", self._trailers.ctypes.data, self._trailers.nbytes)):
            rc = store.register_buffer(ptr, size)
            if rc != 0:
                store.close()
                raise RemoteFault(f"registering the {what} ({size} bytes) with Mooncake's "
                                  f"transfer engine failed with code {rc}")
        self._store = store

    def close(self) -> None:
        """Unregister the pool and leave the store (this host's segment and what it held go).
        No call may be in flight. Raises ``RemoteFault``, still connected, when the master's
        ports take no connection: leaving retries against it for 1.5 s and more with the GIL
        held (measured), which would stop the daemon's event loop as long."""
        if self._store is None:
            return
        self._check_reachable(CLOSE_CHECK_TIMEOUT_S)
        store, self._store = self._store, None
        store.unregister_buffer(self._pool_base)
        store.unregister_buffer(self._trailers.ctypes.data)
        store.close()

    def _check_reachable(self, timeout_s: float) -> None:
        """Raise ``RemoteFault`` unless the master's RPC port (and an HTTP metadata server's)
        take a TCP connection within ``timeout_s``."""
        u = self.url
        endpoints = [("master", u.master_host, u.rpc_port)]
        if u.metadata.startswith("http://"):
            m = urlsplit(u.metadata)
            endpoints.append(("metadata server", m.hostname, m.port or 80))
        for what, host, port in endpoints:
            try:
                socket.create_connection((host, port), timeout=timeout_s).close()
            except OSError as e:
                raise RemoteFault(f"the Mooncake {what} at {host}:{port} is not reachable: "
                                  f"{e.strerror or e}") from None

    @property
    def is_connected(self) -> bool:
        return self._store is not None

    # ---- calls (tier threads) --------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether the master answers (Mooncake's own view, from its ping thread)."""
        return self._store is not None and self._store.health_check() == 0

    def exists(self, names: list[str]) -> np.ndarray:
        """bool per object name. Raises ``RemoteFault`` if the master did not answer."""
        codes = np.asarray(self._live().batch_is_exist(names), np.int64)
        if len(codes) != len(names) or (codes < 0).any():
            raise RemoteFault(f"the master did not answer an existence check of {len(names)} "
                              f"keys (codes {sorted(set(codes.tolist()))[:4]})")
        return codes == 1

    def put(self, keys: list[bytes], offsets: list[int], slot_bytes: int) -> np.ndarray:
        """Publish pool blocks (key i at pool byte offset i); int64 code per block: 0 stored
        (or already there), ``NO_AVAILABLE_HANDLE`` no room, other negatives failed. Raises
        ``RemoteFault`` when the master is unreachable."""
        store = self._live()
        n = len(keys)
        lane = self._lanes.get()
        try:
            tr = self._trailers[lane, :n]
            tr["magic"] = MAGIC
            tr["slot_bytes"] = slot_bytes
            tr["checksum"] = block_checksums(self._pool, offsets, keys, slot_bytes)
            tr["reserved"] = 0
            base, tbase = self._pool_base, tr.ctypes.data
            ptrs = [[base + o, tbase + i * TRAILER_BYTES] for i, o in enumerate(offsets)]
            codes = np.asarray(store.batch_put_from_multi_buffers(
                [remote_key(k) for k in keys], ptrs, [[slot_bytes, TRAILER_BYTES]] * n),
                np.int64)
        finally:
            self._lanes.put(lane)
        if (codes == RPC_FAIL).all():
            raise RemoteFault(f"the master did not take a publish of {n} blocks")
        return codes

    def get(self, keys: list[bytes], offsets: list[int], slot_bytes: int) -> GetResult:
        """Fetch blocks into pool bytes at ``offsets`` and verify each. Raises ``RemoteFault``
        when the master is unreachable."""
        store = self._live()
        n = len(keys)
        lane = self._lanes.get()
        try:
            tr = self._trailers[lane, :n]
            tr.fill(np.zeros((), TRAILER_DTYPE))    # a short value must not pass on old bytes
            base, tbase = self._pool_base, tr.ctypes.data
            ptrs = [[base + o, tbase + i * TRAILER_BYTES] for i, o in enumerate(offsets)]
            codes = np.asarray(store.batch_get_into_multi_buffers(
                [remote_key(k) for k in keys], ptrs, [[slot_bytes, TRAILER_BYTES]] * n),
                np.int64)
            if (codes == RPC_FAIL).all():
                raise RemoteFault(f"the master did not answer a fetch of {n} blocks")
            landed = codes == slot_bytes + TRAILER_BYTES
            ok = (landed & (tr["magic"] == MAGIC) & (tr["slot_bytes"] == slot_bytes))
            if ok.any():
                sel = np.flatnonzero(ok).tolist()
                sums = block_checksums(self._pool, [offsets[i] for i in sel],
                                       [keys[i] for i in sel], slot_bytes)
                ok[sel] = sums == tr["checksum"][sel]
        finally:
            self._lanes.put(lane)
        missing = codes == OBJECT_NOT_FOUND
        return GetResult(ok, int(missing.sum()), int(((codes >= 0) & ~ok).sum()),
                         int(((codes < 0) & ~missing).sum()))

    def remove(self, keys: list[bytes]) -> None:
        """Remove blocks from the store, leases or not (a value that failed verification)."""
        self._live().batch_remove([remote_key(k) for k in keys], True)

    def remove_namespace(self, ns: bytes) -> int:
        """Remove every object of namespace ``ns`` from the store (a cache reset); returns
        Mooncake's count or error code."""
        return int(self._live().remove_by_regex(namespace_pattern(ns), True))

    def _live(self):
        store = self._store
        if store is None:
            raise RemoteFault("not connected to the Mooncake master")
        return store
