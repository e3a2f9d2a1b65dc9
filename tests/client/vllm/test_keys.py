"""Pool keys of vLLM requests: deterministic across processes, isolating what changes the KV."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpool.client.vllm.keys import GroupInfo, RequestKeys  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
FULL = GroupInfo(0, b"n" * 16, "full", BS, ("l0",), None)
SWA = GroupInfo(1, b"s" * 16, "swa", BS, ("l1",), 40)


def request(tokens, **kw) -> Request:
    return Request(request_id="r", prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None, **kw)


def keys(req: Request, n: int, group: int = 0) -> list[bytes]:
    return RequestKeys(req, [FULL, SWA]).keys(req, group, n)


def test_keys_chain_over_tokens_and_differ_per_group():
    a = keys(request(range(64)), 4)
    assert len(a) == 4 and len(set(a)) == 4
    b = keys(request(list(range(48)) + [7] * 16), 4)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert keys(request(range(64)), 4, group=1) != a


def test_keys_are_extended_incrementally_and_equal_a_fresh_computation():
    req = request(range(80))
    rk = RequestKeys(req, [FULL])
    first = rk.keys(req, 0, 2)
    assert rk.keys(req, 0, 5)[:2] == first
    assert rk.keys(req, 0, 5) == RequestKeys(req, [FULL]).keys(req, 0, 5)


def test_salt_and_lora_change_every_key():
    base = keys(request(range(48)), 3)
    salted = keys(request(range(48), cache_salt="tenant"), 3)
    lora = keys(request(range(48), lora_request=LoRARequest("adapter", 1, "/a")), 3)
    other = keys(request(range(48), lora_request=LoRARequest("other", 2, "/b")), 3)
    assert not set(base) & set(salted)
    assert not set(base) & set(lora) and not set(lora) & set(other)


def test_multimodal_inputs_change_keys_from_their_first_block():
    def with_image(ident: str) -> list[bytes]:
        f = MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=20, length=10))
        return keys(request([0] * 64, mm_features=[f]), 4)

    plain = keys(request([0] * 64), 4)
    a, b = with_image("img-a"), with_image("img-b")
    assert a[0] == plain[0] == b[0]              # block 0 holds no image token
    assert a[1] != b[1] and a[1] != plain[1]     # block 1 does; the chain carries it on
    assert a[3] != b[3]


def test_sliding_window_needs_only_its_window():
    assert FULL.window_blocks is None
    assert SWA.window_blocks == 4                 # 39 tokens back from a block start: 3 more


def test_keys_do_not_depend_on_the_process_hash_seed():
    # A stand-in with the Request attributes the keys read keeps vLLM out of the subprocesses.
    code = textwrap.dedent("""
        from types import SimpleNamespace
        from kvpool.client.vllm.keys import GroupInfo, RequestKeys
        g = GroupInfo(0, b"n" * 16, "full", 16, ("l0",), None)
        r = SimpleNamespace(all_token_ids=list(range(64)), cache_salt="s", lora_request=None,
                            mm_features=[], prompt_embeds=None)
        print(b"".join(RequestKeys(r, [g]).keys(r, 0, 4)).hex())
    """)
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
                           check=True, timeout=60).stdout.strip()
            for seed in ("1", "2")}
    assert len(outs) == 1
    assert outs.pop() == b"".join(keys(request(range(64), cache_salt="s"), 4)).hex()


def test_importing_the_connector_loads_no_daemon_and_no_cuda_code():
    code = ("import sys, kvpool.client.vllm.connector, kvpool.client.vllm.scheduler\n"
            "bad = [m for m in sys.modules if m.startswith('kvpool.daemon') "
            "or m.endswith('cuda_export')]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip().splitlines()[-1]
    assert out == "[]"
