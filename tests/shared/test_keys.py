import os
import subprocess
import sys

from kvpool.shared.keys import (chain_block_hashes, chain_seed, make_namespace,
                                request_block_hashes)

NS = make_namespace("meta-llama/Llama-3.1-8B", b"\x01" * 16)
TOKENS = list(range(1000, 1000 + 16 * 5 + 3))

SCRIPT = """
from kvpool.shared.keys import make_namespace, request_block_hashes
ns = make_namespace("meta-llama/Llama-3.1-8B", b"\\x01" * 16)
print(",".join(h.hex() for h in request_block_hashes(ns, list(range(1000, 1083)), 16, b"salt")))
"""


def test_hashes_equal_across_interpreters_with_different_hash_seeds():
    outs = set()
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert len(outs) == 1
    assert outs.pop() == ",".join(h.hex() for h in request_block_hashes(NS, TOKENS, 16, b"salt"))


def test_only_full_blocks_get_keys_and_a_prefix_is_a_leading_run():
    full = request_block_hashes(NS, TOKENS, 16)
    assert len(full) == 5 and all(len(h) == 16 for h in full)
    assert request_block_hashes(NS, TOKENS[:48], 16) == full[:3]
    changed = TOKENS.copy()
    changed[40] += 1          # inside block 2: blocks 0-1 equal, 2.. differ
    other = request_block_hashes(NS, changed, 16)
    assert other[:2] == full[:2] and all(a != b for a, b in zip(other[2:], full[2:]))


def test_chain_can_be_extended_incrementally():
    full = request_block_hashes(NS, TOKENS, 16)
    head = chain_block_hashes(TOKENS, 16, chain_seed(NS), start_block=0)[:2]
    tail = chain_block_hashes(TOKENS, 16, head[-1], start_block=2)
    assert head + tail == full


def test_salt_model_layout_and_extras_isolate():
    base = request_block_hashes(NS, TOKENS, 16)
    assert request_block_hashes(NS, TOKENS, 16, b"tenant-a") != base
    assert request_block_hashes(make_namespace("other", b"\x01" * 16), TOKENS, 16) != base
    assert request_block_hashes(make_namespace("meta-llama/Llama-3.1-8B", b"\x02" * 16),
                                TOKENS, 16) != base
    mm = chain_block_hashes(TOKENS, 16, chain_seed(NS), block_extras=[b"", b"image-hash"])
    assert mm[0] == base[0] and mm[1] != base[1]


def test_keys_are_a_persistent_format():
    # A pool outlives processes and kvpool versions (restarts adopt its blocks): the bytes a
    # key is made of never change without a new namespace version.
    ns = bytes(range(16))
    assert [h.hex() for h in request_block_hashes(ns, list(range(1000, 1040)), 16, b"salt")] \
        == ["95c880f53b3fe2d8c82ad1783192f23d", "226b16ab4641fc3de94544da0cb4ddcb"]
    extras = [b"img@0;", b"", b"x"]
    assert [h.hex() for h in chain_block_hashes(list(range(64)), 16, chain_seed(ns), 1, extras)] \
        == ["6fc8f173421ddd501160a462c1f238c3", "3c215bed3b975030fd60e045a85c2596",
            "d7ae008264fd29979e762a27136f0693"]
