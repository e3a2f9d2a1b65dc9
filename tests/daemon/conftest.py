import os
import secrets

import pytest

from kvpool.daemon.pool import Pool
from kvpool.shared.config import DaemonConfig


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
