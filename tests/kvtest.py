"""Test helpers: a fake engine worker whose KV cache lives in host shm, registered with kvpool."""

from __future__ import annotations

import torch

from kvpool.client.host_memory import SharedHostMemory
from kvpool.client.kv_layout import plan_kv_memory
from kvpool.client.worker import WorkerClient
from kvpool.shared.config import ClientConfig
from kvpool.shared.keys import make_namespace, request_block_hashes
from kvpool.shared.layout import Layout


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

    def register(self, config: ClientConfig, tp_rank: int = 0, name: str = "worker"
                 ) -> tuple[WorkerClient, int]:
        client = WorkerClient(config, name)
        reg = client.register(self.namespace, self.layout, tp_rank, self.blocks, [self.mem.region],
                              self.placement)
        return client, reg

    def close(self) -> None:
        self.mem.close()
