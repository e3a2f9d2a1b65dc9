"""What a claim's pass costs on cold slots, and how much of it is the objects it replaces (CPU).

    python -m bench.investigations.claim_churn [--slots 128] [--jobs 300] [--flush-mib 64]

``SlotTable.claim`` was the largest piece of a busy event loop's Python on an H200 host (13%
of its samples, py-spy, bench/README.md). Its pass writes eleven fields of each slot; three of
them replace an object of the block before: the generation and the slot ref (ints past the
small-int cache: a new one made, the old one freed) and the key (``ns + hash``: a new bytes,
the old freed). After a copy's DMA the old objects are cold, and freeing one touches its
header and its pymalloc pool. This times the pass on ``--slots`` random slots of 200,000
(each with a key, generation and ref of its own) after ``--flush-mib`` of memory is written,
with every field, then without the ref, the key or the generation (``ns`` per job, variants
shuffled job by job in one process), and as ``SlotTable.claim`` does it now (``ref+key``: the
generation is the ref's upper half, one int a slot, the next ref one addition). Not the
daemon's code: its pass, copied onto a stand-in of the slot as it was (a generation field of
its own), with parts left out, to weigh them.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np

NS = b"n" * 16
MASK = 0x7FFF_FFFF
GENERATION_ONE = 1 << 32                 # a ref's generation is its upper half
REF_LIMIT = (MASK + 1) << 32             # past the last generation: back to 0
VARIANTS = ("gen+ref+key", "ref+key", "gen+ref", "gen+key", "key", "none")


@dataclass(slots=True, eq=False)
class Slot:
    """The slot's fields as they were before the generation became the ref's upper half."""
    id: int
    state: int = 0
    generation: int = 0
    ns: bytes = b""
    key: bytes = b""
    block_hash: bytes = b""
    ref: int = 0
    pins: int = 0
    writing: int = 0
    owner: int = 0
    deadline: float = 0.0
    ticket: int = 0


def claim(slots: list[Slot], hashes: list[bytes], fields: str) -> None:
    gen_ref, key, gen = "ref" in fields, "key" in fields, "gen" in fields
    for s, h in zip(slots, hashes):
        if gen:
            g = s.generation = (s.generation + 1) & MASK
            if gen_ref:
                s.ref = (g << 32) | s.id
        elif gen_ref:
            r = s.ref + GENERATION_ONE
            s.ref = r if r < REF_LIMIT else s.id
        s.state = 1
        s.ns = NS
        if key:
            s.key = NS + h
        s.block_hash = h
        s.owner = 7
        s.deadline = 1.0
        s.writing = 1
        s.pins = 1
        s.ticket = 0


def run(slots: int, jobs: int, flush_mib: int, table: int = 200_000) -> dict[str, list[int]]:
    """Nanoseconds per pass, by variant, in job order."""
    rng = random.Random(36)
    every = [Slot(i) for i in range(table)]
    for s in every:
        s.block_hash = os.urandom(16)
        s.key = NS + s.block_hash
        s.generation = rng.randrange(1 << 31)
        s.ref = (s.generation << 32) | s.id
    flush = np.zeros(flush_mib << 20, np.uint8) if flush_mib else None
    times: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for job in range(jobs):
        for fields in rng.sample(VARIANTS, len(VARIANTS)):
            chosen = rng.sample(every, slots)
            hashes = [os.urandom(16) for _ in chosen]
            if flush is not None:
                flush.fill(job & 0xFF)
            # as after the eviction that freed them: the victims' hashes were read to unmap them
            for s in chosen:
                hash(s.block_hash)
            t0 = time.perf_counter_ns()
            claim(chosen, hashes, fields)
            times[fields].append(time.perf_counter_ns() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--flush-mib", type=int, default=64)
    args = ap.parse_args()
    for fields, ns in run(args.slots, args.jobs, args.flush_mib).items():
        print(f"{fields:12s}: median {statistics.median(ns[len(ns) // 10:]) / 1e3:6.1f} us per "
              f"pass over {args.slots} slots")


if __name__ == "__main__":
    main()
