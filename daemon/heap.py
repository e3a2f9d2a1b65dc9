"""The cyclic garbage collector's pauses on the event loop: what lives as long as the daemon is
kept out of its collections.

CPython collects its oldest generation by walking every object tracked there, with the GIL
held, whenever a quarter as many objects as that generation holds have survived into it since
its last collection. A daemon that imported torch tracks ~174K objects (a full collection of
them took 208 ms on this VM), and each slot of the pool is one more: while a fresh pool of 1M
slots fills, such collections come every few hundred thousand slots and grow with them
(``bench/investigations/gc_pause.py``).

So the daemon moves what it keeps for good into the permanent generation (``gc.freeze``,
which splices the generations' lists: O(1)), out of every later collection: its startup heap
once it serves, then each extent's slots as they are made. Nothing is collected first (that
would be the pause): cyclic garbage alive at a freeze is kept, so freezes are few, one per
extent assignment. Off until ``settle`` (tests build pools without it).
"""

from __future__ import annotations

import gc


class Heap:
    """Freezes the daemon's lasting objects: ``settle`` once it serves, ``keep_new`` after it
    made lasting objects in bulk (an extent's slots: ``daemon/extents.py``)."""

    def __init__(self) -> None:
        self.settled = False
        self.freezes = 0

    def settle(self) -> None:
        """The startup's heap (modules, torch, an adopted pool's slots) lasts: frozen."""
        gc.freeze()
        self.settled = True
        self.freezes += 1

    def keep_new(self) -> None:
        """Objects made since the last freeze last (called as an extent's slots are made):
        frozen, once the daemon has settled."""
        if self.settled:
            gc.freeze()
            self.freezes += 1
