"""The shared-memory index's reader (client/index_reader.py) against a writer in another
process (daemon/index_segment.py) putting, moving and removing keys as fast as it can: no
probe may ever see a key with a ref that key did not hold."""

import os
import secrets
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from kvpool.client.index_reader import IndexReader
from kvpool.shared import index_format as f

# Every test here runs with the compiled probe and with numpy's.
pytestmark = pytest.mark.usefixtures("index_probe")

NS = b"R" * 16
KEYS = 3000
ID_BITS = 20
WRITER_OPS = 150_000    # the probes go on until the writer has changed the table this often

# Keys 0..KEYS-1 come and go at random, one at a time and in batches (the store path's
# put_many and remove_many write many entries phase by phase); each put gives the key a new
# ref, (version << 20) | i, so a hit whose ref names another key (a body torn between two
# entries, a stale slot of a moved entry) is caught. Stops when its stdin closes.
_WRITER = r"""
import os, random, sys, threading
from kvpool.daemon.index_segment import IndexSegment
from kvpool.shared import index_format as f
name, ns = sys.argv[1], bytes.fromhex(sys.argv[2])
seg = IndexSegment(name, 4096, "writer")
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
rng = random.Random(1)
live, version, ops, said = set(), 0, 0, False
key = lambda i: ns + i.to_bytes(8, "little") + b"\x33" * 8
while not stop.is_set():
    for _ in range(1000):
        i = rng.randrange(%(keys)d)
        if i in live and rng.random() < 0.5:
            seg.remove(key(i)); live.discard(i)
        else:
            version += 1
            seg.put(key(i), f.POOL, (version << %(bits)d) | i); live.add(i)
        ops += 1
    for _ in range(20):
        batch = rng.sample(range(%(keys)d), 40)
        gone = [i for i in batch if i in live][:20]
        seg.remove_many([key(i) for i in gone]); live.difference_update(gone)
        came = [i for i in batch if i not in gone]
        version += 1
        seg.put_many([key(i) for i in came], f.POOL,
                     [(version << %(bits)d) | i for i in came]); live.update(came)
        ops += len(batch)
    if ops >= %(enough)d and not said:
        print("enough", flush=True)
        said = True
print("ops", ops, flush=True)
seg.close()
""" % {"keys": KEYS, "bits": ID_BITS, "enough": WRITER_OPS}


@pytest.mark.skipif(not f.reader_supported(), reason="the reader needs x86-64's memory order")
def test_a_million_probes_against_a_writer_at_full_rate_see_no_wrong_hit():
    name = f"/kvpool-test-race-{os.getpid()}-{secrets.token_hex(4)}"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, name, NS.hex()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", "the writer did not start"
        reader = IndexReader.open(name)
        hashes = [i.to_bytes(8, "little") + b"\x33" * 8 for i in range(KEYS)]
        ids = np.arange(KEYS, dtype=np.uint64)
        probes = hits = 0
        rng = np.random.default_rng(2)
        deadline = time.monotonic() + 120
        writer_done = False
        while probes < 1_000_000 or not writer_done:
            assert time.monotonic() < deadline, (
                f"{probes} probes in 120 s, the writer {'done' if writer_done else 'not done'}")
            if not writer_done and select.select([writer.stdout], [], [], 0)[0]:
                assert writer.stdout.readline().strip() == "enough", "the writer failed"
                writer_done = True
            pick = rng.choice(KEYS, 256, replace=False)
            loc, ref = reader.find(NS, [hashes[i] for i in pick])
            hit = loc != f.EMPTY
            wrong = hit & (((ref & np.uint64((1 << ID_BITS) - 1)) != ids[pick])
                           | (loc != f.POOL))
            assert not wrong.any(), (f"wrong hit: key {pick[wrong][0]} read with ref "
                                     f"{int(ref[wrong][0]):#x}, location {loc[wrong][0]}")
            probes += len(pick)
            hits += int(hit.sum())
        writer.stdin.close()
        ops = int(writer.stdout.readline().split()[1])
        assert writer.wait(10) == 0
        reader.close()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        writer.stdout.close()
        if not writer.stdin.closed:
            writer.stdin.close()
    # The race was real: the writer kept changing the table while the probes ran.
    assert ops >= WRITER_OPS and 0.1 * probes < hits < 0.9 * probes, (ops, hits, probes)


def test_open_refuses_what_is_not_an_index(tmp_path):
    import posix_ipc
    name = f"/kvpool-test-notidx-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=8192)
    try:
        with pytest.raises(ValueError, match="another format"):
            IndexReader.open(name)
    finally:
        shm.close_fd()
        posix_ipc.unlink_shared_memory(name)
    with pytest.raises(FileNotFoundError):
        IndexReader.open(name)


def test_another_user_cannot_map_the_index():
    """The segment has the daemon socket's owner, group and mode (0600 by default): a user who
    may not connect may not read it either (POSIX shm objects are files in /dev/shm)."""
    from bench.soak.security import NOBODY, system_python
    from kvpool.daemon.index_segment import IndexSegment
    py = system_python()
    if os.geteuid() != 0 or py is None:
        pytest.skip("needs root and a system Python to run a probe as another user")
    seg = IndexSegment(f"/kvpool-test-uid-{os.getpid()}-{secrets.token_hex(4)}", 4096, "d")
    try:
        probe = ("import os, sys\ntry:\n    os.open('/dev/shm' + sys.argv[1], os.O_RDONLY)\n"
                 "except PermissionError:\n    print('refused')\nelse:\n    print('mapped')\n")
        out = subprocess.run([py, "-c", probe, seg.name], capture_output=True, text=True,
                             timeout=60, user=NOBODY, group=NOBODY, extra_groups=[],
                             env={"PATH": "/usr/bin:/bin"}, cwd="/")
        assert out.stdout.strip() == "refused", (out.stdout, out.stderr)
        mine = subprocess.run([py, "-c", probe, seg.name], capture_output=True, text=True,
                              timeout=60)
        assert mine.stdout.strip() == "mapped", "the probe itself must be able to succeed"
    finally:
        seg.close()
