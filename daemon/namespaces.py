"""Namespaces of the pool: each one's layout, quota and space used.

``Namespaces`` is read by the store and lookup paths and by ``info``; the slot table
(``daemon/slot_table.py``) keeps its counts as slots are claimed, committed and freed. Quotas:
a namespace may have a byte cap (declared by its engines, bounded by the daemon's
``namespace_quota``). Its WRITING, FILLING and COMMITTED slots count against it; a store that
would pass it evicts that namespace's own least recently used blocks first (its own LRU queue,
kept beside the pool-wide one), never another namespace's, and its block gets no room when none
of its own can go. A quota is a cap, not a reservation: pool-wide pressure still evicts by the
pool-wide LRU. Runs on the daemon's event loop thread, never blocks.
"""

from __future__ import annotations

from typing import Callable

from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.pool import Pool
from kvpool.shared.errors import LayoutMismatch, OutOfRange, UnknownId
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import NamespaceInfo


class Namespaces:
    """Layouts, quotas and usage per namespace. Callers: the server's register and info paths,
    the store and lookup paths, the slot table (counts)."""

    def __init__(self, pool: Pool, namespace_quota: int = 0) -> None:
        self.pool = pool
        self.namespace_quota = namespace_quota
        self.layouts: dict[bytes, Layout] = {}
        self.bytes_used: dict[bytes, int] = {}     # WRITING, FILLING and COMMITTED slots
        self.blocks: dict[bytes, int] = {}         # COMMITTED blocks
        self.quota: dict[bytes, int] = {}
        # Per namespace with a quota: its evictable blocks (the victims its cap may take).
        self.lru: dict[bytes, LruPolicy] = {}

    def adopt(self) -> None:
        """The layouts of an adopted pool (called once, before any slot is adopted)."""
        self.layouts = self.pool.load_layouts()

    def register(self, ns: bytes, layout: Layout, quota_bytes: int = 0,
                 evictable: Callable[[], list[int]] | None = None) -> None:
        """Bind a namespace to its layout's canonical form; ``LayoutMismatch`` if it is bound
        to another one.

        ``quota_bytes`` (0: none) is the engine's cap for the namespace. The latest registration
        decides (engines of one namespace serve one model with one config), bounded by the
        daemon's ``namespace_quota``. ``evictable()``: the namespace's evictable slot ids, least
        recently used first, asked for only when a quota's queue is made now (the index passes
        it).
        """
        layout.check()
        layout = layout.canonical()   # engines of every TP size of a head-split layout agree
        if quota_bytes < 0:
            raise OutOfRange(f"quota_bytes must be >= 0, got {quota_bytes}")
        known = self.layouts.get(ns)
        if known is None:
            self.layouts[ns] = layout
            self.pool.save_layouts(self.layouts)
        elif known != layout:
            raise LayoutMismatch(f"namespace {ns.hex()} is registered with another layout "
                                 f"({known.description or known.segment_bytes[:4]}...)")
        caps = [q for q in (quota_bytes, self.namespace_quota) if q > 0]
        if caps:
            self.quota[ns] = min(caps)
            if ns not in self.lru:
                lru = self.lru[ns] = LruPolicy(self.pool.slot_ids)
                lru.insert_many(evictable() if evictable is not None else ())
        else:
            self.quota.pop(ns, None)
            self.lru.pop(ns, None)

    def layout_of(self, ns: bytes) -> Layout:
        try:
            return self.layouts[ns]
        except KeyError:
            raise UnknownId(f"namespace {ns.hex()} has no registered layout: no worker of "
                            f"that model and layout has registered") from None

    def has_layout(self, ns: bytes) -> bool:
        return ns in self.layouts

    def block_tokens(self, ns: bytes) -> int:
        """Tokens per block of ``ns``; 0 for a namespace no worker registered yet."""
        layout = self.layouts.get(ns)
        return layout.block_tokens if layout is not None else 0

    def quota_of(self, ns: bytes) -> int:
        return self.quota.get(ns, 0)

    def used_bytes_of(self, ns: bytes) -> int:
        return self.bytes_used.get(ns, 0)

    def usage(self) -> list[NamespaceInfo]:
        """Per registered namespace: blocks, bytes and quota (for `kvpool info` and metrics)."""
        return [NamespaceInfo(ns, layout.description, 0 if layout.kv_heads else layout.tp_size,
                              self.blocks.get(ns, 0), self.bytes_used.get(ns, 0),
                              self.quota.get(ns, 0))
                for ns, layout in self.layouts.items()]

    def __len__(self) -> int:
        return len(self.layouts)
