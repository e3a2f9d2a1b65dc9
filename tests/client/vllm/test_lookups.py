"""Lookups without vLLM: queued per step, sent in one batch per namespace, None until
answered, and zero hits (never an error) from a daemon that is gone."""

from __future__ import annotations

from kvpool.client.vllm import lookups as lookups_module
from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.lookups import Lookups
from kvpool.client.vllm.pd_stream import PdStream

from .fakes import BT, GROUP, NS, Clock, FakeClient, budgets, keys, request, state


class Wired:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.clock = Clock()
        self.budgets = b = budgets(self.clock)
        self.reqs: dict = {}
        self.loads: list = []
        self.link = DaemonLink(client, b)
        self.committed: list[dict[bytes, None]] = [{}]
        self.pd = PdStream([GROUP], BT, self.reqs, self.loads, b)
        self.lookups = Lookups([GROUP], BT, client, self.link, self.reqs, self.pd,
                               self.committed, b)


def test_a_steps_lookups_go_out_in_one_batch_and_answer_none_until_it_lands():
    w = Wired(FakeClient())
    a = state(w.reqs, request("a", list(range(70))))     # 4 full blocks before the last token
    b = state(w.reqs, request("b", list(range(1000, 1040))))   # 2
    assert w.lookups.match(a, 0, step=0) is None
    assert w.lookups.match(b, 0, step=0) is None
    assert w.client.calls == []                           # nothing sent inside the step
    w.lookups.send()                                      # the step's end
    [call] = w.client.calls
    assert call.namespace == NS
    assert call.key_lists == [keys(a.request, 0, 4), keys(b.request, 0, 2)]
    assert (a.state, b.state) == ("sent", "sent")
    assert w.lookups.match(a, 0, step=1) is None          # not answered yet
    call.answer(hits=[3, 0], slots=[[7, 8, 9], []], leases=[55, 0])
    assert w.lookups.match(a, 0, step=1) is None          # answers are taken in once a step
    assert w.lookups.match(a, 0, step=2) == 3
    assert w.lookups.match(b, 0, step=2) == 0
    assert a.slots == [[7, 8, 9]] and a.leases == [55] and a.hit_start == [0]
    assert w.lookups.release == []
    w.lookups.consume(a, keep_leases=False)               # vLLM took none of it
    assert w.lookups.release == [55] and a.hit is None and a.state == "idle"
    w.lookups.send_releases()
    assert w.client.released == [[55]] and w.lookups.release == []


def test_a_step_asks_for_about_lookup_blocks_per_step(monkeypatch):
    monkeypatch.setattr(lookups_module, "LOOKUP_BLOCKS_PER_STEP", 6)
    w = Wired(FakeClient())
    sts = [state(w.reqs, request(f"r{i}", list(range(100 * i, 100 * i + 70)))) for i in range(3)]
    for st in sts:
        assert w.lookups.match(st, 0, step=0) is None
    w.lookups.send()
    # 4 blocks each: the first two go (the bound is passed by the second), the third waits.
    assert [len(k) for k in w.client.calls[0].key_lists] == [4, 4]
    assert w.lookups.queued == ["r2"] and sts[2].state == "queued"
    w.lookups.send()                                      # a batch is in flight: waits
    assert len(w.client.calls) == 1
    w.client.calls[0].answer([0, 0], [[], []], [0, 0])
    w.lookups.poll(step=1)
    w.lookups.send()
    assert [len(k) for k in w.client.calls[1].key_lists] == [4]


def test_the_gpu_holding_every_block_asks_nothing():
    w = Wired(FakeClient())
    a = state(w.reqs, request("a", list(range(70))))
    assert w.lookups.match(a, 64, step=0) == 0
    assert w.lookups.queued == [] and a.state == "idle"


def test_a_dead_daemon_gives_zero_hits_and_no_error():
    w = Wired(FakeClient())
    a = state(w.reqs, request("a", list(range(70))))
    assert w.lookups.match(a, 0, step=0) is None
    w.client.up = False                                   # gone before the batch is sent
    w.lookups.send()
    assert a.hit == 0 and a.state == "idle" and w.lookups.match(a, 0, step=1) == 0
    assert not w.link.ok()                                # backing off
    b = state(w.reqs, request("b", list(range(500, 570))))
    assert w.lookups.match(b, 0, step=1) == 0             # not even queued while backing off
    assert w.lookups.queued == []


def test_a_daemon_that_fails_mid_batch_gives_zero_hits_and_releases_late_leases():
    w = Wired(FakeClient())
    a = state(w.reqs, request("a", list(range(70))))
    assert w.lookups.match(a, 0, step=0) is None
    w.lookups.send()
    [call] = w.client.calls
    from kvpool.shared.errors import DaemonUnavailable

    call.error = DaemonUnavailable("connection lost")
    assert w.lookups.match(a, 0, step=1) == 0
    assert not w.link.ok()


def test_an_answer_for_a_request_gone_meanwhile_releases_its_leases():
    w = Wired(FakeClient())
    a = state(w.reqs, request("a", list(range(70))))
    assert w.lookups.match(a, 0, step=0) is None
    w.lookups.send()
    del w.reqs["a"]
    w.client.calls[0].answer([4], [[1, 2, 3, 4]], [77])
    w.lookups.poll(step=1)
    assert w.lookups.release == [77]


def test_a_miss_forgets_a_remembered_key():
    w = Wired(FakeClient())
    a = state(w.reqs, request("a", list(range(70))))
    ks = keys(a.request, 0, 4)
    w.committed[0].update(dict.fromkeys(ks))
    assert w.lookups.match(a, 0, step=0) is None
    w.lookups.send()
    w.client.calls[0].answer([2], [[5, 6]], [9])          # block 2 was evicted
    assert w.lookups.match(a, 0, step=1) == 2
    assert list(w.committed[0]) == [ks[0], ks[1], ks[3]]


def answered(w: Wired, hits: list[int]) -> list:
    """Requests of 4 full blocks each, looked up in step 0 and answered in step 1."""
    sts = [state(w.reqs, request(f"r{i}", list(range(100 * i, 100 * i + 70))))
           for i in range(len(hits))]
    for st in sts:
        assert w.lookups.match(st, 0, step=0) is None
    w.lookups.send()
    w.client.calls[-1].answer(hits, [list(range(h)) for h in hits],
                              [50 + i if h else 0 for i, h in enumerate(hits)])
    for st, h in zip(sts, hits):
        assert w.lookups.match(st, 0, step=1) == h
    return sts


def test_a_partial_answer_is_asked_again_once_this_engine_stored_the_block_it_missed():
    w = Wired(FakeClient())
    part, miss, full = answered(w, [2, 0, 4])
    # Steps later, vLLM asks again (the requests waited in its queue); nothing new stored.
    assert [w.lookups.match(st, 0, step=9) for st in (part, miss, full)] == [2, 0, 4]
    # This engine's stores committed the blocks both partial answers missed.
    w.committed[0][keys(part.request, 2, 3)[0]] = None
    w.committed[0][keys(miss.request, 0, 1)[0]] = None
    assert w.lookups.match(part, 0, step=10) is None      # asked again, its lease released
    assert w.lookups.match(miss, 0, step=10) is None
    assert w.lookups.match(full, 0, step=10) == 4          # a full hit is kept
    assert w.lookups.release == [50] and part.leases == [] and full.leases == [52]
    w.lookups.send()
    assert w.client.calls[-1].key_lists == [keys(part.request, 0, 4), keys(miss.request, 0, 4)]
    w.client.calls[-1].answer([4, 1], [[1, 2, 3, 4], [9]], [60, 61])
    # The fresh answers are used, whatever was stored since.
    assert w.lookups.match(part, 0, step=11) == 4
    assert w.lookups.match(miss, 0, step=11) == 1
    w.committed[0][keys(miss.request, 1, 2)[0]] = None
    assert w.lookups.match(miss, 0, step=12) == 1          # one step old: still fresh


def test_a_partial_answer_is_asked_again_when_old_but_never_in_the_step_after_it_came():
    w = Wired(FakeClient())
    clock = w.clock
    part, full = answered(w, [1, 4])
    clock.now += w.budgets.lookup_stale_s + 1              # another engine may have stored
    assert w.lookups.match(part, 0, step=2) == 1           # a slow step: the answer just came
    assert w.lookups.match(part, 0, step=3) is None
    assert w.lookups.match(full, 0, step=3) == 4
    w.lookups.send()
    w.client.calls[-1].answer([3], [[1, 2, 3]], [70])
    clock.now += 10                                        # slower steps still
    assert w.lookups.match(part, 0, step=4) == 3           # taken in this step: used
    assert w.lookups.match(part, 0, step=5) == 3
