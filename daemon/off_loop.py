"""Work the event loop must wait for but must not run: a blocking call on a thread of its own,
awaited, so that the loop keeps running (its timers, its gap watch) meanwhile.

A thread per call, not an executor: nothing of it outlives the call. A caller torn down while
it waits (the awaiting task cancelled) still waits for the thread, then hands the result it
will never use to ``discard``: what the call made (a shared-memory segment) is not left behind.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


async def off_loop(make: Callable[[], T], name: str,
                   discard: Callable[[T], object] | None = None) -> T:
    """``make()``'s result (or its exception), ``make`` run on a thread called ``name``."""
    made: Future = Future()

    def run() -> None:
        try:
            made.set_result(make())
        except BaseException as e:  # noqa: BLE001 - raised again in the awaiting task
            made.set_exception(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        # Shielded: a cancelled wait must not cancel ``made`` under the thread that sets it.
        return await asyncio.shield(asyncio.wrap_future(made))
    except asyncio.CancelledError:
        thread.join()
        if discard is not None and made.exception() is None:
            discard(made.result())
        raise
    finally:
        thread.join()       # past its result already: microseconds
