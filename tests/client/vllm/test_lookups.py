"""Lookups without vLLM: queued per step, sent in one batch per namespace, None until
answered, zero hits (never an error) from a daemon that is gone, and pins that go back when
nobody loads them."""

from __future__ import annotations

from kvpool.client.vllm import lookups as lookups_module

from .fakes import NS, FakeClient, Rig, keys, request, state


def ask(w: Rig, rid: str):
    """``rid``'s lookup as the part keeps it (white box)."""
    return w.lookups._asks[rid]


def test_a_steps_lookups_go_out_in_one_batch_and_answer_none_until_it_lands():
    w = Rig(FakeClient())
    a = state(w, request("a", list(range(70))))     # 4 full blocks before the last token
    b = state(w, request("b", list(range(1000, 1040))))   # 2
    assert w.lookups.offer(a, 0, step=0) is None
    assert w.lookups.offer(b, 0, step=0) is None
    assert w.client.calls == []                           # nothing sent inside the step
    w.lookups.send()                                      # the step's end
    [call] = w.client.calls
    assert call.namespace == NS
    assert call.key_lists == [keys(a.request, 0, 4), keys(b.request, 0, 2)]
    assert (ask(w, "a").state, ask(w, "b").state) == ("sent", "sent")
    assert w.lookups.offer(a, 0, step=1) is None          # not answered yet
    call.answer(hits=[3, 0], slots=[[7, 8, 9], []], leases=[55, 0])
    assert w.lookups.offer(a, 0, step=1) is None          # answers are taken in once a step
    assert w.lookups.offer(a, 0, step=2) == 3
    assert w.lookups.offer(b, 0, step=2) == 0
    assert ask(w, "a").slots == [[7, 8, 9]] and ask(w, "a").leases == [55]
    assert ask(w, "a").starts == [0] and w.lookups.release == []
    assert w.lookups.decline(a) == 3                      # vLLM took none of it
    assert w.lookups.release == [55] and ask(w, "a").hit is None
    assert ask(w, "a").state == "idle"
    w.lookups.send_releases()
    assert w.client.released == [[55]] and w.lookups.release == []


def test_a_step_asks_for_about_lookup_blocks_per_step(monkeypatch):
    monkeypatch.setattr(lookups_module, "LOOKUP_BLOCKS_PER_STEP", 6)
    w = Rig(FakeClient())
    sts = [state(w, request(f"r{i}", list(range(100 * i, 100 * i + 70)))) for i in range(3)]
    for st in sts:
        assert w.lookups.offer(st, 0, step=0) is None
    w.lookups.send()
    # 4 blocks each: the first two go (the bound is passed by the second), the third waits.
    assert [len(k) for k in w.client.calls[0].key_lists] == [4, 4]
    assert w.lookups.queued == ["r2"] and ask(w, "r2").state == "queued"
    w.lookups.send()                                      # a batch is in flight: waits
    assert len(w.client.calls) == 1
    w.client.calls[0].answer([0, 0], [[], []], [0, 0])
    w.lookups.poll(step=1)
    w.lookups.send()
    assert [len(k) for k in w.client.calls[1].key_lists] == [4]


def test_the_gpu_holding_every_block_asks_nothing():
    w = Rig(FakeClient())
    a = state(w, request("a", list(range(70))))
    assert w.lookups.offer(a, 64, step=0) == 0
    assert w.lookups.queued == [] and ask(w, "a").state == "idle"


def test_a_dead_daemon_gives_zero_hits_and_no_error():
    w = Rig(FakeClient())
    a = state(w, request("a", list(range(70))))
    assert w.lookups.offer(a, 0, step=0) is None
    w.client.up = False                                   # gone before the batch is sent
    w.lookups.send()
    assert ask(w, "a").hit == 0 and ask(w, "a").state == "idle"
    assert w.lookups.offer(a, 0, step=1) == 0
    assert not w.link.ok()                                # backing off
    b = state(w, request("b", list(range(500, 570))))
    assert w.lookups.offer(b, 0, step=1) == 0             # not even queued while backing off
    assert w.lookups.queued == []


def test_a_daemon_that_fails_mid_batch_gives_zero_hits_and_releases_late_leases():
    w = Rig(FakeClient())
    a = state(w, request("a", list(range(70))))
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.send()
    [call] = w.client.calls
    from kvpool.shared.errors import DaemonUnavailable

    call.error = DaemonUnavailable("connection lost")
    assert w.lookups.offer(a, 0, step=1) == 0
    assert not w.link.ok()


def test_an_answer_for_a_request_gone_meanwhile_releases_its_leases():
    w = Rig(FakeClient())
    a = state(w, request("a", list(range(70))))
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.send()
    w.requests.leave("a")
    w.client.calls[0].answer([4], [[1, 2, 3, 4]], [77])
    w.lookups.poll(step=1)
    assert w.lookups.release == [77]


def test_a_miss_forgets_a_remembered_key():
    w = Rig(FakeClient())
    a = state(w, request("a", list(range(70))))
    ks = keys(a.request, 0, 4)
    w.batches.committed.add(0, ks)
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.send()
    w.client.calls[0].answer([2], [[5, 6]], [9])          # block 2 was evicted
    assert w.lookups.offer(a, 0, step=1) == 2
    assert list(w.batches.committed[0]) == [ks[0], ks[1], ks[3]]


def answered(w: Rig, hits: list[int]) -> list:
    """Requests of 4 full blocks each, looked up in step 0 and answered in step 1."""
    sts = [state(w, request(f"r{i}", list(range(100 * i, 100 * i + 70))))
           for i in range(len(hits))]
    for st in sts:
        assert w.lookups.offer(st, 0, step=0) is None
    w.lookups.send()
    w.client.calls[-1].answer(hits, [list(range(h)) for h in hits],
                              [50 + i if h else 0 for i, h in enumerate(hits)])
    for st, h in zip(sts, hits):
        assert w.lookups.offer(st, 0, step=1) == h
    return sts


def test_a_partial_answer_is_asked_again_once_this_engine_stored_the_block_it_missed():
    w = Rig(FakeClient())
    part, miss, full = answered(w, [2, 0, 4])
    # Steps later, vLLM asks again (the requests waited in its queue); nothing new stored.
    assert [w.lookups.offer(st, 0, step=9) for st in (part, miss, full)] == [2, 0, 4]
    # This engine's stores committed the blocks both partial answers missed.
    w.batches.committed.add(0, keys(part.request, 2, 3))
    w.batches.committed.add(0, keys(miss.request, 0, 1))
    assert w.lookups.offer(part, 0, step=10) is None      # asked again, its lease released
    assert w.lookups.offer(miss, 0, step=10) is None
    assert w.lookups.offer(full, 0, step=10) == 4          # a full hit is kept
    assert w.lookups.release == [50] and ask(w, "r0").leases == []
    assert ask(w, "r2").leases == [52]
    w.lookups.send()
    assert w.client.calls[-1].key_lists == [keys(part.request, 0, 4), keys(miss.request, 0, 4)]
    w.client.calls[-1].answer([4, 1], [[1, 2, 3, 4], [9]], [60, 61])
    # The fresh answers are used, whatever was stored since.
    assert w.lookups.offer(part, 0, step=11) == 4
    assert w.lookups.offer(miss, 0, step=11) == 1
    w.batches.committed.add(0, keys(miss.request, 1, 2))
    assert w.lookups.offer(miss, 0, step=12) == 1          # one step old: still fresh


def test_a_partial_answer_is_asked_again_when_old_but_never_in_the_step_after_it_came():
    w = Rig(FakeClient())
    clock = w.clock
    part, full = answered(w, [1, 4])
    clock.now += w.budgets.lookup_stale_s + 1              # another engine may have stored
    assert w.lookups.offer(part, 0, step=2) == 1           # a slow step: the answer just came
    assert w.lookups.offer(part, 0, step=3) is None
    assert w.lookups.offer(full, 0, step=3) == 4
    w.lookups.send()
    w.client.calls[-1].answer([3], [[1, 2, 3]], [70])
    clock.now += 10                                        # slower steps still
    assert w.lookups.offer(part, 0, step=4) == 3           # taken in this step: used
    assert w.lookups.offer(part, 0, step=5) == 3


def hit_of_four(w: Rig, local_tokens: int = 0):
    """A 70-token request whose lookup found its 4 full blocks (slots 30-33, lease 9)."""
    a = state(w, request("a", list(range(70))))
    assert w.lookups.offer(a, local_tokens, step=0) is None
    w.lookups.send()
    w.client.calls[0].answer([4], [[30, 31, 32, 33]], [9])
    assert w.lookups.offer(a, local_tokens, step=1) == 4
    return a


def test_an_accepted_hit_keeps_its_pins_until_the_load_is_reported():
    w = Rig(FakeClient())
    a = hit_of_four(w, local_tokens=16)
    hit = w.lookups.accept(a)
    assert hit == lookups_module.Hit(4, 4, 16, [0], [[30, 31, 32, 33]],
                                     [keys(a.request, 0, 4)])
    assert w.lookups.accept(a) is None and w.lookups.release == []    # used up, still pinned
    w.lookups.loaded("a", failed=False)
    assert w.lookups.release == [9] and ask(w, "a").held == []


def test_a_failed_load_is_never_offered_again():
    w = Rig(FakeClient())
    a = hit_of_four(w)
    w.lookups.accept(a)
    w.lookups.loaded("a", failed=True)
    assert w.lookups.offer(a, 0, step=5) == 0 and w.lookups.queued == []


def test_a_request_that_leaves_gives_its_pins_back():
    w = Rig(FakeClient())
    hit_of_four(w)
    w.requests.leave("a")
    assert w.lookups.release == [9] and "a" not in w.lookups.tracked()
