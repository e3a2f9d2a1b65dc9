"""Registrations whose memory is being attached: the copy engine's ``attach`` runs on a thread of
this module's own, never on the event loop, and the server finishes the registration on the loop
once it is done.

Why: an attach waits for the CUDA engine's start, opens every region's CUDA IPC handle (a few ms
each, tens of regions for a per-layer layout), on a GPU's first registration makes its streams
and threads, and for a host region may have to back a sparse shm segment; run on the loop it
held it 26-68 ms at first registrations (issue 36) while every other client of the daemon
waited.

While an attach runs the daemon serves on, so its result may no longer be wanted when it comes:
its client left (bye, silence, process exit), sent the same registration again, or the daemon
is stopping. Such an attach is marked (``drop_owner``, a later ``start``, ``close``), and what it
mapped is detached here the moment it comes back, so nothing it opened outlives it. The
registry, the index and the socket are the server's: this module only hands it each outcome
(``done``, on the loop).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from kvpool.daemon.copy_engine import CopyEngine, Mapped
from kvpool.daemon.registry import Owner
from kvpool.shared.errors import Aborted
from kvpool.shared.protocol import RegisterRequest

log = logging.getLogger("kvpoold")

# The workers of an engine register at once (one registration per TP rank and KV-cache group):
# a few threads let one's shm maps or wait for CUDA overlap another's (the CUDA engine opens IPC
# handles one at a time under its own lock either way).
ATTACH_THREADS = 4


@dataclass(eq=False)
class Attaching:
    """A registration whose engine attach is running."""

    owner: Owner
    msg: RegisterRequest
    engine: CopyEngine
    is_wanted: bool = True
    # Why it is not, as its client's answer (None: nobody is left to answer).
    refusal: Aborted | None = None

    @property
    def key(self) -> tuple[bytes, int]:
        """What a registration replaces within its client: (namespace, tp_rank)."""
        return self.msg.namespace, self.msg.tp_rank

    def drop(self, refusal: Aborted | None) -> None:
        self.is_wanted, self.refusal = False, refusal


# Called on the loop once per attach with (attaching, mapped, error): ``mapped`` is None when
# the attach raised (``error``) or was not wanted (``error``: its refusal, or None).
Done = Callable[[Attaching, Mapped | None, BaseException | None], None]


class Attaches:
    """The attaches in flight and the threads they run on. Event-loop thread only."""

    def __init__(self, done: Done, threads: int = ATTACH_THREADS) -> None:
        self._done = done
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="kvpool-attach")
        self._in_flight: dict[asyncio.Future, Attaching] = {}

    def __len__(self) -> int:
        return len(self._in_flight)

    def start(self, owner: Owner, msg: RegisterRequest, engine: CopyEngine) -> Attaching:
        """Attach ``msg``'s regions off the loop; its outcome goes to ``done``.

        One of ``owner``'s attaches of the same (namespace, tp_rank) still running is dropped,
        answered ABORTED: the later request wins, as a re-registration replaces a registration
        (a client that timed out and sent it again wants the one it now waits for, and the
        older one's memory may be gone)."""
        attaching = Attaching(owner, msg, engine)
        for other in self.of(owner):
            if other.key == attaching.key:
                other.drop(Aborted(f"superseded by a later registration (request {msg.req_id}) "
                                   f"of the same namespace and rank"))
        fut = asyncio.get_running_loop().run_in_executor(self._threads, engine.attach, msg,
                                                         owner.peer)
        self._in_flight[fut] = attaching
        fut.add_done_callback(self._finished)
        return attaching

    def of(self, owner: Owner) -> list[Attaching]:
        """``owner``'s attaches still wanted."""
        return [a for a in self._in_flight.values() if a.owner is owner and a.is_wanted]

    def drop_owner(self, owner: Owner) -> None:
        """``owner`` is released: its attaches are detached as they come back and answered
        ABORTED (every request gets its one reply: a client released by a new Hello on the same
        socket is still there to read it; a gone one's is dropped by the socket)."""
        for a in self.of(owner):
            a.drop(Aborted("the client was released (bye, a new hello, silence or exit) "
                           "before its registration was attached: register again"))

    async def close(self, timeout_s: float) -> None:
        """Start no more and wait up to ``timeout_s`` for the running ones, whose clients are
        answered ABORTED and whose memory is detached. One still running after that (a driver
        call that hangs) is left to the process's exit: the engines close next."""
        for a in self._in_flight.values():
            if a.is_wanted:
                a.drop(Aborted("kvpoold is stopping"))
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout_s)

    def _finished(self, fut: asyncio.Future) -> None:
        attaching = self._in_flight.pop(fut)
        mapped: Mapped | None = None
        error: BaseException | None
        if fut.cancelled():          # never started: close() cancelled it
            error = Aborted("kvpoold is stopping")
        else:
            error = fut.exception()
            if error is None:
                mapped = fut.result()
        if not attaching.is_wanted:
            if mapped is not None:
                _detach(attaching, mapped)
            mapped, error = None, attaching.refusal
        self._done(attaching, mapped, error)


def _detach(attaching: Attaching, mapped: Mapped) -> None:
    try:
        attaching.engine.detach(mapped)
    except Exception:
        log.exception("detaching a registration no longer wanted (client %d) failed",
                      attaching.owner.id)
