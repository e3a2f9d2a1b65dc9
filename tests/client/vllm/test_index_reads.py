"""Lookups read from the shared-memory index (``FakeClient.index``): answered in the call
that asks, with the keys the load names, the hits touched once per namespace per step, the
hybrid rule kept; without an index, the daemon is asked as before."""

from __future__ import annotations

import dataclasses

from kvpool.client.vllm.keys import RequestKeys
from kvpool.shared.index_format import DISK, POOL

from .fakes import BT, GROUP, NS, FakeClient, Rig, keys, request, state

WINDOW = dataclasses.replace(GROUP, index=1, namespace=b"ns-window", sliding_window=BT + 1)   # 2 blocks
STATE = dataclasses.replace(GROUP, index=1, namespace=b"ns-state", state=True)


def pooled(client: FakeClient, req, group, blocks, loc: int = POOL, ref0: int = 30) -> None:
    """``blocks`` of ``req`` in ``group`` held at ``loc`` (refs ref0 + block)."""
    client.index = client.index if client.index is not None else {}
    ks = RequestKeys(req, [group]).range(req, 0, 0, max(blocks) + 1)
    for b in blocks:
        client.index[(group.namespace, ks[b])] = (ref0 + b, loc)


def test_a_pooled_prefix_is_offered_in_the_call_that_asks_with_no_lookup_sent():
    w = Rig(FakeClient())
    req = request("a", list(range(70)))          # 4 full blocks before the last token
    pooled(w.client, req, GROUP, range(3))
    a = state(w, req)
    assert w.lookups.offer(a, 0, step=0) == 3
    w.lookups.end_step()
    assert w.client.calls == []                  # no round trip
    hit = w.lookups.accept(a)
    assert hit.slots == [[30, 31, 32]] and hit.keys[0][:3] == keys(req, 0, 3)
    load = w.loads.start(a, hit, ([5, 6, 7, 8, 9],), 3 * BT)
    [spec] = load.specs
    assert spec.slots == [30, 31, 32] and spec.keys == keys(req, 0, 3)
    w.lookups.loaded("a", failed=False)
    assert w.lookups.release == []               # nothing was pinned


def test_a_block_on_a_lower_tier_counts_as_a_hit_and_its_load_names_its_key():
    w = Rig(FakeClient())
    req = request("a", list(range(70)))
    pooled(w.client, req, GROUP, [0, 2])
    pooled(w.client, req, GROUP, [1, 3], loc=DISK)
    a = state(w, req)
    assert w.lookups.offer(a, 0, step=0) == 4
    load = w.loads.start(a, w.lookups.accept(a), ([5, 6, 7, 8, 9],), 4 * BT)
    [spec] = load.specs
    assert spec.slots == [30, 0, 32, 0] and spec.keys == keys(req, 0, 4)


def test_the_hits_read_are_touched_once_per_namespace_per_step():
    w = Rig(FakeClient())
    ra, rb = request("a", list(range(70))), request("b", list(range(500, 540)))
    pooled(w.client, ra, GROUP, range(4))
    w.client.index = w.client.index or {}
    a, b = state(w, ra), state(w, rb)
    assert w.lookups.offer(a, 0, step=0) == 4
    assert w.lookups.offer(b, 0, step=0) == 0    # 2 blocks, none pooled
    assert w.client.touches == []                # not one per request
    w.lookups.end_step()
    assert w.client.touches == [(NS, keys(ra, 0, 4), 2)]
    w.lookups.end_step()
    assert len(w.client.touches) == 1            # nothing read since


def test_without_an_index_the_daemon_is_asked_and_answers_a_step_later():
    w = Rig(FakeClient())                        # index None: find answers None
    a = state(w, request("a", list(range(70))))
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.end_step()
    [call] = w.client.calls
    call.answer([2], [[7, 8]], [55])
    assert w.lookups.offer(a, 0, step=1) == 2
    hit = w.lookups.accept(a)
    assert hit.keys == [keys(a.request, 0, 4)] and w.client.touches == []


def test_while_reconnecting_the_offer_waits_for_the_index_instead_of_asking_the_daemon():
    # After a daemon restart the daemon's own lookup brings lower-tier hits up into the pool
    # only as far as it has room: six prompts at once through a 24-slot pool got 27 of 66.
    w = Rig(FakeClient())
    w.client.reconnecting = True                 # index None until the Hello is answered
    req = request("a", list(range(70)))
    a = state(w, req)
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.end_step()
    assert w.client.calls == [], "no round trip while the index is a step away"
    w.client.reconnecting = False
    pooled(w.client, req, GROUP, range(4), loc=DISK)
    assert w.lookups.offer(a, 0, step=1) == 4
    assert w.client.calls == []


def test_a_hybrid_hit_is_all_groups_or_none_from_the_index():
    # Full attention holds 4 blocks, the window (2 blocks) only blocks 1-2: asked at 4 it
    # misses; asked again at 3 it holds the window [1, 3): a hit of 3.
    w = Rig(FakeClient(), groups=(GROUP, WINDOW))
    req = request("a", list(range(70)))
    pooled(w.client, req, GROUP, range(4))
    pooled(w.client, req, WINDOW, [1, 2], ref0=60)
    a = state(w, req)
    assert w.lookups.offer(a, 0, step=0) == 3
    hit = w.lookups.accept(a)
    assert hit.starts == [0, 1] and hit.slots == [[30, 31, 32], [61, 62]]


def test_a_state_group_is_read_key_by_key_and_the_hit_ends_on_a_kept_state():
    w = Rig(FakeClient(), groups=(GROUP, STATE))
    req = request("a", list(range(70)))
    pooled(w.client, req, GROUP, range(4))
    pooled(w.client, req, STATE, [1], ref0=80)   # the state after block 1 only
    a = state(w, req)
    assert w.lookups.offer(a, 0, step=0) == 2
    w.lookups.end_step()
    assert w.client.calls == []
    ns_state = [t for t in w.client.touches if t[0] == STATE.namespace]
    assert ns_state == [(STATE.namespace, RequestKeys(req, [STATE]).range(req, 0, 1, 2), 3)]


def test_after_a_reset_lookups_go_by_round_trip_until_one_sent_since_is_answered():
    w = Rig(FakeClient())
    req = request("a", list(range(70)))
    pooled(w.client, req, GROUP, range(4))      # the index still shows what the reset drops
    a = state(w, req)
    w.lookups.fence()
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.end_step()
    [call] = w.client.calls
    call.answer([0], [[]], [0])                 # the daemon did the reset: a miss
    assert w.lookups.offer(a, 0, step=1) == 0
    w.lookups.decline(a)
    assert w.lookups.offer(a, 0, step=2) == 4   # the index is trusted again
    assert len(w.client.calls) == 1


def test_an_index_missing_a_key_we_committed_asks_the_daemon_which_is_believed():
    w = Rig(FakeClient())
    req = request("a", list(range(70)))
    pooled(w.client, req, GROUP, range(2))
    w.lookups._committed.add(0, keys(req, 0, 4))   # our commit of blocks 2-3 not taken in yet
    a = state(w, req)
    assert w.lookups.offer(a, 0, step=0) is None
    w.lookups.end_step()
    [call] = w.client.calls                     # ordered after the commit on the connection
    call.answer([2], [[30, 31]], [5])           # evicted after all
    assert w.lookups.offer(a, 0, step=1) == 2
    assert keys(req, 0, 4)[2] not in w.lookups._committed[0]
    w.lookups.decline(a)
    assert w.lookups.offer(a, 0, step=2) == 2 and len(w.client.calls) == 1
