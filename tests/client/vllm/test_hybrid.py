"""The all-or-none hit rule of hybrid models (``client/vllm/hybrid.py``), exhaustively over small
cases against its definition, and the per-key lookups of state groups."""

from __future__ import annotations

import itertools

from kvpool.client.vllm.hybrid import (MISSING, GroupAnswer, Resume, keep_resume_lease,
                                       merge_state_answer, resume_blocks, state_key_lists)

TARGET = 6


def run(n: int, start: int = 0, end: int = TARGET) -> GroupAnswer:
    """A run lookup's answer: blocks [start, start + n) held."""
    return GroupAnswer(start, end, list(range(100 + start, 100 + start + n)))


def keys(held: set[int], start: int = 0, end: int = TARGET) -> GroupAnswer:
    """A state group's per-key answer: the blocks in ``held`` (within [start, end))."""
    return GroupAnswer(start, end, [200 + b if b in held else MISSING for b in range(start, end)])


def defined(full_runs: list[int], states: list[set[int]], target: int) -> int:
    """The rule as the issue states it: the longest h <= target at which every full group holds
    [0, h) and every state group the state at h's end (block h - 1); else 0."""
    ok = [h for h in range(1, target + 1)
          if all(n >= h for n in full_runs) and all(h - 1 in s for s in states)]
    return max(ok, default=0)


def test_every_full_and_state_pattern_against_the_definition():
    # One full group (every run length) and one or two state groups (every subset of kept
    # boundaries): 7 x 64 + 7 x 64 x 64 cases.
    blocks = range(TARGET)
    subsets = [set(c) for r in range(TARGET + 1) for c in itertools.combinations(blocks, r)]
    cases = 0
    for n in range(TARGET + 1):
        for s1 in subsets:
            got = resume_blocks(["full", "state"], [None, None], [run(n), keys(s1)], TARGET,
                                retried=False)
            assert got == Resume(defined([n], [s1], TARGET)), (n, s1, got)
            cases += 1
            for s2 in subsets[::7]:
                got = resume_blocks(["state", "full", "state"], [None, None, None],
                                    [keys(s1), run(n), keys(s2)], TARGET, retried=False)
                assert got == Resume(defined([n], [s1, s2], TARGET)), (n, s1, s2, got)
                cases += 1
    assert cases > 1000


def test_a_state_that_misses_while_attention_hits_gives_nothing():
    got = resume_blocks(["full", "full", "state"], [None] * 3,
                        [run(TARGET), run(TARGET), keys(set())], TARGET, retried=False)
    assert got == Resume(0)


def test_attention_that_misses_while_the_state_hits_gives_nothing():
    got = resume_blocks(["full", "state"], [None, None], [run(0), keys(set(range(TARGET)))],
                        TARGET, retried=False)
    assert got == Resume(0)


def test_the_hit_is_the_latest_kept_state_inside_the_attention_run():
    # States at blocks 1 and 4 (after 2 and 5 blocks): attention holds 4 blocks -> 2.
    got = resume_blocks(["full", "state"], [None, None], [run(4), keys({1, 4})], TARGET, False)
    assert got == Resume(2)


def test_a_state_asked_past_the_gpu_hit_only():
    # The state group was looked up from block 3 (the GPU holds 3 blocks): a state at block 1
    # is not known, one at block 4 is.
    got = resume_blocks(["full", "state"], [None, None], [run(6), keys({4}, start=3)],
                        TARGET, False)
    assert got == Resume(5)
    got = resume_blocks(["full", "state"], [None, None], [run(6), keys(set(), start=3)],
                        TARGET, False)
    assert got == Resume(0)


def test_windows_asked_at_the_target():
    # A window of 2 blocks looked up ending at the target (blocks 4 and 5): its answer is the
    # run held from block 4.
    for n, wrun, want in [
        (6, 2, Resume(6)),          # full run and window held at the target: the target
        (6, 1, Resume(0, 5)),       # window misses block 5: ask again one block back
        (6, 0, Resume(0, 5)),
        (4, 2, Resume(0, 4)),       # full run shorter: ask the window there
        (0, 2, Resume(0)),          # no full run: nothing
    ]:
        window = run(wrun, start=4)
        got = resume_blocks(["full", "window"], [None, 2], [run(n), window], TARGET, False)
        assert got == want, (n, wrun, got)
        # Already asked again once: never a hit whose window nobody checked.
        again = resume_blocks(["full", "window"], [None, 2], [run(n), window], TARGET, True)
        assert again == (Resume(0) if want.ask_again_at else want), (n, wrun, again)


def test_window_full_and_state_all_or_none():
    # Full attention holds 6, the window 2 blocks ending at 6, the state only at block 3: the
    # window must be asked again at 4; then all three agree on 4.
    kinds, wins = ["full", "window", "state"], [None, 2, None]
    first = resume_blocks(kinds, wins, [run(6), run(2, start=4), keys({3})], TARGET, False)
    assert first == Resume(0, 4)
    second = resume_blocks(kinds, wins, [run(4, end=4), run(2, start=2, end=4),
                                         keys({3}, end=4)], 4, True)
    assert second == Resume(4)
    # The window at 4 is gone: nothing (it was asked again once already).
    gone = resume_blocks(kinds, wins, [run(4, end=4), run(0, start=2, end=4),
                                       keys({3}, end=4)], 4, True)
    assert gone == Resume(0)


def test_every_window_pattern_against_the_definition():
    # A full group of 6 blocks, a window of 2 asked at the target, a state group: every
    # window run and state subset. The window's answer is a run from its first block.
    for wrun in range(3):
        for r in range(TARGET + 1):
            for states in itertools.combinations(range(TARGET), r):
                s = set(states)
                got = resume_blocks(["full", "window", "state"], [None, 2, None],
                                    [run(TARGET), run(wrun, start=4), keys(s)], TARGET, True)
                want = TARGET if wrun == 2 and TARGET - 1 in s else 0
                assert got == Resume(want), (wrun, s, got)


def test_state_lookups_are_one_key_per_list_and_fold_back():
    assert state_key_lists([b"a", b"b"]) == [[b"a"], [b"b"]]
    refs, leases = merge_state_answer([0, 1, 0, 1], [[], [7], [], [9]], [0, 11, 0, 12])
    assert refs == [MISSING, 7, MISSING, 9] and leases == [0, 11, 0, 12]


def test_only_the_lease_of_the_state_a_hit_loads_is_kept():
    assert keep_resume_lease(2, [0, 11, 0, 12], 6) == (12, [11])
    assert keep_resume_lease(2, [0, 11, 0, 12], 4) == (11, [12])
    assert keep_resume_lease(2, [0, 11, 0, 12], 0) == (0, [11, 12])
    assert keep_resume_lease(2, [5], 1) == (0, [5])     # the hit ends before the states asked


# ---- the rule inside the connector's lookups (no vLLM, a fake daemon) ----------------------

def _asked(local_tokens: int = 0):
    """A 100-token request (6 blocks to offer) looked up in a full and a state group; returns
    (rig, its state, the full group's call, the state group's call)."""
    from .fakes import FakeClient, Rig, request, state

    w = Rig(FakeClient(), groups=tuple(_groups()))
    st = state(w, request("a", list(range(100))))
    assert w.lookups.offer(st, local_tokens, step=0) is None
    w.lookups.send()
    full, states = w.client.calls
    return w, st, full, states


def _groups():
    from dataclasses import replace

    from .fakes import GROUP

    return [GROUP, replace(GROUP, index=1, namespace=b"ns-state", state=True)]


def test_state_groups_are_asked_key_by_key_past_the_gpu_and_the_hit_takes_all_groups():
    w, st, full, states = _asked(local_tokens=32)         # the GPU holds 2 blocks
    assert [len(k) for k in full.key_lists] == [6]
    assert [len(k) for k in states.key_lists] == [1, 1, 1, 1]     # blocks 2..5, one each
    # Attention holds 5 blocks; states were kept after blocks 3 and 5 (indexes 2 and 4 of
    # the request, the 1st and 3rd keys asked) and 6.
    full.answer([5], [[10, 11, 12, 13, 14]], [70])
    states.answer([1, 0, 1, 1], [[20], [], [22], [23]], [71, 0, 72, 73])
    assert w.lookups.offer(st, 32, step=1) == 5
    # The state at the hit's end (block 4) is kept; the other states' leases go at once.
    a = w.lookups._asks["a"]
    assert a.slots == [[10, 11, 12, 13, 14], [20, MISSING, 22, 23]]
    assert a.starts == [0, 2]
    assert sorted(a.leases) == [70, 72] and sorted(w.lookups.release) == [71, 73]


def test_no_state_at_any_boundary_the_attention_reaches_is_no_hit():
    w, st, full, states = _asked()
    full.answer([6], [[10, 11, 12, 13, 14, 15]], [70])
    states.answer([0] * 6, [[]] * 6, [0] * 6)
    assert w.lookups.offer(st, 0, step=1) == 0
    assert w.lookups._asks["a"].leases == [] and w.lookups.release == [70]


def test_a_lookup_refused_beside_others_in_flight_reaches_vllm_as_no_hit_never_an_error():
    # The daemon forgot this client (silent past its peer timeout): the first namespace's
    # answer is an error; the other calls of the batch become orphans, whose error answers
    # at the next step must not escape either (it used to: the engine core died).
    from kvpool.shared.errors import HelloRequired

    w, st, full, states = _asked()
    full.error = HelloRequired("say Hello first")
    assert w.lookups.offer(st, 0, step=1) == 0
    states.error = HelloRequired("say Hello first")
    w.lookups.poll(step=2)
    assert w.lookups._trips._orphans == []
