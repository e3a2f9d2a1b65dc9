"""daemon/off_loop.py: a blocking call awaited on its own thread while the loop runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvpool.daemon.off_loop import off_loop


def test_the_loop_runs_while_the_call_blocks_and_gets_its_result():
    release = threading.Event()
    seen = []

    def blocking() -> str:
        assert release.wait(30), "the loop never ran while the call blocked"
        seen.append(threading.current_thread().name)
        return "made"

    async def main() -> str:
        waiting = asyncio.create_task(off_loop(blocking, "kvpool-test-make"))
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_soon(release.set)   # runs only if the loop does
        return await waiting

    assert asyncio.run(main()) == "made" and seen == ["kvpool-test-make"]
    assert not any(t.name == "kvpool-test-make" for t in threading.enumerate())


def test_the_calls_exception_is_raised_in_the_awaiting_task():
    def failing() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        asyncio.run(off_loop(failing, "kvpool-test-fail"))


def test_a_cancelled_wait_discards_what_the_call_made():
    started, release = threading.Event(), threading.Event()
    discarded = []

    def blocking() -> str:
        started.set()
        assert release.wait(30), "never released"
        return "segment"

    async def main() -> None:
        waiting = asyncio.create_task(off_loop(blocking, "kvpool-test-cancel",
                                               discard=discarded.append))
        while not started.is_set():
            await asyncio.sleep(0.001)
        waiting.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    assert discarded == ["segment"]
