"""A real kvpoold's event loop is never held for more than 50 ms, from its start through its
first registration and the seconds after, when a restarted daemon's background work used to
run (issue 36): clients time out after 2 s, and a restarted daemon whose loop stalled 2-3.4 s
while torch's import held the GIL turned idle engines away."""

import re
import subprocess
import sys
import time

import pytest

from bench.kvtest import HostKv
from tests.conftest import wait_for

GAP_LIMIT_MS = 50.0
# what the old background work (torch's import after the socket was bound) took at most
SETTLE_S = 4.0
_LINE = re.compile(r"registration: longest event-loop gap since start ([0-9.]+) ms")


def _gap_ms(daemon, worker, n: int) -> float:
    """The longest gap the daemon logged at its ``n``-th registration since the test began (0:
    the first; the log is appended to across restarts), ``worker`` polled meanwhile as a
    connector polls it every step (a poll re-registers it with a restarted daemon)."""
    def logged():
        worker.poll()
        gaps = _LINE.findall(daemon.log())
        return gaps if len(gaps) > n else None
    gaps = wait_for(logged, 30, lambda: f"registration {n}'s line:\n{daemon.log()[-3000:]}")
    return float(gaps[n])


def _check(daemon, gap: float, when: str) -> None:
    assert gap <= GAP_LIMIT_MS, (
        f"{when}, the event loop had gone {gap:.1f} ms without running (run-queue waits taken "
        f"out):\n{daemon.log()[-3000:]}")


@pytest.mark.parametrize("busy", [0, 2], ids=["idle host", "two busy processes"])
def test_the_loop_is_never_held_over_50_ms_from_start_through_registrations(daemon_factory,
                                                                            busy):
    """``busy`` processes spin beside the daemon: on a loaded host, background work that
    holds a lock the loop needs (the pool's population held the mmap lock at nice 19, off the
    CPU for 285-624 ms) shows as a gap here."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
    try:
        _check_lives(daemon_factory)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _check_lives(daemon_factory) -> None:
    d = daemon_factory()
    kv, later = HostKv(), HostKv()
    first, _ = kv.register(d.client_config(), name="loop-gap worker")
    second = None
    try:
        seen = 0
        for life in ("first start", "restart onto the pool the first left"):
            started = time.monotonic()
            _check(d, _gap_ms(d, first, seen), f"{life}: at the first registration")
            # a second worker once the daemon has run a while (an idle engine's next call)
            time.sleep(max(0.0, started + SETTLE_S - time.monotonic()))
            if second is not None:
                second.close()
            second, _ = later.register(d.client_config(), name="loop-gap worker, later")
            _check(d, _gap_ms(d, first, seen + 1), f"{life}: {SETTLE_S:.0f} s after its start")
            seen += 2
            if life == "first start":
                d.kill()
                d.restart()
    finally:
        first.close()
        if second is not None:
            second.close()
        kv.close()
        later.close()
