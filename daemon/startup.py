"""Wiring: open the pool, the tiers under it (disk, then remote), the copy engines the host
supports; run the server.

Kept apart from the CLI so tests and embedders can start a daemon from a ``DaemonConfig``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import resource
import signal
import threading

# Imported before the socket is bound: ``np.unique`` (a registration's tables) imports
# ``numpy.ma`` on its first call, ~50 ms with the GIL held on a loaded 2-core host, and nothing
# may hold the event loop that long once clients can reach it (issue 36;
# tests/integration/test_event_loop.py).
import numpy.ma  # noqa: F401

from kvpool.daemon import log_queue, numa
from kvpool.daemon.copy_engine import CopyEngine
from kvpool.daemon.events import check_topic
from kvpool.daemon.host_copy import HostCopyEngine
from kvpool.daemon.loop_cpu import LoopCpu, check_loop_cpu
from kvpool.daemon.peer import AllowList
from kvpool.daemon.pool import Pool, check_room
from kvpool.daemon.tier import LowerTier
from kvpool.shared.config import DaemonConfig
from kvpool.shared.errors import ConfigError
from kvpool.shared.protocol import CudaRegion, HostRegion

log = logging.getLogger("kvpoold")

_CUDA_MISSING = "cuda=on but CUDA is not available to kvpoold (auto serves without it)"


def check_config(config: DaemonConfig) -> None:
    """Every refusal a start makes before it takes anything, as a ``ConfigError`` that names
    the setting; ``kvpoold --check-config`` makes the same call. Checked against this host:
    the pool and extent sizes (and that /dev/shm can hold the pool), the ``allow_uid`` and
    ``allow_gid`` names, the events topic, the remote store's URL, its master's name and the
    Mooncake install, and CUDA with ``cuda=on``. What a start takes (the socket, the pool, the
    metrics port, the events endpoint, ``disk_path``) is only tried by the start."""
    check_room(config)
    AllowList(config.allow_uid, config.allow_gid)
    check_topic(config.events_topic)
    if config.remote_store:
        from kvpool.daemon.remote_url import MOONCAKE_MISSING, parse_remote_url, resolve_local
        resolve_local(parse_remote_url(config.remote_store))
        if importlib.util.find_spec("mooncake") is None:
            raise ConfigError(MOONCAKE_MISSING)
    if config.cuda == "on" and not cuda_available():
        raise ConfigError(_CUDA_MISSING)
    if config.loop_cpu >= 0:
        check_loop_cpu(config.loop_cpu)


def cuda_available() -> bool:
    """Whether copy engines can use CUDA: the driver first (ctypes, milliseconds: a host
    without CUDA never imports torch, the bulk of a CPU daemon's start time), then torch, which
    must see it too. A broken CUDA install counts as none."""
    from kvpool.daemon import cuda
    try:
        if not cuda.is_available():
            return False
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def build_engines(config: DaemonConfig, pool: Pool,
                  thread_cpus: dict[int, frozenset[int]] | None = None
                  ) -> dict[type, CopyEngine]:
    trace = bool(config.trace)
    engines: dict[type, CopyEngine] = {HostRegion: HostCopyEngine(
        pool, config.copy_threads, chunk_blocks=config.chunk_blocks, trace=trace)}
    if config.cuda == "off":
        return engines
    if not cuda_available():
        if config.cuda == "on":
            raise ConfigError(_CUDA_MISSING)
        log.info("no CUDA: serving the host transfer path only")
        return engines
    try:
        from kvpool.daemon.cuda_copy import CudaCopyEngine
    except ImportError as e:
        if config.cuda == "on":
            raise
        log.warning("CUDA copy engine unavailable (%s): serving the host path only", e)
        return engines
    engines[CudaRegion] = CudaCopyEngine(pool, chunk_blocks=config.chunk_blocks, trace=trace,
                                         thread_cpus=thread_cpus)
    return engines


def raise_open_file_limit() -> None:
    """Every client connection is a file descriptor (two per engine process with heartbeats):
    a soft limit of 1024, what a login shell or a container often gives, would turn client
    number ~500 away. Raise it to the hard limit, which needs no privilege."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d: %s", soft, e)


def open_lower_tiers(config: DaemonConfig, pool: Pool) -> list[LowerTier]:
    """The tiers under the pool, in the order lookups ask them: the disk tier when
    ``disk_path`` is set (its startup scan runs here, before serving), then the remote tier
    when ``remote_store`` is set (its URL is checked here; it connects once serving)."""
    lowers: list[LowerTier] = []
    remote = None
    if config.remote_store:      # first: it holds nothing yet if the disk tier fails to open
        from kvpool.daemon.remote_tier import RemoteTier
        remote = RemoteTier.open(config, pool.buffer)
    if config.disk_path:
        from kvpool.daemon.disk_tier import DiskTier
        lowers.append(DiskTier.open(config.disk_path, config.disk_size, pool.buffer,
                                    pool.nbytes))
    if remote is not None:
        lowers.append(remote)
    return lowers


class _StopRequested(BaseException):
    """SIGTERM or SIGINT before the server's loop took over those signals. Not an
    ``Exception``: raised wherever the main thread is, it must not be swallowed by an
    ``except Exception`` there (logging's handlers catch those; a stop that came while the
    start logged went unseen, and the daemon served on)."""


def _stop_requested(signum: int, frame) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def numa_topology(config: DaemonConfig) -> numa.Topology:
    """The host's NUMA nodes, and each GPU's where there are several nodes and CUDA may be used
    (the driver through ctypes: milliseconds, no torch)."""
    topology = numa.read_topology({})
    if len(topology.nodes) < 2 or config.numa_policy == "off" or config.cuda == "off":
        return topology
    try:
        from kvpool.daemon import cuda
        if not cuda.is_available():
            return topology
        buses = {i: cuda.pci_bus_id(i) for i in range(cuda.device_count())}
    except Exception as e:   # noqa: BLE001 - placement is an optimisation
        log.warning("cannot read the GPUs' PCI addresses (%s): the pool is not NUMA-placed", e)
        return topology
    return numa.read_topology(buses)


def run_daemon(config: DaemonConfig) -> int:
    """Start and serve until stopped; returns the exit code. Every way out of the start leaves
    nothing behind in /dev/shm but an adopted pool the operator keeps (``keep_pool``): a stop
    signal before the server's loop handles them raises here (their default action would end
    the process with the pool in place) and unwinds through the same clean-up as a failure."""
    from kvpool.daemon.server import Server, run
    raise_open_file_limit()
    topology = numa_topology(config)
    placed: list[numa.Placement] = []

    def place(base_address: int, geometry) -> None:
        p = numa.plan(topology, geometry.data_offset, geometry.num_extents,
                      geometry.extent_bytes, config.numa_policy)
        if p.ranges:
            numa.apply_memory(p, base_address)
        placed.append(p)
        log.info("numa placement: %s", json.dumps(p.as_dict()))

    previous = {sig: signal.signal(sig, _stop_requested) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        pool = Pool.open(config, place)
        loop_cpu: LoopCpu | None = None
        try:
            if config.loop_cpu >= 0:
                loop_cpu = LoopCpu(config.loop_cpu)
                loop_cpu.start()        # this thread runs the server's loop
            engines = build_engines(config, pool, placed[0].thread_cpus if placed else None)
            lowers = open_lower_tiers(config, pool)
            server = Server(config, pool, engines, lowers)
        except BaseException:
            if loop_cpu is not None:
                loop_cpu.stop()
            pool.close(unlink=not (config.keep_pool and pool.adopted))
            raise
        try:
            code = run(server)
        finally:
            if loop_cpu is not None:
                loop_cpu.stop()
    except _StopRequested as e:
        log.info("stopped by %s before serving; nothing left behind", e)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    lingering = [t.name for t in threading.enumerate()
                 if not t.daemon and t is not threading.main_thread() and t.is_alive()]
    if lingering or any(lower.has_lingering_work for lower in lowers):
        # The pool, socket and lock are released already; what is left would only make the
        # interpreter's exit join threads: one stuck on a remote peer (see RemoteTier.close).
        log.info("exiting without waiting for %s", ", ".join(lingering) or "the remote tier")
        log_queue.stop()
        logging.shutdown()
        os._exit(code)
    return code
