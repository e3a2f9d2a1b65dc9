"""vLLM's real scheduler on a CPU, stepped as the engine core steps it: the harness that drives a
connector's scheduler side with fake workers (``bench/vllm_scheduler.py``: ours;
``bench/connector_peer.py``: vLLM's own CPU offload connector).

The model is a tiny Llama described by its config alone (no weights, no tokenizer);
``vllm_config`` and ``kv_cache_config`` give what vLLM's engine core resolves for it and hands to
both roles of a connector. ``SchedulerDriver`` builds vLLM 0.33's ``Scheduler`` or
``AsyncScheduler`` (pure Python); ``AsyncScheduler`` is driven with a two-deep batch queue (step
N+1 is scheduled before step N's output is applied), as the engine core does with async
scheduling.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVEventsConfig,  # noqa: E402
                         KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, SlidingWindowSpec)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BS = 16
KV_HEADS, HEAD = 2, 16     # the model's KV heads (TINY_LLAMA), split over the TP ranks
EOS = 50256
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 51200,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "bos_token_id": 1, "eos_token_id": EOS, "torch_dtype": "float16",
              "tie_word_embeddings": False}


def model_dir(root: Path) -> str:
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


def fake_token(pos: int) -> int:
    """What the fake model samples at position ``pos`` (known before the scheduler hears it)."""
    return 1000 + pos % 997


def local_heads(tp: int) -> int:
    """KV heads per rank, as vLLM splits them (at least one: replicated past TP=KV_HEADS)."""
    return max(1, KV_HEADS // tp)


@dataclass
class Group:
    layers: list[str]
    sliding_window: int | None = None
    spec: object = None     # a KVCacheSpec taken as it is (a state group: bench/vllm_hybrid.py)


def vllm_config(root: Path, kv_transfer: KVTransferConfig, *, async_scheduling: bool, tp: int,
                num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                kv_events: bool, mamba_align: bool = False) -> VllmConfig:
    """vLLM's config of the tiny model on CPU with ``kv_transfer``'s connector: chunked prefill,
    prefix caching, ``num_blocks`` GPU blocks of ``BS`` tokens."""
    model = ModelConfig(model=model_dir(root), dtype="float16", seed=42, skip_tokenizer_init=True)
    cfg = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False,
                                         async_scheduling=async_scheduling),
        # A state group (vLLM's MambaSpec) needs the cache mode that keeps states per block.
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True,
                                 **({"mamba_cache_mode": "align", "mamba_block_size": BS}
                                    if mamba_align else {})),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig("cpu"),
        # vLLM's KV events on (published nowhere), so the connector reports its own.
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if kv_events else None)
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def kv_cache_config(groups: list[Group], tp: int, num_blocks: int, layout: str) -> KVCacheConfig:
    """What vLLM's engine core resolves and hands to both roles of a connector."""
    specs = []
    heads = local_heads(tp)
    for g in groups:
        if g.spec is not None:
            spec = g.spec
        elif g.sliding_window:
            spec = SlidingWindowSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD,
                                     dtype=torch.float16, sliding_window=g.sliding_window)
        else:
            spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD,
                                     dtype=torch.float16)
        specs.append(KVCacheGroupSpec(g.layers, spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs,
                         kv_cache_layout=layout)


@dataclass
class Stats:
    steps: int = 0
    idle_steps: int = 0        # steps that scheduled nothing (waiting on transfers)
    loaded_reqs: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    finished: list[str] = field(default_factory=list)
    params: dict[str, dict | None] = field(default_factory=dict)   # kv_transfer_params out
    scheduled: dict[str, int] = field(default_factory=dict)   # tokens computed per request
    max_steps: int = 5000


class SchedulerDriver:
    """vLLM's real scheduler (``Scheduler``, or ``AsyncScheduler`` driven two steps deep), stepped
    like the engine core steps it. Subclasses own the workers: ``_execute`` turns one step's
    scheduler output into the model runner's output, ``describe`` says what keeps them busy."""

    def __init__(self, cfg: VllmConfig, kv_cfg: KVCacheConfig, *, async_scheduling: bool,
                 step_s: float = 0.0) -> None:
        self.cfg, self.kv_cfg = cfg, kv_cfg
        cls = cfg.scheduler_config.get_scheduler_cls()
        self.sched = cls(vllm_config=cfg, kv_cache_config=kv_cfg, block_size=BS,
                         structured_output_manager=StructuredOutputManager(cfg), log_stats=True)
        self.is_async = async_scheduling
        assert type(self.sched).__name__ == ("AsyncScheduler" if async_scheduling else "Scheduler")
        # How long a step that computes something takes (a GPU step: 5-50 ms); a step with
        # nothing scheduled returns at once, as vLLM's engine core does.
        self.step_s = step_s
        self.stats = Stats()
        self._queue: list[tuple[object, ModelRunnerOutput]] = []
        self.preemptions: set[str] = set()
        init_none_hash(sha256)

    # ---- requests ------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4,
            cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_transfer_params}
                            if kv_transfer_params else None)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256),
                      cache_salt=cache_salt)
        self.sched.add_request(req)
        return req

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> None:
        """One engine-core step: schedule, execute; apply outputs one (sync) or two (async)
        steps deep."""
        so = self.sched.schedule()
        started = time.perf_counter()
        out = self._execute(so)
        if self.step_s and so.total_num_scheduled_tokens:
            # The model's forward pass: the connector's stores and loads overlap it.
            rest = self.step_s - (time.perf_counter() - started)
            if rest > 0:
                time.sleep(rest)
        self._queue.append((so, out))
        if not self.is_async or len(self._queue) > 1:
            self._apply(*self._queue.pop(0))
        self.stats.steps += 1
        if so.total_num_scheduled_tokens == 0:
            self.stats.idle_steps += 1
            time.sleep(0.0005)   # only transfers in flight: let the daemon work

    def drain_queue(self) -> None:
        while self._queue:
            self._apply(*self._queue.pop(0))

    def run(self, until=None, timeout_s: float = 60.0) -> None:
        """Step until ``until()`` (default: no requests and no pending work), bounded."""
        deadline = time.monotonic() + timeout_s
        done = until or (lambda: not self.sched.has_requests() and not self._queue)
        while not done():
            if not self.sched.has_requests() and self._queue:
                self.drain_queue()
                continue
            self.step()
            busy = self.stats.steps - self.stats.idle_steps
            if time.monotonic() > deadline or busy > self.stats.max_steps:
                raise AssertionError(f"engine did not settle after {self.stats.steps} steps: "
                                     f"{self.describe()}")
        if until is None:
            self.drain_queue()

    def _apply(self, so, out: ModelRunnerOutput) -> None:
        self.preemptions.update(so.preempted_req_ids or ())
        eco = self.sched.update_from_output(so, out)
        for outs in eco.values():
            for o in outs.outputs:
                if o.finished:
                    self.stats.finished.append(o.request_id)
                    self.stats.params[o.request_id] = o.kv_transfer_params

    def _execute(self, so) -> ModelRunnerOutput:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError
