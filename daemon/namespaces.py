"""Namespaces of the block index: each one's layout, quota and space used.

``NamespaceTable`` is a base class of ``Index`` (daemon/index.py), for the same reason as
``StorePath`` (daemon/stores.py): the store and lookup paths read these tables directly. Quotas:
a namespace may have a byte cap (declared by its engines, bounded by the daemon's
``namespace_quota``); see the index's docstring for how a store meets it.
Runs on the daemon's event loop thread, never blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.daemon.eviction import LruPolicy
from kvpool.daemon.pool import COMMITTED
from kvpool.shared.errors import LayoutMismatch, OutOfRange, UnknownId
from kvpool.shared.layout import Layout
from kvpool.shared.protocol import NamespaceInfo

if TYPE_CHECKING:
    from kvpool.daemon.extents import Slot
    from kvpool.daemon.pool import Pool


class NamespaceTable:
    """Namespaces, for ``Index`` (the server's register and info paths call them)."""

    # Index's state this half reads and writes (set up by ``Index.__init__``).
    pool: "Pool"
    namespace_quota: int
    _slots: dict[int, "Slot"]
    _tables: dict[bytes, dict[bytes, "Slot"]]
    _layouts: dict[bytes, Layout]
    _ns_bytes: dict[bytes, int]
    _ns_blocks: dict[bytes, int]
    _quota: dict[bytes, int]
    _ns_lru: dict[bytes, LruPolicy]

    def register_namespace(self, ns: bytes, layout: Layout, quota_bytes: int = 0) -> None:
        """Bind a namespace to its layout's canonical form; ``LayoutMismatch`` if it is bound
        to another one.

        ``quota_bytes`` (0: none) is the engine's cap for the namespace. The latest registration
        decides (engines of one namespace serve one model with one config), bounded by the
        daemon's ``namespace_quota``.
        """
        layout.check()
        layout = layout.canonical()   # engines of every TP size of a head-split layout agree
        if quota_bytes < 0:
            raise OutOfRange(f"quota_bytes must be >= 0, got {quota_bytes}")
        known = self._layouts.get(ns)
        if known is None:
            self._layouts[ns] = layout
            self.pool.save_layouts(self._layouts)
        elif known != layout:
            raise LayoutMismatch(f"namespace {ns.hex()} is registered with another layout "
                                 f"({known.description or known.segment_bytes[:4]}...)")
        caps = [q for q in (quota_bytes, self.namespace_quota) if q > 0]
        if caps:
            self._set_quota(ns, min(caps))
        else:
            self._quota.pop(ns, None)
            self._ns_lru.pop(ns, None)

    def quota_of(self, ns: bytes) -> int:
        return self._quota.get(ns, 0)

    def used_bytes_of(self, ns: bytes) -> int:
        return self._ns_bytes.get(ns, 0)

    def namespace_usage(self) -> list[NamespaceInfo]:
        """Per registered namespace: blocks, bytes and quota (for `kvpool info` and metrics)."""
        return [NamespaceInfo(ns, layout.description, 0 if layout.kv_heads else layout.tp_size,
                              self._ns_blocks.get(ns, 0), self._ns_bytes.get(ns, 0),
                              self._quota.get(ns, 0))
                for ns, layout in self._layouts.items()]

    def _set_quota(self, ns: bytes, quota: int) -> None:
        self._quota[ns] = quota
        if ns not in self._ns_lru:
            slots = self._slots
            lru = self._ns_lru[ns] = LruPolicy(lambda sid: slots[sid].last_use)
            held = sorted((s for s in self._tables.get(ns, EMPTY_TABLE).values()
                           if s.state == COMMITTED), key=lambda s: s.last_use)
            for s in held:
                lru.insert(s.id)

    def layout_of(self, ns: bytes) -> Layout:
        try:
            return self._layouts[ns]
        except KeyError:
            raise UnknownId(f"namespace {ns.hex()} has no registered layout: no worker of "
                            f"that model and layout has registered") from None

    def has_layout(self, ns: bytes) -> bool:
        return ns in self._layouts

    @property
    def namespaces(self) -> int:
        return len(self._layouts)


# A namespace with no table yet, for lookups that must not create one.
EMPTY_TABLE: dict[bytes, "Slot"] = {}
