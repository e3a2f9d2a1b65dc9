"""A stand-in vLLM worker for GPU tests and the GPU benchmark: a separate process that owns KV
tensors on one GPU, exports them over CUDA IPC and answers commands over a pipe.

Layouts are given as one contiguous allocation ``[lead, num_blocks, inner]`` in bytes (all the
vLLM shapes reduce to this): per-layer FlashAttention ``[L, 2, NB, N, H, C]`` has lead = 2L
segments of N*H*C*2 bytes; block-outermost ``[NB, L, 2, N, H, C]`` has lead = 1; MLA
``[L, NB, N, 576]`` has lead = L. Segment ``i`` of block ``b`` sits at ``(i*NB + b) * inner``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any

# name -> (lead segments, inner bytes) for a 16-token block of Llama-3.1-8B (8 KV heads,
# head dim 128, bf16) or DeepSeek-style MLA (576 latent, bf16).
LAYOUTS = {
    "per_layer": (64, 16 * 8 * 128 * 2),        # LBNHC-style: 64 x 32 KiB per block
    "block_outer": (1, 64 * 16 * 8 * 128 * 2),  # BLNHC-style: one 2 MiB chunk per block
    "per_head": (512, 16 * 128 * 2),            # LHBNC-style: 512 x 4 KiB per block
    "mla": (61, 16 * 576 * 2),                  # 61 layers x 18 KiB per block
}


@dataclass
class Exported:
    regions: list
    placement: list
    segment_bytes: tuple
    num_blocks: int
    pid: int


def placement_for(lead: int, inner: int, num_blocks: int) -> tuple[list, tuple]:
    from kvpool.shared.layout import SegmentPlacement
    placement = [SegmentPlacement(0, i * num_blocks * inner, inner) for i in range(lead)]
    return placement, (inner,) * lead


def _serve(conn: Any, device: int, layout: str, num_blocks: int) -> None:
    import torch

    from kvpool.client.cuda_export import LoadEvents, StoreEvents, export_regions
    torch.cuda.set_device(device)
    lead, inner = LAYOUTS[layout]
    kv = torch.empty(lead * num_blocks * inner, dtype=torch.uint8, device=f"cuda:{device}")
    view = kv.view(lead, num_blocks, inner)
    regions, _ = export_regions([kv])
    placement, seg_bytes = placement_for(lead, inner, num_blocks)
    store_events = StoreEvents()
    load_events = LoadEvents(torch.device(f"cuda:{device}"))
    conn.send(Exported(regions, placement, seg_bytes, num_blocks, os.getpid()))
    gen = torch.Generator(device=f"cuda:{device}")
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            conn.send(None)
            return
        if cmd == "fill":            # random bytes, as int64 words (fast on the GPU)
            gen.manual_seed(args[0])
            w = kv.view(torch.int64)
            w.random_(generator=gen)
            torch.cuda.synchronize()
            conn.send(None)
        elif cmd == "poison":
            kv.fill_(args[0])
            torch.cuda.synchronize()
            conn.send(None)
        elif cmd == "blocks":        # the shard bytes of these blocks, segment order
            idx = torch.as_tensor(args[0], device=kv.device)
            conn.send(view[:, idx, :].permute(1, 0, 2).contiguous().cpu().numpy())
        elif cmd == "count":         # bytes equal to ``value`` over the whole cache
            conn.send(int((kv == args[0]).sum().item()))
        elif cmd == "event":         # a store's wait event, recorded after some GPU work
            kv[:16].add_(0)
            conn.send(store_events.record())
        elif cmd == "wait_load":
            load_events.wait(args[0])
            torch.cuda.current_stream().synchronize()
            conn.send(None)
        elif cmd == "gemm":          # (iterations) -> seconds for the loop, bf16 8192^3
            n = 8192
            a = torch.randn(n, n, device=kv.device, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=kv.device, dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            conn.send("ready")
            conn.recv()
            t0 = time.perf_counter()
            for _ in range(args[0]):
                a @ b
            torch.cuda.synchronize()
            conn.send(time.perf_counter() - t0)
        elif cmd == "mem_free":
            conn.send(torch.cuda.mem_get_info()[0])
        else:
            conn.send(RuntimeError(f"unknown command {cmd}"))


class Worker:
    """Parent-side handle: ``Worker(device, layout, num_blocks)`` starts the process."""

    def __init__(self, device: int, layout: str, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, device, layout, num_blocks),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError("GPU worker did not start within 120 s")
        self.export: Exported = self.conn.recv()

    def call(self, *cmd: Any, timeout_s: float = 120) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"GPU worker did not answer {cmd[0]!r} within {timeout_s} s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def register_request(self, namespace: bytes = b"ns", tp_rank: int = 0, tp_size: int = 1,
                         dtype: str = "uint8") -> Any:
        from kvpool.shared.layout import Layout
        from kvpool.shared.protocol import RegisterRequest
        e = self.export
        layout = Layout(block_tokens=16, tp_size=tp_size, dtype=dtype,
                        segment_bytes=tuple(e.segment_bytes))
        return RegisterRequest(req_id=1, namespace=namespace, layout=layout, tp_rank=tp_rank,
                               num_blocks=e.num_blocks, regions=list(e.regions),
                               placement=list(e.placement))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=30)
            except (TimeoutError, EOFError, BrokenPipeError):
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


class ShmPool:
    """A Pool-like buffer for driving the engine without the daemon: a POSIX shm file,
    mapped, with ``base_address`` and ``nbytes`` (what ``CudaCopyEngine`` reads)."""

    def __init__(self, nbytes: int, name: str = "") -> None:
        import ctypes
        import mmap
        self.path = f"/dev/shm/{name or f'kvpool-gputest-{os.getpid()}'}"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.buffer = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self._anchor = ctypes.c_char.from_buffer(self.buffer)
        self.base_address = ctypes.addressof(self._anchor)

    def array(self):
        import numpy as np
        return np.frombuffer(self.buffer, dtype=np.uint8)

    def close(self) -> None:
        del self._anchor
        self.buffer.close()
        os.unlink(self.path)
