"""Fixtures shared by every test: a real kvpoold process on a temporary socket and pool, a
Mooncake master, and a pool opened in the test's own process."""

from __future__ import annotations

import gc
import os
import secrets

import pytest

from bench.kvtest import DaemonProcess, unless_unavailable  # noqa: F401  (tests import them from here)
from bench.mooncake import MooncakeMaster
from bench.soak.common import stop_process, wait_for  # noqa: F401  (tests import them from here)
from bench.soak.common import wait_for_async  # noqa: F401  (likewise)
from kvpool.daemon.pool import Pool
from kvpool.shared.config import DaemonConfig


@pytest.fixture(autouse=True)
def _thawed_heap():
    """A server made in the test's process freezes the heap as it starts serving
    (daemon/heap.py): thawed after each test, so one test's objects are collectable in the
    next."""
    yield
    gc.unfreeze()


@pytest.fixture
def daemon_factory(tmp_path):
    made: list[DaemonProcess] = []

    def make(pool_size: str = "64MiB", extra: list[str] | None = None, start: bool = True,
             subdir: str | None = None) -> DaemonProcess:
        d = tmp_path / (subdir or f"d{len(made)}")
        d.mkdir(exist_ok=True)
        proc = DaemonProcess(d, pool_size, extra)
        made.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in made:
        proc.cleanup()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture
def mooncake_master(tmp_path):
    """A running ``mooncake_master`` on free loopback ports (skips where Mooncake is missing)."""
    m = MooncakeMaster(tmp_path).start()
    yield m
    m.cleanup()


@pytest.fixture
def pool_config():
    cfg = DaemonConfig(pool_name=f"kvpool-unit-{os.getpid()}-{secrets.token_hex(4)}",
                       pool_size="8MiB", extent_size="1MiB")
    yield cfg
    import posix_ipc
    try:
        posix_ipc.unlink_shared_memory("/" + cfg.pool_name)
    except posix_ipc.ExistentialError:
        pass


@pytest.fixture
def pool(pool_config):
    p = Pool.open(pool_config)
    yield p
    p.close(unlink=True)


def _compiled(module, what: str, source: str):
    """``module`` where the install built it (a C compiler and Python's headers, as in CI);
    fails where it could have been built and was not, skips where it could not."""
    import shutil
    import sysconfig

    if module is None:
        headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        assert shutil.which("cc") is None or not os.path.exists(headers), (
            f"a C compiler and Python's headers are here but the {what} was not built: "
            f"pip install -e . builds {source}")
        pytest.skip(f"no C compiler or Python headers: the compiled {what} was not built")
    return module


@pytest.fixture
def compiled_index_probe():
    """client/_index_probe.c."""
    import kvpool.client.index_reader as index_reader
    return _compiled(index_reader._index_probe, "index probe", "client/_index_probe.c")


@pytest.fixture
def compiled_index_writer():
    """daemon/_index_writer.c."""
    import kvpool.daemon.index_segment as index_segment
    return _compiled(index_segment._index_writer, "index writer", "daemon/_index_writer.c")


@pytest.fixture
def compiled_pool_records():
    """daemon/_pool_records.c."""
    import kvpool.daemon.pool as pool_module
    return _compiled(pool_module._pool_records, "pool record writer", "daemon/_pool_records.c")


@pytest.fixture
def compiled_lru():
    """daemon/_lru.c."""
    from kvpool.daemon import eviction
    return _compiled(eviction._lru, "LRU queue", "daemon/_lru.c")


@pytest.fixture
def compiled_slot_record():
    """daemon/_slot_record.c, as daemon/slot_record.py wraps it."""
    from kvpool.daemon import slot_record
    return _compiled(slot_record.COMPILED, "slot record", "daemon/_slot_record.c")


@pytest.fixture(params=["compiled", "python"])
def slot_records(request, monkeypatch):
    """Runs a test once with each kind of slot record (daemon/slot_record.py): the compiled
    one and the dataclass with Python passes it falls back to. Pools made in the test use it."""
    from kvpool.daemon import slot_record
    records = (request.getfixturevalue("compiled_slot_record") if request.param == "compiled"
               else slot_record.PYTHON)
    monkeypatch.setattr(slot_record, "RECORDS", records)
    return records


@pytest.fixture(params=["compiled", "numpy"])
def record_writer(request, monkeypatch):
    """Runs a test of the pool's record writes once with each: the compiled ones and the
    numpy ones they fall back to."""
    import kvpool.daemon.pool as pool_module
    if request.param == "numpy":
        monkeypatch.setattr(pool_module, "_pool_records", None)
    else:
        request.getfixturevalue("compiled_pool_records")
    return request.param


@pytest.fixture(params=["compiled", "python"])
def index_writer(request, monkeypatch):
    """Runs a test of the shared-memory index's writer once with each: the compiled one and
    the Python one it falls back to."""
    import kvpool.daemon.index_segment as index_segment
    if request.param == "python":
        monkeypatch.setattr(index_segment, "_index_writer", None)
    else:
        request.getfixturevalue("compiled_index_writer")
    return request.param


@pytest.fixture(params=["compiled", "numpy"])
def index_probe(request, monkeypatch):
    """Runs a test of the shared-memory index's reader once with each probe: the compiled one
    and the numpy one it falls back to."""
    import kvpool.client.index_reader as index_reader
    if request.param == "numpy":
        monkeypatch.setattr(index_reader, "_index_probe", None)
    else:
        request.getfixturevalue("compiled_index_probe")
    return request.param
