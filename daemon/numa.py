"""Where the pool's pages and the GPU copy threads live on a host with several NUMA nodes.

A GPU's DMA to host memory on another socket crosses the socket link: reads (loads) pay most.
Dynamo KVBM and PegaFlow place pinned pools on each GPU's node. The plan (``plan``, a pure
function of the topology and the pool's geometry) says:

- ``local``: the pool's data area is cut into one contiguous share per GPU (equal shares,
  whole extents, GPUs of one node side by side), each bound to its GPU's node (preferred, so a
  full node spills instead of failing); a GPU whose node is unknown gets a share interleaved
  over every node;
- ``interleave``: the whole data area is interleaved page by page over the GPUs' nodes;
- ``off``: nothing (one node, no GPU, or asked for).

In both modes each GPU's copy threads (its lanes' submit and wait threads) run on its node's
CPUs. ``auto`` is ``interleave`` where there are several nodes: the index hands out slots with
no regard to which GPU will copy them, so with ``local`` shares half the copies of a two-node
host would still cross; interleaving spreads every GPU's traffic evenly over both links
instead of leaving it to where the daemon's thread happened to fault pages in. ``local`` is
there for when slots are handed out per GPU (``Placement.gpu_extents`` names each share).

``apply_memory`` sets the policy with ``mbind`` on the pool's mapping before its pages are
reserved (a shmem policy applies to pages allocated after it); ``pin_thread`` sets a thread's
CPU affinity. Both degrade loudly: a warning, and the daemon goes on unplaced.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger("kvpoold")

Mode = Literal["auto", "interleave", "local", "off"]

# linux/mempolicy.h
MPOL_PREFERRED, MPOL_INTERLEAVE = 1, 3
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


@dataclass(frozen=True)
class Topology:
    """NUMA nodes (node -> its CPUs) and each GPU's node (CUDA ordinal -> node, -1 unknown)."""

    nodes: dict[int, frozenset[int]]
    gpu_nodes: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Range:
    start: int                 # byte offsets into the pool segment, page-aligned
    end: int
    nodes: tuple[int, ...]     # one node: bound to it (preferred); several: interleaved


@dataclass(frozen=True)
class Placement:
    mode: str                                   # what was planned: interleave, local or off
    ranges: tuple[Range, ...] = ()
    gpu_extents: dict[int, tuple[int, int]] = field(default_factory=dict)   # [first, end)
    thread_cpus: dict[int, frozenset[int]] = field(default_factory=dict)    # per GPU
    why: str = ""

    def as_dict(self) -> dict:
        """For the log and benchmarks' JSON."""
        return {"mode": self.mode, "why": self.why,
                "ranges": [[r.start, r.end, list(r.nodes)] for r in self.ranges],
                "gpu_extents": {str(g): list(e) for g, e in self.gpu_extents.items()},
                "thread_cpus": {str(g): format_cpulist(c) for g, c in self.thread_cpus.items()}}


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def format_cpulist(cpus: frozenset[int] | set[int]) -> str:
    """``cpus`` as a cpulist (``0-3,8``), as /sys and taskset write it."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def read_topology(gpu_pci: dict[int, str], sys_root: str | Path = "/sys") -> Topology:
    """The host's nodes and the node of each GPU, given its PCI bus id (``0000:18:00.0``),
    from ``sys_root`` (tests point it at a fake tree)."""
    root = Path(sys_root)
    nodes = {}
    for d in sorted((root / "devices/system/node").glob("node[0-9]*")):
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    gpus = {}
    for ordinal, bus in gpu_pci.items():
        try:
            gpus[ordinal] = int((root / "bus/pci/devices" / bus.lower() / "numa_node").read_text())
        except (OSError, ValueError):
            gpus[ordinal] = -1
    return Topology(nodes, gpus)


def plan(topology: Topology, data_offset: int, num_extents: int, extent_bytes: int,
         mode: Mode = "auto") -> Placement:
    """The placement of a pool whose data area is ``num_extents`` extents of ``extent_bytes``
    from byte ``data_offset`` (pure: no system call)."""
    nodes = {n for n, cpus in topology.nodes.items() if cpus}
    if mode == "off":
        return Placement("off", why="numa_policy off")
    if len(nodes) < 2:
        return Placement("off", why=f"{len(nodes)} NUMA node(s) with CPUs: nothing to place")
    known = {g: n for g, n in topology.gpu_nodes.items() if n in nodes}
    threads = {g: topology.nodes[n] for g, n in known.items()}
    if not topology.gpu_nodes:
        return Placement("off", why="no GPU: the host path's engines are not placed")
    end = data_offset + num_extents * extent_bytes
    spread = tuple(sorted(set(known.values()) or nodes))
    if mode in ("auto", "interleave") or num_extents < len(topology.gpu_nodes):
        why = ("slots are handed out to any GPU: interleaved over the GPUs' nodes"
               if mode != "local" else "fewer extents than GPUs: interleaved")
        return Placement("interleave", (Range(data_offset, end, spread),), {}, threads, why)
    # local: equal whole-extent shares, GPUs of one node side by side (unknown nodes last)
    order = sorted(topology.gpu_nodes, key=lambda g: (known.get(g, 1 << 30), g))
    k = len(order)
    bounds = [num_extents * i // k for i in range(k + 1)]
    shares = {g: (bounds[i], bounds[i + 1]) for i, g in enumerate(order)}
    ranges: list[Range] = []
    for g in order:
        lo, hi = shares[g]
        r = Range(data_offset + lo * extent_bytes, data_offset + hi * extent_bytes,
                  (known[g],) if g in known else tuple(sorted(nodes)))
        if ranges and ranges[-1].nodes == r.nodes and ranges[-1].end == r.start:
            ranges[-1] = Range(ranges[-1].start, r.end, r.nodes)
        else:
            ranges.append(r)
    return Placement("local", tuple(ranges), shares, threads,
                     "each GPU's share on its node")


def _mbind(addr: int, length: int, mode: int, nodes: tuple[int, ...]) -> None:
    nr = _SYS_MBIND.get(platform.machine())
    if nr is None:
        raise OSError(f"mbind: unknown system call number on {platform.machine()}")
    bits = max(nodes) + 1
    words = -(-bits // 64)
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(addr), ctypes.c_ulong(length),
                      ctypes.c_int(mode), mask, ctypes.c_ulong(words * 64 + 1),
                      ctypes.c_uint(0))
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mbind: {os.strerror(e)}")


def apply_memory(placement: Placement, base_address: int) -> bool:
    """Set each range's policy on the pool mapped at ``base_address`` (pages allocated after
    this follow it); False, with a warning, where the kernel refuses."""
    try:
        for r in placement.ranges:
            _mbind(base_address + r.start, r.end - r.start,
                   MPOL_PREFERRED if len(r.nodes) == 1 else MPOL_INTERLEAVE, r.nodes)
    except OSError as e:
        log.warning("kvpool: could not place the pool on its GPUs' NUMA nodes (%s); it stays "
                    "where the kernel puts it: DMA across the socket link is slower", e)
        return False
    return True


def pin_thread(cpus: frozenset[int] | None, what: str) -> None:
    """Run the calling thread on ``cpus`` (None: leave it), or warn and leave it."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("kvpool: could not run %s on CPUs %s (%s); it runs anywhere", what,
                    format_cpulist(cpus), e)
