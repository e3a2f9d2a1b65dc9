"""``kvpool top``: a live terminal view of one daemon, refreshed each second.

Owns the rendering of two successive ``PoolInfo`` snapshots into a screen: hit rate, GB/s each
way, pool occupancy, slots, clients. Rates are differences between snapshots over the daemon's
own uptime (not our clock), so a slow round trip does not distort them; a new ``daemon_id``
(restart) resets the baseline rather than showing negative rates.

Must never: talk to the daemon itself (the caller passes a function that returns ``PoolInfo``),
or import anything heavy; it runs in the operator's shell.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from kvpool.shared.errors import DaemonUnavailable
from kvpool.shared.protocol import ClientInfo, PoolInfo, Role

_CLEAR = "\x1b[H\x1b[2J"
_BAR = 40


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _rate(n: float) -> str:
    """Bytes per second as GB/s (decimal, like the PCIe figures in DESIGN.md)."""
    return f"{n / 1e9:6.2f} GB/s"


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:6.1%}" if whole else "     -"


def _bar(fraction: float) -> str:
    filled = min(_BAR, max(0, round(fraction * _BAR)))
    return "[" + "#" * filled + "." * (_BAR - filled) + "]"


def render(cur: PoolInfo, prev: PoolInfo | None) -> str:
    """One screen. ``prev`` is the previous snapshot of the same daemon, or None."""
    if prev is not None and prev.daemon_id != cur.daemon_id:
        prev = None
    dt = cur.uptime_s - prev.uptime_s if prev is not None else 0.0
    lines = [f"kvpoold {cur.daemon_id}   up {cur.uptime_s:,.0f} s   "
             f"{time.strftime('%H:%M:%S')}", ""]

    occ = cur.used_bytes / cur.pool_bytes if cur.pool_bytes else 0.0
    lines.append(f"pool     {_bar(occ)} {occ:6.1%}   {_bytes(cur.used_bytes)} of "
                 f"{_bytes(cur.pool_bytes)}")
    lines.append(f"slots    committed {cur.slots_committed:,}   writing {cur.slots_writing:,}   "
                 f"pinned {cur.slots_pinned:,}   leases {cur.leases:,}")

    if prev is not None and dt > 0:
        d_hit = cur.hit_blocks - prev.hit_blocks
        d_miss = cur.miss_blocks - prev.miss_blocks
        store = (cur.stored_bytes - prev.stored_bytes) / dt
        load = (cur.loaded_bytes - prev.loaded_bytes) / dt
        evict = (cur.evictions - prev.evictions) / dt
        errors = (cur.errors - prev.errors) / dt
        lines += ["",
                  f"              {'now':>11}   {'since start':>13}",
                  f"hit rate      {_ratio(d_hit, d_hit + d_miss):>11}   "
                  f"{_ratio(cur.hit_blocks, cur.hit_blocks + cur.miss_blocks):>13}",
                  f"store (to pool)  {_rate(store)}   {_bytes(cur.stored_bytes):>13}",
                  f"load (to GPU)    {_rate(load)}   {_bytes(cur.loaded_bytes):>13}",
                  f"evictions     {evict:9.0f}/s   {cur.evictions:>13,}",
                  f"errors        {errors:9.0f}/s   {cur.errors:>13,}"]
    else:
        lines += ["", f"hit rate      {_ratio(cur.hit_blocks, cur.hit_blocks + cur.miss_blocks)}"
                      f" since start   (rates from the next refresh)",
                  f"stored        {_bytes(cur.stored_bytes)}   loaded {_bytes(cur.loaded_bytes)}",
                  f"evictions     {cur.evictions:,}   errors {cur.errors:,}"]

    lines += _tiers(cur, prev, dt)

    clients = engine_clients(cur)
    engines = {c.engine_id for c in clients if c.engine_id}
    roles = {r: sum(1 for c in clients if c.role == r) for r in Role}
    lines += ["", f"clients  {len(clients)}   engines {len(engines)}   "
                  f"schedulers {roles[Role.SCHEDULER]}   workers {roles[Role.WORKER]}"]
    for c in sorted(clients, key=lambda c: (c.engine_id, c.role, c.owner_id))[:20]:
        lines.append(f"  {c.engine_id or '-':<20.20} {c.role.name.lower():<9} pid {c.pid:<7} "
                     f"jobs {c.jobs_in_flight:<4} leases {c.leases:<4} {c.name}")
    if len(clients) > 20:
        lines.append(f"  ... {len(clients) - 20} more (kvpool info lists them all)")
    return "\n".join(lines) + "\n"


def engine_clients(info: PoolInfo) -> list[ClientInfo]:
    """The clients an operator asks about: engines' schedulers and workers. Operator tools
    (``kvpool info``, ``top``, ``ping``: ``Role.OPERATOR``) are left out, the asking one
    included, so "no client connected" can be seen."""
    return [c for c in info.clients if c.role != Role.OPERATOR]


def _tiers(cur: PoolInfo, prev: PoolInfo | None, dt: float) -> list[str]:
    """One block per tier under the pool: occupancy, and GB/s each way since the last screen."""
    lines = []
    before = {t.name: t for t in prev.tiers} if prev is not None else {}
    for t in cur.tiers:
        occ = t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        state = "" if t.is_enabled else f"   OFF: {t.status}"
        lines += ["", f"{t.name:<8} {_bar(occ)} {occ:6.1%}   {_bytes(t.used_bytes)} of "
                      f"{_bytes(t.capacity_bytes)}   {t.blocks:,} blocks{state}"]
        old = before.get(t.name)
        if old is not None and dt > 0:
            lines.append(f"  down (demote) {_rate((t.demoted_bytes - old.demoted_bytes) / dt)}"
                         f"   up (promote) {_rate((t.promoted_bytes - old.promoted_bytes) / dt)}"
                         f"   hits {(t.hit_blocks - old.hit_blocks) / dt:7.0f}/s")
        lines.append(f"  demoted {t.demoted_blocks:,}   promoted {t.promoted_blocks:,}   "
                     f"verify failures {t.verify_failures:,}   I/O errors {t.io_errors:,}   "
                     f"evicted {t.evicted_blocks:,}   missed {t.missed_blocks:,}   "
                     f"lost {t.lost_blocks:,}   rejected {t.rejected_blocks:,}")
    return lines


def run_top(get_info: Callable[[], PoolInfo], interval_s: float = 1.0,
            out: TextIO | None = None, iterations: int | None = None,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """Refresh every ``interval_s`` until Ctrl-C (or ``iterations`` screens); returns 0.

    ``get_info`` raising ``DaemonUnavailable`` shows a waiting screen and keeps trying, so
    ``kvpool top`` can watch a daemon through a restart. The screen is cleared between
    refreshes only on a terminal; piped output gets one frame after another.
    """
    out = out or sys.stdout
    clear = _CLEAR if out.isatty() else ""
    prev: PoolInfo | None = None
    shown = 0
    try:
        while iterations is None or shown < iterations:
            try:
                cur = get_info()
                screen = render(cur, prev)
                prev = cur
            except DaemonUnavailable as e:
                screen = f"kvpoold unreachable: {e.message}\nretrying every {interval_s:g} s\n"
                prev = None
            out.write(clear + screen + ("" if clear else "\n"))
            out.flush()
            shown += 1
            if iterations is None or shown < iterations:
                sleep(interval_s)
    except KeyboardInterrupt:
        out.write("\n")
    return 0
