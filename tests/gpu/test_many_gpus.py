"""One daemon for every GPU of the host (issue 28), on the GPUs there are: the pool pinned once
is pinned in every GPU's context, and engines on every GPU (several per GPU where there are
fewer GPUs than engines) store and load at once, each on its GPU's own lanes, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gpu_worker import Worker, gpu_count

GPUS = gpu_count()
POISON = 0x5A
PER_ENGINE = 8                  # slots each engine stores into, its own


def test_the_pool_pinned_once_is_pinned_in_every_gpus_context(engine, pool):
    """Registered once (on GPU 0's context) with the portable flag: every GPU's context sees
    the pool as pinned, device-mapped memory at its own address (UVA); without the flag GPUs
    1-7 would fail here, and copy from pageable memory."""
    from kvpool.daemon import cuda
    for k in range(GPUS):
        cuda.use_device(k)
        for a, _ in engine.registration.registered:
            assert cuda.host_device_pointer(a) == a, f"GPU {k} does not see piece {a:#x} pinned"


@pytest.mark.parametrize("layout", ["block_outer", "per_layer"])
def test_engines_on_every_gpu_copy_at_once_on_their_gpus_lanes(engine, pool, layout):
    n = max(3, GPUS)            # at least three, so that some share a GPU
    ws = [Worker(i % GPUS, layout, 2 * PER_ENGINE) for i in range(n)]
    try:
        regs = [w.register_request(namespace=b"many-%d" % i) for i, w in enumerate(ws)]
        ms = [engine.attach(r) for r in regs]
        assert [m.ordinal for m in ms] == [i % GPUS for i in range(n)]
        assert set(engine._gpus) >= set(range(GPUS))
        streams = {(k, lane.stream) for k, g in engine._gpus.items() for lane in (g.store, g.load)}
        assert len({s for _, s in streams}) == len(streams), "two GPUs share a stream"
        blocks = np.arange(PER_ENGINE)
        offs = [(blocks + i * PER_ENGINE) * regs[i].layout.slot_bytes for i in range(n)]
        wants = []
        for i, w in enumerate(ws):
            w.call("fill", 300 + i)
            wants.append(w.call("blocks", blocks.tolist()))
        futs = [engine.submit_store(m, blocks, o, w.call("event"))
                for m, o, w in zip(ms, offs, ws)]
        for f in futs:
            f.result(60)
        for w in ws:
            w.call("poison", POISON)
        futs = [engine.submit_load(m, o, blocks + PER_ENGINE) for m, o in zip(ms, offs)]
        for f in futs:
            f.result(60)
        for i, w in enumerate(ws):
            got = w.call("blocks", (blocks + PER_ENGINE).tolist())
            assert np.array_equal(got, wants[i]), f"engine {i} (GPU {i % GPUS}) got other bytes"
            assert (w.call("blocks", blocks.tolist()) == POISON).all()
        for m in ms:
            engine.detach(m, wait_s=10)
    finally:
        for w in ws:
            w.close()
