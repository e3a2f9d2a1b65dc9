"""Worker and scheduler clients against a real daemon: timeouts, reconnects, non-blocking calls."""

import time

import pytest
import torch

from kvpool.client.scheduler import SchedulerClient
from kvpool.client.worker import WorkerClient
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import DaemonUnavailable, ErrorCode
from tests.conftest import stop_process, unless_unavailable, wait_for
from bench.kvtest import HostKv, keyed_store


def test_absent_daemon_raises_quickly_and_never_hangs(tmp_path):
    cfg = ClientConfig(socket=str(tmp_path / "nobody.sock"), timeout_ms=300,
                       reconnect_backoff_ms=500)
    sched = SchedulerClient(cfg)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="not reachable"):
        sched.lookup(b"n" * 16, [[b"k" * 16]])
    assert time.monotonic() - t0 < 0.05, "a missing socket file must not cost a timeout"
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="next try"):   # inside the backoff: instant
        sched.reserve(b"n" * 16, 1)
    assert time.monotonic() - t0 < 0.05
    worker = WorkerClient(cfg)
    kv = HostKv()
    reg = worker.register(kv.namespace, kv.layout, 0, kv.blocks, [kv.mem.region], kv.placement)
    assert not worker.is_registered(reg)       # kept, sent when the daemon appears
    with pytest.raises(DaemonUnavailable):
        worker.submit_store(reg, [0], [1])
    sched.close(); worker.close(); kv.close()


def test_pending_lookup_is_polled_without_blocking(daemon):
    sched = SchedulerClient(daemon.client_config())
    sched.ping()
    call = sched.lookup_start(b"n" * 16, [[b"k" * 16], []], pin=True)
    reply = wait_for(call.result, 5, "the lookup reply")
    assert reply.hits == [0, 0] and reply.leases == [0, 0]
    sched.close()


def test_poll_never_blocks(daemon):
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    t0 = time.perf_counter()
    for _ in range(1000):
        assert worker.poll() == []
    assert time.perf_counter() - t0 < 0.5
    worker.close(); kv.close()


def test_sends_just_after_ready_trust_its_answer(daemon, monkeypatch):
    """A scheduler step checks the connection once (``ready``) and sends several requests:
    those sends do not check it again, later ones do."""
    from kvpool.client import scheduler as sched_mod

    sched = SchedulerClient(daemon.client_config())
    sched.ping()
    checks = []
    real = sched._t.connect_nowait
    monkeypatch.setattr(sched._t, "connect_nowait", lambda: checks.append(1) or real())
    monkeypatch.setattr(sched_mod, "READY_TRUSTED_S", 60.0)
    assert sched.ready() and len(checks) == 1
    sched.release_nowait([7])
    sched.abort_nowait([7])
    call = sched.lookup_start(b"n" * 16, [[b"k" * 16]])
    assert len(checks) == 1
    monkeypatch.setattr(sched_mod, "READY_TRUSTED_S", 0.0)
    sched.release_nowait([8])
    assert len(checks) == 2
    assert wait_for(lambda: sched.poll() or call.result(), 5, "the lookup reply").hits == [0]
    sched.close()


def test_a_trusted_send_to_a_restarted_daemon_fails_cleanly_and_the_client_recovers(
        daemon, monkeypatch):
    from kvpool.client import scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "READY_TRUSTED_S", 60.0)
    sched = SchedulerClient(daemon.client_config())
    sched.ping()
    assert sched.ready()
    daemon.kill()
    daemon.restart()
    # Trusted, so not checked: the request goes nowhere (refused at once by libzmq), or to the
    # new daemon, which does not know the connection and answers HELLO_REQUIRED.
    call = _try(lambda: sched.lookup_start(b"n" * 16, [[b"k" * 16]]))
    if call is not None:
        def answered():
            _try(sched.poll)
            try:
                return call.result()
            except Exception as e:      # the refusal, or the connection dropped meanwhile
                return e
        wait_for(answered, 10, "an answer or a failure of the lookup")
    monkeypatch.setattr(sched_mod, "READY_TRUSTED_S", 0.0)
    reply = wait_for(lambda: unless_unavailable(lambda: sched.lookup(b"n" * 16, [[b"k" * 16]])),
                     15, "the scheduler to reconnect")
    assert reply.hits == [0]
    sched.close()


def test_clients_recover_by_themselves_after_a_daemon_restart(daemon):
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    config = daemon.client_config()
    sched = SchedulerClient(config)
    keys = kv.keys(list(range(32)))
    kv.fill_random([0, 1], seed=3)
    expected = kv.blocks_of([0, 1])
    assert worker.wait([keyed_store(sched, worker, reg, kv.namespace, [0, 1], keys)], 10)[0].ok
    daemon.kill()
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        sched.lookup(kv.namespace, [keys])
    # At most its timeout (the lost connection is usually noticed at once), with room for a
    # loaded machine: a client that waited past its timeout, or for ever, fails this.
    assert time.monotonic() - t0 < config.timeout_ms / 1000 + 2
    daemon.restart()
    # The scheduler reconnects on its own; the worker replays its registration (same local id).
    hit = wait_for(lambda: unless_unavailable(
        lambda: sched.lookup(kv.namespace, [keys], pin=True)), 15,
                   "the scheduler to reconnect")
    assert hit.hits == [2], "committed blocks must survive kill -9 and restart"
    kv.poison([5, 6])

    def load() -> bool:
        # A job sent on the connection the old daemon knew is refused at once (HELLO_REQUIRED)
        # and the worker reconnects, replaying its registration, for the next one.
        job = _try(lambda: worker.submit_load(reg, hit.slots[0], [5, 6]))
        if job is None:
            return False
        done = worker.wait([job], 10)[0]
        assert done.ok or done.code in (ErrorCode.HELLO_REQUIRED, ErrorCode.ABORTED), done
        return done.ok
    wait_for(load, 15, "the worker to reconnect and load")
    assert worker.is_registered(reg)
    assert torch.equal(kv.blocks_of([5, 6]), expected)
    sched.close(); worker.close(); kv.close()


def test_a_released_worker_registers_again_by_polling_alone(daemon):
    """After a daemon restart a worker that only polls (its engine stores nothing: the
    scheduler's reservations are refused while no worker of the namespace is registered)
    registers again by itself, so the scheduler gets slots again."""
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    try:
        assert sched.reserve(kv.namespace, 4).slots
        daemon.kill()
        daemon.restart()

        def registered() -> bool:
            worker.poll()
            return worker.is_registered(reg)
        wait_for(registered, 15, "the polling worker to register with the new daemon")
        reply = wait_for(lambda: unless_unavailable(lambda: sched.reserve(kv.namespace, 4)),
                         15, "the scheduler to reconnect")
        assert reply.slots, "the new daemon refused reservations: no worker registered"
    finally:
        sched.close()
        worker.close()
        kv.close()


def test_a_stopped_daemon_keeps_its_clients(daemon):
    """A daemon that did not run for longer than the peer timeout (SIGSTOP, a paused VM)
    finds its clients' heartbeats unread in the socket: it keeps them, registrations and
    all, instead of releasing them as silent."""
    import signal
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    try:
        before = {c.owner_id: c.registrations for c in sched.info().clients}
        stop_process(daemon.proc.pid)
        try:
            time.sleep(3.0)        # the stimulus: stopped longer than --peer-timeout-ms 2000
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: "did not run for" in daemon.log(), 15,
                 lambda: f"the daemon to notice that it had been stopped (alive: "
                         f"{daemon.proc.poll() is None}); its log ends:\n{daemon.log()[-3000:]}")
        sched.close()
        sched = SchedulerClient(daemon.client_config())
        after = {c.owner_id: c.registrations for c in sched.info().clients}
        kept = {o: n for o, n in before.items() if n}
        assert kept and all(after.get(o) == n for o, n in kept.items()), \
            f"the worker was released while the daemon was stopped: {before} -> {after}"
        assert "went silent" not in daemon.log()
    finally:
        sched.close()
        worker.close()
        kv.close()


def test_jobs_in_flight_when_the_daemon_dies_fail_instead_of_hanging(daemon):
    kv = HostKv(blocks=256, layers=8, heads=8, head_dim=64)      # 256 KiB per block
    worker, reg = kv.register(daemon.client_config(timeout_ms=500))
    # On a loaded machine the first Hello can take longer than 500 ms: the registration is
    # then kept and sent by a later poll, which is not what this test is about.
    wait_for(lambda: worker.poll() is not None and worker.is_registered(reg), 10,
             "the worker's registration")
    sched = SchedulerClient(daemon.client_config())
    keys = kv.keys(list(range(16 * 128)))
    jobs = [keyed_store(sched, worker, reg, kv.namespace, list(range(i, i + 16)), keys[i:i + 16])
            for i in range(0, 128, 16)]
    daemon.kill()
    t0 = time.monotonic()
    done = worker.wait(jobs, 5)       # raises TimeoutError if anything stays in flight
    assert time.monotonic() - t0 < 3
    assert worker.jobs_in_flight == 0
    assert any(not c.ok and c.code == ErrorCode.ABORTED for c in done) or all(c.ok for c in done)
    sched.close(); worker.close(); kv.close()


def test_jobs_in_flight_fail_once_their_connection_is_dropped(daemon):
    # A send that finds the daemon gone drops the socket; jobs sent before on it can never be
    # answered, and must not wait for a heartbeat verdict that a dropped socket never gets.
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    job = keyed_store(sched, worker, reg, kv.namespace, [0], kv.keys([0] * 16))
    worker._t.disconnect()            # what Transport._send does on zmq.Again
    done = worker.poll()
    assert [(c.job_id, c.ok) for c in done] == [(job, False)] and worker.jobs_in_flight == 0
    sched.close(); worker.close(); kv.close()


def test_connecting_without_waiting_and_after_a_long_idle(daemon_factory, tmp_path):
    # No daemon: each attempt returns at once, and fails (at once here: no socket file).
    cfg = ClientConfig(socket=str(tmp_path / "nobody.sock"), timeout_ms=200,
                       reconnect_backoff_ms=50)
    lone = SchedulerClient(cfg)
    t0 = time.perf_counter()
    with pytest.raises(DaemonUnavailable, match="not reachable"):
        while time.perf_counter() - t0 < 5:
            t1 = time.perf_counter()
            assert lone.ready() is False
            assert time.perf_counter() - t1 < 0.05
            time.sleep(0.01)
    lone.close()
    # A Hello whose answer is read long after (an engine idle since start, no heartbeat yet)
    # is said again rather than trusted: the daemon may have released that owner meanwhile.
    d = daemon_factory(extra=["--peer-timeout-ms", "200"])
    sched = SchedulerClient(d.client_config(timeout_ms=300))
    wait_for(lambda: sched.ready() is False and sched._t._hello_id is not None, 5,
             "the Hello to go out")
    time.sleep(0.6)
    wait_for(sched.ready, 5, "the client to connect")
    call = sched.lookup_start(b"n" * 16, [[b"k" * 16]])
    assert wait_for(call.result, 5, "the lookup answer").hits == [0]
    sched.close()


def _try(fn):
    try:
        return fn()
    except DaemonUnavailable:
        return None


def test_a_daemon_that_is_down_costs_no_timeout(daemon):
    """Regression (soak, daemon kills): a killed daemon leaves its socket file, and every
    reconnect waited the full timeout_ms on it; now nothing listening is seen at once."""
    sched = SchedulerClient(daemon.client_config(timeout_ms=5000, reconnect_backoff_ms=0))
    sched.ping()
    daemon.kill()
    for _ in range(3):
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            sched.lookup(b"n" * 16, [[b"k" * 16]])
        assert time.monotonic() - t0 < 1.0
    sched.close()


def test_a_call_waiting_on_a_daemon_that_dies_fails_at_once(daemon):
    """The daemon is stopped, a call waits on it, then it is killed: the call sees the
    connection go instead of waiting out its 10 s timeout."""
    import threading
    sched = SchedulerClient(daemon.client_config(timeout_ms=10_000, reconnect_backoff_ms=0))
    sched.ping()
    stop_process(daemon.proc.pid)
    outcome: list = []

    def call():
        try:
            sched.lookup(b"n" * 16, [[b"k" * 16]])
            outcome.append("answered")
        except DaemonUnavailable as e:
            outcome.append(e)
    t = threading.Thread(target=call)
    t.start()
    wait_for(lambda: t.is_alive(), 5, "the call to start waiting")
    daemon.kill()
    t0 = time.monotonic()
    t.join(9)
    assert not t.is_alive() and time.monotonic() - t0 < 2.0, "the call waited for its timeout"
    assert isinstance(outcome[0], DaemonUnavailable)
    sched.close()


def test_a_scheduler_the_daemon_released_says_hello_again_after_a_refused_lookup(daemon):
    """A scheduler client the daemon released as silent (its heartbeats kept from running)
    gets its next non-blocking lookup refused (HelloRequired); the call after that
    reconnects instead of being refused the same way for good."""
    from kvpool.shared.errors import HelloRequired

    sched = SchedulerClient(daemon.client_config(), name="forgotten")
    observer = SchedulerClient(daemon.client_config(), name="observer")
    try:
        assert sched.lookup(b"n" * 16, [[b"k" * 16]]).hits == [0]
        sched._t._heartbeat.stop()
        wait_for(lambda: "forgotten" not in {c.name for c in observer.info().clients}, 15,
                 "the daemon to release the silent client")
        call = sched.lookup_start(b"n" * 16, [[b"k" * 16]])
        with pytest.raises(HelloRequired):
            wait_for(lambda: call.result(), 10, "the refused lookup's answer")
        # The next blocking lookup says Hello again and is answered (it used to be refused
        # the same way for good).
        again = wait_for(lambda: unless_unavailable(
            lambda: sched.lookup(b"n" * 16, [[b"k" * 16]])), 10,
            "a lookup after the refusal to be answered")
        assert again.hits == [0]
    finally:
        sched.close()
        observer.close()


def test_wait_with_check_raises_what_failed_a_store_or_a_load(daemon):
    """A script that waits with ``check=True`` sees the daemon's reason, not a bare assert later
    on data that never moved."""
    from kvpool.shared.errors import OutOfRange, UnknownId
    kv = HostKv(blocks=8)
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    keys = kv.keys(list(range(2 * kv.block_tokens)))
    try:
        tickets = sched.reserve(kv.namespace, 2)
        # A grant of another daemon's life: refused, and the error says so.
        bad = worker.submit_store(reg, [0, 1], tickets.slots, keys=keys, grant="not-this-daemon")
        with pytest.raises(UnknownId, match=rf"kvpool job {bad} failed \(UNKNOWN_ID\): .*"
                                             r"granted by daemon not-this-daemon"):
            worker.wait([bad], 5, check=True)
        # A slot ref naming no slot of the pool (a stale one of a real slot fails its block
        # alone instead: JobCompletion.failed).
        load = worker.submit_load(reg, [0xFFFF_FFF0], [0])
        with pytest.raises(OutOfRange, match=rf"kvpool job {load} failed \(OUT_OF_RANGE\): "
                                             r"slot ref 0xfffffff0 names no slot"):
            worker.wait([load], 5, check=True)
        # Without check, the same failure is a completion to inspect, as before.
        again = worker.submit_load(reg, [0xFFFF_FFF0], [0])
        assert not worker.wait([again], 5)[0].ok
    finally:
        sched.close(); worker.close(); kv.close()


def test_a_big_job_goes_as_a_lead_and_the_rest_with_one_completion(daemon_factory, tmp_path):
    """A store or load of ``SPLIT_MIN_BLOCKS`` blocks or more is sent as two requests (its first
    ``LEAD_BLOCKS`` blocks, then the rest) and completes once: bytes summed, the blocks a load
    could not move given as positions in the whole job, bit-exact either way."""
    from kvpool.shared.protocol import LEAD_BLOCKS, SPLIT_MIN_BLOCKS
    trace = tmp_path / "trace.txt"
    daemon = daemon_factory(extra=["--trace", str(trace)])
    n = SPLIT_MIN_BLOCKS + 44
    kv = HostKv(blocks=n)
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    try:
        keys = kv.keys(list(range(n * kv.block_tokens)))
        kv.fill_random(list(range(n)), seed=5)
        want = kv.blocks_of(list(range(n)))
        job = keyed_store(sched, worker, reg, kv.namespace, list(range(n)), keys)
        done = worker.wait([job], 10)
        assert [d.ok for d in done] == [True], done[0].message
        assert done[0].nbytes == n * kv.layout.shard_bytes
        rows = [line.split() for line in wait_for(     # (its lines come as each job ends)
            lambda: trace.exists() and len(trace.read_text().splitlines()) > 1
            and trace.read_text().splitlines(), 5, lambda: "two trace lines")]
        assert [(r[2], int(r[3])) for r in rows] == [("store", LEAD_BLOCKS),
                                                     ("store", n - LEAD_BLOCKS)], rows
        hit = sched.lookup(kv.namespace, [keys])
        assert hit.hits == [n]
        # A load with one block gone in each part (no ref, a key nobody holds): those two fail
        # alone, at their positions in the job; every other block comes back as stored.
        refs = list(hit.slots[0])
        gone = [10, LEAD_BLOCKS + 100]
        for k in gone:
            refs[k], keys[k] = 0, b"\xee" * 16
        kv.poison(list(range(n)))
        load = worker.submit_load(reg, refs, list(range(n)), keys)
        (got,) = worker.wait([load], 10)
        assert got.ok and got.failed == tuple(gone), got
        assert worker.poll() == [], "a job sent in two completes once"
        back = kv.blocks_of(list(range(n)))
        keep = [k for k in range(n) if k not in gone]
        assert torch.equal(back[:, :, keep], want[:, :, keep])
        # The rest refused (a ticket of no grant in it), the lead taken: the job fails, once,
        # with the rest's reason.
        more = kv.keys(list(range(n * kv.block_tokens)), salt=b"again")
        tickets = sched.reserve(kv.namespace, n)
        slots = list(tickets.slots)
        slots[LEAD_BLOCKS + 5] = 0xFFFF_FFF0
        bad = worker.submit_store(reg, list(range(n)), slots, keys=more,
                                  grant=tickets.daemon_id)
        (failed,) = worker.wait([bad], 10)
        assert not failed.ok and "0xfffffff0" in failed.message, failed
        assert failed.nbytes == 0 and failed.failed == ()
        assert worker.poll() == []
    finally:
        sched.close(); worker.close(); kv.close()


def test_a_big_job_whose_rest_cannot_be_sent_fails_once_after_its_lead(daemon):
    """The lead went, the rest could not (the daemon's queue refused it): the call returns the
    job's id rather than raising (the lead may be copying into the engine's blocks), and the
    job fails once, when the lead is answered, saying the rest was not sent."""
    from kvpool.shared.errors import DaemonUnavailable, ErrorCode
    from kvpool.shared.protocol import SPLIT_MIN_BLOCKS
    n = SPLIT_MIN_BLOCKS
    kv = HostKv(blocks=n)
    worker, reg = kv.register(daemon.client_config())
    real, sends = worker._t.send_connected, []

    def second_refused(make):
        sends.append(make)
        if len(sends) == 2:
            raise DaemonUnavailable("kvpoold is not accepting requests (test)")
        return real(make)

    try:
        worker._t.send_connected = second_refused
        job = worker.submit_load(reg, [0] * n, list(range(n)))
        worker._t.send_connected = real
        assert len(sends) == 2
        (done,) = worker.wait([job], 10)
        assert not done.ok and done.code == ErrorCode.ABORTED, done
        assert "not sent" in done.message and done.failed == ()
        assert worker.poll() == []
    finally:
        worker.close(); kv.close()
