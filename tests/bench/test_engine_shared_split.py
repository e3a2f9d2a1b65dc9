"""The shared-vs-split workload's requests: every prefix recurs, reaches both engines, each
request has a suffix of its own, and a seed gives the same order and routing to both arms."""

import itertools
import random

from bench.engine_shared_split import BLOCK_TOKENS, full_blocks, plan_requests, ratios


def test_every_prefix_recurs_on_both_engines_in_a_random_order():
    reqs = plan_requests(random.Random(7), prefixes=4, repeats=4, prefix_tokens=512,
                         suffix_tokens=128, vocab=1000)
    assert len(reqs) == 16 and {e for e, _ in reqs} == {0, 1}
    heads: dict[tuple, set] = {}
    for engine, prompt in reqs:
        assert len(prompt) == 640
        heads.setdefault(tuple(prompt[:512]), set()).add(engine)
    assert len(heads) == 4 and all(engines == {0, 1} for engines in heads.values())
    assert len({tuple(p[512:]) for _, p in reqs}) == 16          # suffixes all differ
    # shuffled: the repeats of a prefix are not all back to back
    runs = [k for k, _ in itertools.groupby(tuple(p[:512]) for _, p in reqs)]
    assert len(runs) > 4
    assert full_blocks(reqs) == 16 * 640 // BLOCK_TOKENS
    again = plan_requests(random.Random(7), 4, 4, 512, 128, 1000)
    assert again == reqs                                         # same for both arms


def test_the_ratios_read_shared_over_split():
    r = ratios({"shared": {"hit_rate": 0.6, "mean_ttft_s": 1.0},
                "split": {"hit_rate": 0.3, "mean_ttft_s": 1.5}})
    assert r == {"shared_pool_hit_ratio": 2.0, "shared_vs_split_ttft_speedup": 1.5}
