"""``daemon/cuda.py`` on CPU, through a stand-in for the driver library: what the pool's host
registration asks the driver for."""

from __future__ import annotations

import pytest

from kvpool.daemon import cuda


class Recorder:
    """The driver calls a host registration makes, recorded; every one succeeds."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, int]] = []   # (address, bytes, flags)
        self.contexts: list[int] = []

    def check(self, call: str, code: int) -> None:
        assert code == cuda.CUDA_SUCCESS, call

    def cuDeviceGet(self, out, ordinal: int) -> int:
        out._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, out, dev) -> int:
        out._obj.value = 0x1000 + dev.value
        return 0

    def cuCtxSetCurrent(self, ctx: int) -> int:
        self.contexts.append(ctx)
        return 0

    def cuMemHostRegister(self, addr: int, nbytes: int, flags: int) -> int:
        self.registered.append((addr, nbytes, flags))
        return 0

    def cuMemHostGetDevicePointer(self, out, addr: int, _flags: int) -> int:
        out._obj.value = addr                      # UVA: the device sees the host address
        return 0


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(cuda, "_driver", rec)
    monkeypatch.setattr(cuda, "_contexts", {})
    return rec


def test_the_pool_is_pinned_once_for_every_gpu(recorder):
    """One daemon serves every GPU of the host from one pool (issue 28): it registers each
    piece once, portable (pinned for every GPU's context, not only the one registering) and
    device-mapped (the copy kernel reads it over UVA). A registration per GPU would pin the
    same pages eight times over; one without the portable flag would leave GPUs 1-7 copying
    from pageable memory at a third of the link."""
    base, piece = 1 << 30, 64 << 20
    reg = cuda.HostRegistration(base, 3 * piece - 4096, piece).start(0)
    assert reg.wait(10) and reg.is_complete, reg.error
    assert [(a, n) for a, n, _ in recorder.registered] == [
        (base, piece), (base + piece, piece), (base + 2 * piece, piece - 4096)]
    want = cuda.CU_MEMHOSTREGISTER_PORTABLE | cuda.CU_MEMHOSTREGISTER_DEVICEMAP
    assert all(flags & want == want for _, _, flags in recorder.registered)
    assert reg.is_uva_identity


def test_pieces_with_a_phase_meet_at_the_phase_plus_whole_pieces(recorder):
    """A daemon's pool is registered in pieces that meet where its extents do (its tables
    come first): a first piece of ``phase`` bytes, then whole pieces, the last one short."""
    base, piece, phase = 1 << 30, 64 << 20, 5 << 20
    reg = cuda.HostRegistration(base, 3 * piece, piece, phase).start(0)
    assert reg.wait(10) and reg.is_complete, reg.error
    assert [(a - base, n) for a, n, _ in recorder.registered] == [
        (0, phase), (phase, piece), (phase + piece, piece), (phase + 2 * piece, piece - phase)]
    assert reg.registered_end == base + 3 * piece
