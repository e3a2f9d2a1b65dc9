"""Stores planned without a round trip, over a real daemon: tickets given slots by the store
that names their keys, duplicates from two engines, stale grants, expiry, the client's stock
across a daemon restart, and tickets that neither take pool space nor evict (issue 26)."""

import time

import torch

from kvpool.client import scheduler as scheduler_module
from kvpool.client.scheduler import SchedulerClient
from kvpool.shared.errors import DaemonUnavailable, ErrorCode
from kvpool.shared.protocol import MAX_RESERVE
from tests.conftest import stop_process, unless_unavailable, wait_for
from bench.kvtest import HostKv, keyed_store


def _engine(config, name: str = "worker"):
    """One engine's pieces: its KV memory, a registered worker, a scheduler client."""
    kv = HostKv()
    worker, reg = kv.register(config, name=name)
    return kv, worker, reg, SchedulerClient(config)


def _loads_back(worker, reg, kv: HostKv, slots: list[int], into: list[int], expected) -> bool:
    kv.poison(into)
    done = worker.wait([worker.submit_load(reg, slots, into)], 10)[0]
    return done.ok and torch.equal(kv.blocks_of(into), expected)


def _stocked(sched: SchedulerClient, ns: bytes, n: int) -> tuple[list[int], str]:
    """Slots from the client's stock, polling (never waiting inside the client) until they
    came."""
    sched.keep_stock(ns)
    got: list[int] = []
    grant = ""

    def more():
        nonlocal grant
        sched.ready() and sched.poll()
        refs, grant = sched.take_slots(ns, n - len(got))
        got.extend(refs)
        return len(got) == n

    wait_for(more, 10, f"{n} reserved slots")
    return got, grant


def test_a_store_into_reserved_slots_binds_them_and_is_byte_exact(daemon):
    kv, worker, reg, sched = _engine(daemon.client_config())
    keys = kv.keys(list(range(64)))
    refs, grant = _stocked(sched, kv.namespace, 4)
    assert grant == sched.ping().daemon_id
    assert sched.info().slots_reserved >= 4
    assert sched.lookup(kv.namespace, [keys]).hits == [0]     # a ticket: nothing to see
    kv.fill_random([0, 1, 2, 3], seed=7)
    expected = kv.blocks_of([0, 1, 2, 3])
    done = worker.wait([worker.submit_store(reg, [0, 1, 2, 3], refs, keys=keys, grant=grant)],
                       10)[0]
    assert done.ok, done.message
    hit = sched.lookup(kv.namespace, [keys], pin=True)
    assert hit.hits == [4] and not set(hit.slots[0]) & set(refs)   # slots, not the tickets
    assert _loads_back(worker, reg, kv, hit.slots[0], [8, 9, 10, 11], expected)
    sched.release(hit.leases)
    sched.close(); worker.close(); kv.close()


def test_two_engines_storing_the_same_keys_show_each_block_once(daemon):
    kv_a, wa, ra, sa = _engine(daemon.client_config(), "engine a")
    kv_b, wb, rb, sb = _engine(daemon.client_config(), "engine b")
    keys = kv_a.keys(list(range(48)))
    kv_a.fill_random([0, 1, 2], seed=1)
    kv_b.fill_random([0, 1, 2], seed=2)       # other bytes: a torn block would show them
    refs_a, grant = _stocked(sa, kv_a.namespace, 3)
    refs_b, _ = _stocked(sb, kv_b.namespace, 3)
    ja = wa.submit_store(ra, [0, 1, 2], refs_a, keys=keys, grant=grant)
    jb = wb.submit_store(rb, [0, 1, 2], refs_b, keys=keys, grant=grant)
    assert wa.wait([ja], 10)[0].ok and wb.wait([jb], 10)[0].ok
    info = sa.info()
    assert info.duplicate_blocks == 3 and info.stored_blocks == 3
    hit = sa.lookup(kv_a.namespace, [keys], pin=True)
    assert hit.hits == [3]
    assert any(_loads_back(wa, ra, kv_a, hit.slots[0], [5, 6, 7], kv.blocks_of([0, 1, 2]))
               for kv in (kv_a, kv_b)), "a block mixes two engines' bytes"
    sa.release(hit.leases)
    wait_for(lambda: sa.info().slots_writing == 0, 10, "the duplicates to be freed")
    for c in (sa, sb, wa, wb):
        c.close()
    kv_a.close(); kv_b.close()


def test_stores_naming_a_stale_grant_or_bad_keys_are_refused(daemon):
    kv, worker, reg, sched = _engine(daemon.client_config())
    keys = kv.keys(list(range(32)))
    refs, grant = _stocked(sched, kv.namespace, 2)
    cases = [
        (dict(keys=keys, grant="0123456789abcdef"), ErrorCode.UNKNOWN_ID, "another|restarted"),
        (dict(keys=keys[:1], grant=grant), ErrorCode.PROTOCOL, "1 keys for 2 slots"),
        (dict(keys=[b"short", b"keys"], grant=grant), ErrorCode.PROTOCOL, "16"),   # decoding
        (dict(grant=grant), ErrorCode.PROTOCOL, "0 keys for 2 slots"),      # keys are required
    ]
    import re
    for kw, code, why in cases:
        done = worker.wait([worker.submit_store(reg, [0, 1], refs, **kw)], 10)[0]
        assert not done.ok and done.code == code and re.search(why, done.message), done
    # an empty store or load is done at once (it once failed as an internal error)
    empty = [worker.submit_store(reg, [], [], keys=[], grant=grant),
             worker.submit_load(reg, [], [])]
    assert [(d.ok, d.nbytes, d.message) for d in worker.wait(empty, 10)] == [(True, 0, "")] * 2
    # none of that bound or lost the slots: they still take a proper store
    assert worker.wait([worker.submit_store(reg, [0, 1], refs, keys=keys, grant=grant)],
                       10)[0].ok
    assert sched.lookup(kv.namespace, [keys]).hits == [2]
    sched.close(); worker.close(); kv.close()


def test_unused_reservations_expire_in_the_daemon_and_in_the_client(daemon_factory):
    d = daemon_factory(extra=["--reservation-ttl-s", "0.4"])
    kv, worker, reg, sched = _engine(d.client_config())
    held, grant = _stocked(sched, kv.namespace, 2)      # taken, never stored
    assert sched.stock(kv.namespace) > 0                 # the rest of the grant
    # The client uses a grant only within half of its TTL, then gives the rest back.
    time.sleep(0.25)
    assert sched.take_slots(kv.namespace, 0) == ([], grant)
    assert sched.stock(kv.namespace) == 0
    # The daemon takes back what nobody named; a store naming such a slot is refused.
    time.sleep(0.2)

    def taken_back() -> bool:
        unless_unavailable(sched.poll)
        return sched.info().slots_reserved <= sched.stock(kv.namespace)

    wait_for(taken_back, 10, "the daemon to take back unused reservations")
    done = worker.wait([worker.submit_store(reg, [0, 1], held, keys=kv.keys(list(range(32))),
                                            grant=grant)], 10)[0]
    assert not done.ok and done.code == ErrorCode.UNKNOWN_ID and "expired" in done.message
    sched.close(); worker.close(); kv.close()


def test_a_client_at_its_ticket_cap_keeps_waiting_for_slots(daemon_factory, monkeypatch):
    """A burst larger than the pool: the scheduler holds as many tickets as the daemon lets it
    and asks for more. The empty grant is no refusal (tickets take no room, stores spend them):
    the stock stays "reserving", so the planner keeps the burst's blocks waiting, and slots
    come once stores spend tickets. It used to read as "no room" until the next ask, and
    the planner gave the blocks up (a real engine's 66-block burst into a 24-slot pool
    stored 41)."""
    monkeypatch.setattr(scheduler_module, "RESERVE_RETRY_S", 1.0)   # the old window, wide
    d = daemon_factory(pool_size="4MiB", extra=["--extent-size", "1MiB"])
    kv, worker, reg, sched = _engine(d.client_config())
    ns = kv.namespace
    held = sched.reserve(ns, MAX_RESERVE)            # every ticket this client may hold
    assert 0 < len(held.slots) < MAX_RESERVE
    sched.keep_stock(ns)
    assert sched.take_slots(ns, 1)[0] == []         # asks for more

    def answered() -> bool:
        unless_unavailable(sched.poll)
        return not sched._stocks[ns].asked

    wait_for(answered, 10, "the daemon to answer the reservation")
    assert sched.stock(ns) == 0
    assert sched.reserving(ns) and not sched.starved(ns), \
        "an empty grant at the ticket cap read as a refusal"
    keys = kv.keys(list(range(4 * kv.block_tokens)))
    done = worker.wait([worker.submit_store(reg, [0, 1, 2, 3], held.slots[:4], keys=keys,
                                            grant=held.daemon_id)], 10)[0]
    assert done.ok, done.message
    got, _ = _stocked(sched, ns, 4)                  # the spent tickets' room comes back
    assert len(got) == 4
    sched.close(); worker.close(); kv.close()


def test_a_daemon_restart_empties_the_stock_and_new_grants_name_the_new_daemon(daemon):
    kv, worker, reg, sched = _engine(daemon.client_config())
    old, old_grant = _stocked(sched, kv.namespace, 2)
    assert sched.stock(kv.namespace) > 0
    daemon.kill()
    daemon.restart()

    def reconnected():
        try:
            sched.ready() and sched.poll()
        except DaemonUnavailable:
            return False
        return sched._t.daemon_id not in (None, old_grant) and sched._t.is_connected

    wait_for(reconnected, 15, "the scheduler client to reconnect")
    new, grant = _stocked(sched, kv.namespace, 2)
    assert grant != old_grant
    # The worker re-registers by itself; the old grant is refused, the new one stores.
    keys = kv.keys(list(range(32)))

    def answered(refs, grant):
        # A store sent on the connection the restart broke is aborted; try again until the
        # restarted daemon answers it.
        done = unless_unavailable(lambda: worker.wait([worker.submit_store(
            reg, [0, 1], refs, keys=keys, grant=grant)], 10)[0])
        return done if done is not None and done.code != ErrorCode.ABORTED else None

    done = wait_for(lambda: answered(old, old_grant), 15, "the worker to reconnect")
    assert not done.ok and done.code == ErrorCode.UNKNOWN_ID
    assert worker.wait([worker.submit_store(reg, [0, 1], new, keys=keys, grant=grant)],
                       10)[0].ok
    assert sched.lookup(kv.namespace, [keys]).hits == [2]
    sched.close(); worker.close(); kv.close()


def test_nowait_calls_return_at_once_with_the_daemon_frozen(daemon):
    import signal

    timeout_s = 1.0
    kv, worker, reg, sched = _engine(daemon.client_config(timeout_ms=int(timeout_s * 1000)))
    keys = kv.keys(list(range(32)))
    _stocked(sched, kv.namespace, 2)
    lease = sched.lookup(kv.namespace, [keys], pin=True).leases
    stop_process(daemon.proc.pid)
    try:
        # A call that waited for the frozen daemon would take timeout_s; each is timed alone,
        # so a loaded machine's scheduling delays do not add up against the bound.
        slowest = 0.0
        for _ in range(50):
            for call in (lambda: sched.take_slots(kv.namespace, 8),
                         lambda: sched.release_nowait(lease),
                         lambda: sched.abort_nowait([1]),
                         lambda: sched.reset_nowait(b"x" * 16)):
                t0 = time.perf_counter()
                call()
                slowest = max(slowest, time.perf_counter() - t0)
        assert slowest < timeout_s / 2, f"a call took {slowest:.3f} s with the daemon frozen"
        # The missing answers are noticed by a poll, after timeout_ms, without waiting.
        def gone():
            try:
                sched.poll()
                sched.take_slots(kv.namespace, 4096)   # the stock is short: a reservation goes out
            except DaemonUnavailable:
                return True
            return False
        wait_for(gone, 15, "the client to notice the frozen daemon")
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    sched.close(); worker.close(); kv.close()


def _fill_pool(sched, worker, reg, kv: HostKv) -> list[bytes]:
    """Store 64-block jobs until the pool evicts: then it is full of committed blocks. Returns
    every key stored."""
    stored: list[bytes] = []
    kv.fill_random(list(range(kv.blocks)), seed=5)
    n = 0
    while sched.info().evictions == 0:
        keys = kv.keys(list(range(kv.blocks * kv.block_tokens)), salt=b"fill%d" % n)
        done = worker.wait([keyed_store(sched, worker, reg, kv.namespace,
                                        list(range(len(keys))), keys)], 10)[0]
        assert done.ok, done.message
        stored += keys
        n += 1
    return stored


def test_a_reservation_on_a_full_pool_is_granted_whole_and_evicts_nothing(daemon_factory):
    """A full pool, a new scheduler asks for 1000 slots: it gets 1000 tickets (the pool has
    more slots; 1/8 of its bytes would be fewer), and every committed block stays."""
    d = daemon_factory(pool_size="24MiB")
    kv, worker, reg, sched = _engine(d.client_config())
    stored = _fill_pool(sched, worker, reg, kv)
    before = sched.info()
    assert before.slots_committed > 1000 > before.pool_bytes // 8 // kv.layout.slot_bytes
    other = SchedulerClient(d.client_config())
    grant = other.reserve(kv.namespace, 1000)
    assert len(grant.slots) == 1000
    after = other.info()
    assert after.evictions == before.evictions
    assert after.slots_committed == before.slots_committed
    assert after.slots_reserved == 1000 and after.used_bytes == before.used_bytes
    hits = other.lookup(kv.namespace, [[k] for k in stored]).hits
    assert sum(hits) == before.slots_committed
    # and the tickets store: each finds a slot then, evicting the oldest blocks
    keys = kv.keys(list(range(kv.blocks * kv.block_tokens)), salt=b"tickets")
    done = worker.wait([worker.submit_store(reg, list(range(kv.blocks)),
                                            grant.slots[:kv.blocks], keys=keys,
                                            grant=grant.daemon_id)], 10)[0]
    assert done.ok, done.message
    assert other.lookup(kv.namespace, [keys]).hits == [kv.blocks]
    assert other.info().slots_committed == before.slots_committed
    other.close(); sched.close(); worker.close(); kv.close()


def test_sustained_stores_through_reservations_keep_a_full_pool_committed(daemon_factory):
    """A scheduler on a full pool, round after round: reserve ahead for a burst (128), store
    32 of it by key, look the blocks up and load them, leave the rest outstanding (as a stock
    does until its TTL). Committed blocks stay >= 95% of the pool's slots: the tickets hold
    none (with slots claimed at reserve, this pool fell to about half)."""
    d = daemon_factory(pool_size="24MiB")
    kv, worker, reg, sched = _engine(d.client_config())
    _fill_pool(sched, worker, reg, kv)
    full = sched.info().slots_committed
    shares = []
    for r in range(12):
        grant = sched.reserve(kv.namespace, 128)
        assert len(grant.slots) == 128
        keys = kv.keys(list(range(32 * kv.block_tokens)), salt=b"round%d" % r)
        done = worker.wait([worker.submit_store(reg, list(range(32)), grant.slots[:32],
                                                keys=keys, grant=grant.daemon_id)], 10)[0]
        assert done.ok, done.message
        hit = sched.lookup(kv.namespace, [keys], pin=True)
        assert hit.hits == [32]
        assert worker.wait([worker.submit_load(reg, hit.slots[0], list(range(32, 64)))],
                           10)[0].ok
        sched.release(hit.leases)
        info = sched.info()
        shares.append(info.slots_committed / full)
    assert info.slots_reserved == 12 * (128 - 32)      # outstanding throughout
    assert min(shares) >= 0.95, f"committed share fell to {min(shares):.3f}"
    sched.close(); worker.close(); kv.close()


def test_wait_stock_takes_in_the_first_grant_and_one_refusal_without_a_step(daemon):
    """What the connector's scheduler side waits for as it starts (``wait_stock``): the answers
    to the reservations in flight. A namespace a worker registered has tickets at once; one
    that no worker registered yet is refused once and not waited for again (the stock asks
    again later), so a scheduler built before its workers starts without waiting out the
    timeout (10 s here)."""
    kv, worker, reg, sched = _engine(daemon.client_config(timeout_ms=10000))
    orphan = b"\x5a" * 16                            # a namespace no worker registered
    try:
        for ns in (kv.namespace, orphan):
            sched.keep_stock(ns)
        assert sched.connect()
        sched.poll()                                 # sends both reservations
        assert sched._stocks[kv.namespace].asked and sched._stocks[orphan].asked
        assert sched.stock(kv.namespace) == 0        # not read yet: nothing polls meanwhile
        t0 = time.monotonic()
        sched.wait_stock()
        waited = time.monotonic() - t0
        assert sched.stock(kv.namespace) > 0, "the grant was not taken in"
        assert sched._stocks[orphan].unregistered and sched.stock(orphan) == 0
        assert waited < 5, f"waited {waited:.1f} s: past the answers, into the timeout"
    finally:
        sched.close(); worker.close(); kv.close()
