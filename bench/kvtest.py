"""Helpers that tests and benchmarks share: a kvpoold subprocess on a temporary socket and pool,
and fake engine workers whose KV cache lives in host shm, registered with kvpool."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from bench.soak.common import LoggedProcess, wait_for
from kvpool.client.host_memory import SharedHostMemory
from kvpool.client.kv_layout import head_split, plan_kv_memory
from kvpool.client.worker import WorkerClient
from kvpool.shared.config import ClientConfig
from kvpool.shared.keys import make_namespace, request_block_hashes
from kvpool.shared.layout import Layout

STARTUP_TIMEOUT_S = 30.0


def keyed_store(sched, worker: WorkerClient, reg: int, namespace: bytes, block_ids: list[int],
                keys: list[bytes], wait_event: bytes = b"") -> int:
    """Submit a store of ``block_ids`` under ``keys`` through the one store path: tickets that
    ``sched`` (a SchedulerClient) reserves, named with their keys by ``worker``'s store. Keys
    the pool holds or has in flight are duplicates (not written again). Returns the job id."""
    grant = sched.reserve(namespace, len(keys))
    assert len(grant.slots) == len(keys), f"{len(grant.slots)} tickets for {len(keys)} keys"
    return worker.submit_store(reg, list(block_ids), grant.slots, wait_event, keys=list(keys),
                               grant=grant.daemon_id)


def unless_unavailable(fn: Callable[[], object]):
    """``fn()``, or None when the daemon is unavailable (for ``wait_for`` across restarts)."""
    from kvpool.shared.errors import DaemonUnavailable

    try:
        return fn()
    except DaemonUnavailable:
        return None


class DaemonProcess(LoggedProcess):
    """A kvpoold subprocess. ``start``/``stop``/``kill``/``restart`` keep socket and pool name."""

    def __init__(self, tmp: Path, pool_size: str = "64MiB", extra: list[str] | None = None) -> None:
        self.socket = str(tmp / "kvpoold.sock")
        self.pool_name = f"kvpool-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.pool_size = pool_size
        self.extra = list(extra or [])
        self.log_path = tmp / "kvpoold.log"
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        return [sys.executable, "-m", "kvpool.daemon", "--socket", self.socket,
                "--pool-name", self.pool_name, "--pool-size", self.pool_size,
                # 2 s: a client process busy on a loaded 2-core machine (building an engine,
                # importing torch) can miss heartbeats for over 500 ms; tests of the release
                # rule itself ask for a short timeout.
                "--extent-size", "1MiB", "--cuda", "off", "--peer-timeout-ms", "2000",
                "--log-level", "debug", "--metrics-port", "0", *self.extra]

    def start(self, extra: list[str] | None = None) -> "DaemonProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args() + list(extra or []), stdout=log, stderr=log)
        log.close()
        wait_for(lambda: self._answers() or self.proc.poll() is not None,
                 STARTUP_TIMEOUT_S, "kvpoold to answer a ping")
        if self.proc.poll() is not None:
            raise AssertionError(f"kvpoold exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def _answers(self) -> bool:
        """Whether the daemon serves yet. (Its socket file appears a moment before it listens,
        and clients fail fast on a socket nobody listens on.)"""
        from kvpool.client.scheduler import SchedulerClient
        from kvpool.shared.errors import DaemonUnavailable
        if not os.path.exists(self.socket):
            return False
        probe = SchedulerClient(self.client_config(timeout_ms=2000, reconnect_backoff_ms=0),
                                "test-probe", heartbeat=False)
        try:
            probe.ping()
            return True
        except DaemonUnavailable:
            return False
        finally:
            probe.close()

    def client_config(self, **kw) -> ClientConfig:
        kw.setdefault("timeout_ms", 3000)
        kw.setdefault("reconnect_backoff_ms", 50)
        return ClientConfig(socket=self.socket, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"kvpoold ignored signal {sig} for {timeout_s} s:\n{self.log()}")

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
        # A killed daemon leaves its socket file; a restarted one replaces it.

    def restart(self, extra: list[str] | None = None) -> "DaemonProcess":
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        return self.start(extra)

    def cleanup(self) -> None:
        self.kill_if_running()
        import posix_ipc
        from kvpool.shared.index_format import segment_name
        for name in ("/" + self.pool_name, segment_name(self.pool_name)):
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass



class HostKv:
    """KV caches shaped like vLLM FlashAttention's per-layer ``[2, blocks, tokens, heads, dim]``
    (fp16), all in one shm allocation, plus the layout and namespace they imply."""

    def __init__(self, layers: int = 2, blocks: int = 64, block_tokens: int = 16, heads: int = 2,
                 head_dim: int = 16, tp_size: int = 1, model: str = "test-model") -> None:
        self.block_tokens = block_tokens
        self.blocks = blocks
        nbytes = layers * 2 * blocks * block_tokens * heads * head_dim * 2
        self.mem = SharedHostMemory(nbytes)
        self.kv = self.mem.tensor.view(torch.float16).view(layers, 2, blocks, block_tokens, heads,
                                                           head_dim)
        plan = plan_kv_memory([self.kv[i] for i in range(layers)], [1] * layers,
                              [(self.mem.base_address, nbytes)])
        self.placement = plan.placement
        self.layout = Layout(block_tokens, tp_size, "float16", plan.segment_bytes,
                             f"test L{layers} flash")
        self.namespace = make_namespace(model, self.layout.fingerprint())

    def keys(self, tokens: list[int], salt: bytes = b"") -> list[bytes]:
        return request_block_hashes(self.namespace, tokens, self.block_tokens, salt)

    def fill_random(self, block_ids: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        idx = torch.tensor(block_ids)
        shape = list(self.kv[:, :, idx].shape)
        self.kv[:, :, idx] = torch.randn(shape, generator=g).half()

    def poison(self, block_ids: list[int]) -> None:
        self.kv[:, :, torch.tensor(block_ids)] = float("nan")

    def blocks_of(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv[:, :, torch.tensor(block_ids)].clone()

    def register(self, config: ClientConfig, tp_rank: int = 0, name: str = "worker",
                 engine_id: str = "") -> tuple[WorkerClient, int]:
        client = WorkerClient(config, name, engine_id)
        reg = client.register(self.namespace, self.layout, tp_rank, self.blocks, [self.mem.region],
                              self.placement)
        return client, reg

    def close(self) -> None:
        self.mem.close()


class PoolEngine:
    """A worker and a scheduler client over one HostKv, and every block stored, by key: what
    the tier tests store through a daemon and check after it came back from a tier.

    Each daemon life gets a new PoolEngine with a new HostKv (same layout, so same namespace):
    re-registering an old shm name after a restart would need the name to still exist, and on
    a shared test machine /dev/shm is not ours alone. Engines on two daemons share ``stored``
    to check that blocks stored on one load byte-exact on the other."""

    def __init__(self, daemon, stored: dict[bytes, torch.Tensor] | None = None,
                 **kv: int) -> None:
        from kvpool.client.scheduler import SchedulerClient
        self.kv = HostKv(**kv)
        self.worker, self.reg = self.kv.register(daemon.client_config(timeout_ms=10000))
        self.sched = SchedulerClient(daemon.client_config(timeout_ms=10000))
        self.stored: dict[bytes, torch.Tensor] = {} if stored is None else stored

    def store(self, first: int, n: int, seed: int) -> list[bytes]:
        """Store blocks of a new prompt (n full blocks, token ids from ``first``)."""
        keys = self.kv.keys(list(range(first, first + self.kv.block_tokens * n)))
        for a in range(0, n, 32):
            part = keys[a:a + 32]
            ids = list(range(len(part)))
            self.kv.fill_random(ids, seed=seed * 1000 + a)
            done = self.worker.wait([keyed_store(self.sched, self.worker, self.reg,
                                                 self.kv.namespace, ids, part)], 20)[0]
            assert done.ok, done
            for b, k in zip(ids, part):
                self.stored[k] = self.kv.blocks_of([b])
        return keys

    def load(self, keys: list[bytes]):
        """Look up ``keys`` (one prompt) and load its hit run 32 blocks at a time into blocks
        32.. (poisoned first), naming each block's key (a lower tier's hits have ref 0); returns (hits, the failed JobCompletion or None). Every block
        of a load that succeeded must equal what was stored."""
        hit = self.sched.lookup(self.kv.namespace, [keys], pin=True)
        n = hit.hits[0]
        try:
            for a in range(0, n, 32):
                refs = hit.slots[0][a:a + 32]
                ids = list(range(32, 32 + len(refs)))
                self.kv.poison(ids)
                done = self.worker.wait([self.worker.submit_load(self.reg, refs, ids,
                                                                 keys[a:a + len(refs)])], 30)[0]
                if not done.ok or done.failed:
                    return n, done
                for b, k in zip(ids, keys[a:a + 32]):
                    assert torch.equal(self.kv.blocks_of([b]), self.stored[k]), \
                        f"block {keys.index(k)} came back different from what was stored"
        finally:
            self.sched.release(hit.leases)
        return n, None

    def load_and_check(self, keys: list[bytes]) -> int:
        """``load`` that must succeed; returns the hit count."""
        n, failed = self.load(keys)
        assert failed is None, failed
        return n

    def tier(self, name: str | None = None):
        """The first tier under the pool, or the one called ``name``."""
        tiers = self.sched.info().tiers
        return tiers[0] if name is None else next(t for t in tiers if t.name == name)

    def close(self) -> None:
        self.worker.close()
        self.sched.close()
        self.kv.close()


# vLLM's KVCacheLayout stride orders over the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
STRIDE_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                 "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def model_kv(block: int, seed: int, layers: int, heads: int, tokens: int, cell: int
             ) -> torch.Tensor:
    """The KV of one block of a model with ``heads`` KV heads, as every rank of any TP size
    must see it: [layers, heads, tokens, cell] fp16, a function of (seed, block) only."""
    g = torch.Generator().manual_seed(seed * 100_003 + block)
    return torch.randn((layers, heads, tokens, cell), generator=g).half()


class HeadKv:
    """One TP rank of a model with ``heads`` KV heads: vLLM 0.33-style layer views
    ``[blocks, local heads, tokens, cell]`` (fp16; a cell is one token's K and V of a head) in
    the physical order of ``order`` (a ``KVCacheLayout`` name), in one shm allocation, with
    its head-split layout. Ranks of any TP size of one model share ``namespace``."""

    def __init__(self, tp_size: int = 1, tp_rank: int = 0, heads: int = 4, layers: int = 2,
                 blocks: int = 32, block_tokens: int = 16, cell: int = 32, order: str = "LBNHC",
                 model: str = "test-model") -> None:
        self.tp_size, self.tp_rank, self.heads = tp_size, tp_rank, heads
        self.layers, self.blocks, self.block_tokens, self.cell = layers, blocks, block_tokens, cell
        self.local = max(1, heads // tp_size)
        h0 = tp_rank * heads // tp_size if tp_size > heads else tp_rank * self.local
        self.head_range = (h0, h0 + self.local)
        shape = (layers, blocks, self.local, block_tokens, cell)
        so = STRIDE_ORDERS[order]
        nbytes = 2 * int(torch.tensor(shape).prod())
        self.mem = SharedHostMemory(nbytes)
        phys = self.mem.tensor.view(torch.float16).view(*[shape[d] for d in so])
        logical = phys.permute(*[so.index(d) for d in range(5)])
        self.kv = [logical[i] for i in range(layers)]          # [B, H, N, C] per layer
        plan = plan_kv_memory(self.kv, [0] * layers, [(self.mem.base_address, nbytes)])
        self.placement = plan.placement
        hb = head_split(self.kv, [0] * layers, [1] * layers, heads, tp_size,
                        sum(plan.segment_bytes))
        assert hb, f"{order} should split by heads"
        self.layout = Layout(block_tokens, tp_size, "float16", plan.segment_bytes,
                             f"test L{layers} H{heads} C{cell} {order}", heads, hb)
        self.namespace = make_namespace(model, self.layout.fingerprint())

    def keys(self, tokens: list[int], salt: bytes = b"") -> list[bytes]:
        return request_block_hashes(self.namespace, tokens, self.block_tokens, salt)

    def fill(self, block_ids: list[int], seed: int) -> None:
        """Write this rank's heads of the model's KV of ``seed`` into ``block_ids``."""
        h0, h1 = self.head_range
        for b in block_ids:
            want = model_kv(b, seed, self.layers, self.heads, self.block_tokens, self.cell)
            for layer, view in enumerate(self.kv):
                view[b] = want[layer, h0:h1]

    def poison(self, block_ids: list[int]) -> None:
        for view in self.kv:
            view[torch.tensor(block_ids)] = float("nan")

    def check(self, block_ids: list[int], seed: int, stored_as: list[int]) -> None:
        """Assert ``block_ids`` hold this rank's heads of what was filled as ``stored_as``."""
        h0, h1 = self.head_range
        for b, src in zip(block_ids, stored_as):
            want = model_kv(src, seed, self.layers, self.heads, self.block_tokens, self.cell)
            for layer, view in enumerate(self.kv):
                assert torch.equal(view[b], want[layer, h0:h1]), (
                    f"TP={self.tp_size} rank {self.tp_rank}: block {b} layer {layer} differs "
                    f"from heads {h0}-{h1} of block {src} as stored")

    def register(self, config: ClientConfig, name: str = "worker") -> tuple[WorkerClient, int]:
        client = WorkerClient(config, f"{name} tp{self.tp_rank}/{self.tp_size}")
        reg = client.register(self.namespace, self.layout, self.tp_rank, self.blocks,
                              [self.mem.region], self.placement)
        return client, reg

    def close(self) -> None:
        self.mem.close()
