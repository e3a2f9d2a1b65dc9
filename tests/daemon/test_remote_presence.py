"""daemon/remote_presence.py without a store: the probes of one loop turn share one existence
check, a check past its deadline turns the tier off and answers the lookups anyway, what is
learnt is bounded and told to the index."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import numpy as np

from kvpool.daemon import remote_presence
from kvpool.daemon.remote_presence import RemotePresence
from kvpool.daemon.tier import TierEvents

S = 4096
NS = b"n" * 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Tier(TierEvents):
    """The tier's side: the checks it was asked for (answered by the test), its state, its
    faults, and what the index heard."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.checks: list[tuple[list[bytes], Future]] = []
        self.up = True
        self.faults: list[str] = []
        self.held_keys: list[bytes] = []
        self.dropped_keys: list[bytes] = []
        self.presence = RemotePresence(self.check, timeout_s, lambda: self.up, self.fault)
        self.presence.events = self

    def check(self, keys: list[bytes]) -> Future:
        f: Future = Future()
        self.checks.append((keys, f))
        return f

    def fault(self, what: str, exc: BaseException) -> None:
        self.faults.append(f"{what}: {exc}")
        self.up = False

    def held(self, keys: list[bytes]) -> None:
        self.held_keys += keys

    def dropped(self, keys: list[bytes]) -> None:
        self.dropped_keys += keys


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_probes_of_one_loop_turn_share_one_check_and_teach_leading():
    async def main() -> None:
        t = Tier()
        p = t.presence
        first = p.probe(NS, [[h(0), h(1), h(2)]], S)
        second = p.probe(NS, [[h(1), h(3)]], S)
        assert p.probe(NS, [[]], S) is None, "nothing to ask"
        await settle()
        assert [keys for keys, _ in t.checks] == [[NS + h(i) for i in (0, 1, 2, 3)]]
        assert not first.done() and not second.done(), "a lookup waits for the check"
        t.checks[0][1].set_result(np.array([True, True, False, True]))
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert p.leading(NS, [h(0), h(1), h(2), h(3)], S) == 2
        assert p.leading(NS, [h(0)], 2 * S) == 0, "a block of another size is not a hit"
        assert not p.wants(NS + h(3)) and p.wants(NS + h(2))
        assert t.held_keys == [NS + h(i) for i in (0, 1, 3)] and len(p) == 3
        assert p.bytes == 3 * S and not t.faults
    asyncio.run(main())


def test_a_check_past_its_deadline_turns_the_tier_off_and_answers_the_lookup():
    async def main() -> None:
        t = Tier(timeout_s=0.05)
        waiting = t.presence.probe(NS, [[h(0)]], S)
        await asyncio.wait_for(waiting, 30)
        assert len(t.faults) == 1 and "no answer within remote_timeout_ms=50" in t.faults[0]
        t.checks[0][1].set_result(np.array([True]))       # the late answer is dropped
        await settle()
        assert len(t.presence) == 0 and len(t.faults) == 1
    asyncio.run(main())


def test_a_failed_check_is_a_fault_and_an_answer_after_an_outage_is_not_learnt():
    async def main() -> None:
        t = Tier()
        failed = t.presence.probe(NS, [[h(0)]], S)
        await settle()
        t.checks[0][1].set_exception(OSError("the master is gone"))
        await asyncio.wait_for(failed, 30)
        assert t.faults == ["an existence check: the master is gone"]
        t.up = True
        late = t.presence.probe(NS, [[h(1)]], S)
        await settle()
        t.up = False                                       # off while the check ran
        t.checks[1][1].set_result(np.array([True]))
        await asyncio.wait_for(late, 30)
        assert len(t.presence) == 0
        # Off before the check is sent: no check, the lookup answers at once.
        t.presence.probe(NS, [[h(2)]], S)
        await settle()
        assert len(t.checks) == 2
    asyncio.run(main())


def test_what_is_known_is_bounded_oldest_first_and_told_to_the_index(monkeypatch):
    monkeypatch.setattr(remote_presence, "PRESENT_MAX", 3)
    t = Tier()
    p = t.presence
    for i in range(4):
        p.remember(NS + h(i), S)
    p.remember(NS + h(1), 2 * S)                           # learnt again: newest, new size
    assert t.dropped_keys == [NS + h(0)] and t.held_keys == [NS + h(i) for i in range(4)]
    assert p.bytes == 4 * S and p.leading(NS, [h(1)], 2 * S) == 1
    p.remember(b"o" * 16 + h(9), S)
    assert t.dropped_keys == [NS + h(0), NS + h(2)]
    assert p.forget_ns(NS) == 2 and len(p) == 1
    p.withdraw()                                           # off: the index drops, we keep
    assert t.dropped_keys[-1:] == [b"o" * 16 + h(9)] and len(p) == 1
    p.clear()                                              # back: a new master knows nothing
    assert len(p) == 0 and p.bytes == 0 and p.wants(b"o" * 16 + h(9))
