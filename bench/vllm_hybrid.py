"""A hybrid model for ``bench.vllm_scheduler``'s fake engine: full attention, sliding window and
a recurrent-state group (vLLM's ``MambaSpec`` in ``mamba_cache_mode="align"``).

``HybridWorker`` lays a state layer out as vLLM does (one int8 ``[num_blocks, 1, 1, state
bytes]`` view per layer, blocks a padded page apart) and runs a fake recurrent model on it, the
way vLLM's align mode drives a real one: a scheduled chunk ``[start, start + n)`` reads the
state after ``start`` tokens from the request's block ``(start - 1) // block_size`` (none for
``start == 0``), folds its tokens in, and writes the state after ``start + n`` tokens into block
``(start + n - 1) // block_size``. Before folding, it checks that the state it read is the one
the request's tokens give: a request resumed from a wrong or empty state (attention restored
without its state) fails the test at once, as would a real model's output, silently. Every
state block a load brings back is checked the same way.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import MambaSpec

from bench.vllm_scheduler import BS, FakeWorker, Group
from kvpool.client.host_memory import SharedHostMemory

STATE_WORDS = 24            # int32 words of one layer's fake state on one rank
STATE_BYTES = 4 * STATE_WORDS
STATE_PAGE = 4 * STATE_BYTES    # padded, as vLLM pads a state page to the attention page
_MOD = (1 << 31) - 1


def state_spec() -> MambaSpec:
    """A state group's spec: two tensors (a conv-like and a recurrent one), 96 bytes."""
    return MambaSpec(block_size=BS, shapes=((2, 4), (4, 4)),
                     dtypes=(torch.int32, torch.int32), mamba_cache_mode="align",
                     page_size_padded=STATE_PAGE)


def hybrid_groups(window: int = 32) -> list[Group]:
    """Full attention, a sliding window and a recurrent state: one layer each."""
    return [Group(["model.layers.0.self_attn"]),
            Group(["model.layers.1.self_attn"], sliding_window=window),
            Group(["model.layers.2.linear_attn"], spec=state_spec())]


def fake_state(tokens: list[int], layer: int, rank: int) -> list[int]:
    """The fake model's state after ``tokens`` (what every rank-and-layer shard holds)."""
    return advance(initial_state(layer, rank), tokens, 0, layer, rank)


def initial_state(layer: int, rank: int) -> list[int]:
    return [(layer * 131 + rank * 71 + j * 7 + 1) % _MOD for j in range(STATE_WORDS)]


def advance(state: list[int], tokens: list[int], first_pos: int, layer: int,
            rank: int) -> list[int]:
    """Fold ``tokens`` (at positions ``first_pos``...) into ``state``."""
    s = list(state)
    for p, t in enumerate(tokens, first_pos):
        mix = t * 31 + p * 7 + layer * 13 + rank * 17
        s = [(x * 1_000_003 + mix * (j + 1)) % _MOD for j, x in enumerate(s)]
    return s


class HybridWorker(FakeWorker):
    """A ``FakeWorker`` whose state groups run the fake recurrent model (module docstring)."""

    def _allocate(self, nb: int, local: int, block_outermost: bool) -> dict[str, torch.Tensor]:
        kv = super()._allocate(nb, local, block_outermost)
        self.verified_states = 0
        states = [name for g in self.groups if g.spec is not None for name in g.layers]
        # (whole pages: the daemon maps the segment as /proc/self/maps shows it)
        self.state_mem = SharedHostMemory(-(-len(states) * nb * STATE_PAGE // 4096) * 4096)
        raw = self.state_mem.tensor[:len(states) * nb * STATE_PAGE].view(len(states), nb,
                                                                           STATE_PAGE)
        # vLLM hands a connector each state layer as int8 [num_blocks, 1, 1, state bytes].
        self.states = {name: raw[i, :, :STATE_BYTES].view(torch.int32)
                       for i, name in enumerate(states)}
        kv.update((name, raw[i, :, :STATE_BYTES].view(nb, 1, 1, STATE_BYTES))
                  for i, name in enumerate(states))
        return kv

    def write(self, block_table: tuple[list[int], ...], tokens: list[int], start: int,
              n: int) -> None:
        super().write(tuple(ids if g.spec is None else [0] * len(ids)
                            for g, ids in zip(self.groups, block_table)), tokens, start, n)
        for gi, g in enumerate(self.groups):
            if g.spec is None:
                continue
            ids = block_table[gi]
            dst = ids[(start + n - 1) // BS]
            assert dst, f"rank {self.rank}: no state block for tokens up to {start + n}"
            for name in g.layers:
                layer = self.layers.index(name)
                if start:
                    src = ids[(start - 1) // BS]
                    assert src, (f"rank {self.rank}: no state block to resume from at token "
                                 f"{start}: {ids}")
                    state = self.states[name][src].tolist()
                    want = fake_state(tokens[:start], layer, self.rank)
                    assert state == want, (
                        f"rank {self.rank}: layer {name} resumed at token {start} from a "
                        f"state that is not its tokens' (block {src})")
                else:
                    state = initial_state(layer, self.rank)
                new = advance(state, tokens[start:start + n], start, layer, self.rank)
                self.states[name][dst] = torch.tensor(new, dtype=torch.int32)

    def check_block(self, gi: int, bid: int, index: int, tokens: list[int]) -> None:
        g = self.groups[gi]
        if g.spec is None:
            return super().check_block(gi, bid, index, tokens)
        for name in g.layers:
            layer = self.layers.index(name)
            want = fake_state(tokens[:(index + 1) * BS], layer, self.rank)
            assert self.states[name][bid].tolist() == want, (
                f"rank {self.rank}: loaded state block {bid} (request block {index}) of "
                f"{name} is not the state after its {(index + 1) * BS} tokens")
        self.verified_states += 1
        self.verified_blocks += 1

    def close(self) -> None:
        super().close()
        self.state_mem.close()
