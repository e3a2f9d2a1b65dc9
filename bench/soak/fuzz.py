"""Part 4, fuzz: frames mutated from ones captured off a real client session, thrown at a real
daemon from several connections; it must answer every one (an error is an answer), never with
INTERNAL, stay up, and keep another client's blocks intact.

Capture: a real worker and scheduler (``bench.soak.client.Engine``) run one session (hello,
heartbeat, register, reserve, keyed store, lookup, load, release, abort, info, ping, reset,
unregister) while ``protocol.encode`` records every frame they send. Protocol 1's
``PrepareStoreRequest`` (tag 7, retired by protocol 2) joins them as a frame of its own, so
mutations of it are thrown too; before the fuzzing, one such frame on a fresh connection must
get a ``PROTOCOL`` error and leave that connection serving (``fuzz_retired_tag_refused``).

Mutations, each from a captured frame: a value replaced by one of another type, a huge or
negative integer, an out-of-range or stale slot ref, a crafted shm name (``../`` paths, NUL
bytes, the daemon's own pool, a decoy segment, a missing one, overlong names), a key of the wrong
length; list items dropped, repeated or appended; an unknown message tag; the encoded bytes cut
short, bit-flipped or grown; and captured frames replayed as they are (duplicate
registrations).
"""

from __future__ import annotations

import copy
import os
import random
import time
from pathlib import Path

import msgspec
import zmq

from bench.soak.common import Daemon, ShmBlocks, unlink_shm
from kvpool.shared import protocol as p
from kvpool.shared.errors import ErrorCode

_INTS = [0, 1, -1, 2, 7, 255, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40,
         2**62, 2**63 - 1, -2**63, 2**64 - 1, -2**31]
_OTHER = ["", "x", b"", b"\0" * 16, 1.5, -0.0, float("inf"), None, True, False, [], {}, [[]],
          [None], {"a": 1}, [0] * 64]


def _capture(socket: str) -> list[bytes]:
    """Frames a real client session sends, recorded at ``protocol.encode``."""
    from bench.soak.client import Engine
    frames: list[bytes] = []
    real = p.encode

    def record(msg):
        out = real(msg)
        frames.append(out)
        return out
    p.encode = record
    try:
        eng = Engine(socket, 16, "soak fuzz capture", model="soak-fuzz-model")
        keys = eng.keys(range(8))
        eng.fill(list(range(8)), keys)
        assert eng.written(eng.store(list(range(8)), keys)) == 8
        hit = eng.sched.lookup(eng.ns, [keys, keys[:3]], pin=True)
        assert eng.worker.wait([eng.worker.submit_load(eng.reg, hit.slots[0],
                                                       list(range(8, 16)))], 30)[0].ok
        eng.sched.release(hit.leases)
        # Tickets: two bound by a keyed store, the rest given back unused.
        grant = eng.sched.reserve(eng.ns, 4)
        kept = grant.slots[:2]
        if kept:
            assert eng.worker.wait([eng.worker.submit_store(
                eng.reg, [0, 1][:len(kept)], kept, keys=eng.keys(range(200, 202))[:len(kept)],
                grant=grant.daemon_id)], 30)[0].ok
        eng.sched.abort_store(grant.slots[2:])
        eng.sched.info()
        eng.sched.ping()
        time.sleep(1.2)                 # at least one heartbeat goes out
        eng.sched.reset(eng.ns)
        eng.worker.unregister(eng.reg)
        eng.close()
    finally:
        p.encode = real
    return frames


def retired_prepare_frame(req_id: int, ns: bytes, keys: list[bytes]) -> bytes:
    """A protocol 1 ``PrepareStoreRequest`` (tag 7: req_id, namespace, keys), retired by
    protocol 2: the daemon must answer it ``PROTOCOL`` and nothing else."""
    return msgspec.msgpack.encode([7, req_id, ns, keys])


def _retired_tag_refused(ctx, socket: str, hello: bytes, ns: bytes) -> dict:
    """A retired tag-7 frame on a fresh connection: a ``PROTOCOL`` error naming its req_id,
    and the connection still serves the next request."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{socket}")
    try:
        replies = []
        for frame in (hello, retired_prepare_frame(4242, ns, [os.urandom(16) for _ in range(8)]),
                      p.encode(p.Ping(4243))):
            s.send(frame)
            if not s.poll(10_000):
                return {"refused": 0, "replies": [type(r).__name__ for r in replies]}
            replies.append(p.decode_reply(s.recv()))
        _, retired, pong = replies
        refused = (isinstance(retired, p.ErrorReply) and retired.code == ErrorCode.PROTOCOL
                   and retired.req_id == 4242 and isinstance(pong, p.Pong))
        return {"refused": int(refused), "reply": repr(retired)[:160],
                "then": type(pong).__name__}
    finally:
        s.close(0)


class _Mutator:
    def __init__(self, rng: random.Random, frames: list[bytes], names: list[str],
                 refs: list[int]) -> None:
        self.rng = rng
        self.frames = frames
        self.decoded = [msgspec.msgpack.decode(f) for f in frames]
        self.names = names
        self.refs = refs

    def _value(self, old):
        r = self.rng
        kind = r.random()
        if kind < 0.3:
            return r.choice(_INTS) if r.random() < 0.8 else r.randint(-2**63, 2**64 - 1)
        if kind < 0.45:
            ref = r.choice(self.refs) if self.refs else 0
            return r.choice([ref, ref + (1 << 32), ref - (1 << 32), ref + 1, ref ^ (1 << 31),
                             ref & 0xFFFF_FFFF])
        if kind < 0.65:
            return r.choice(self.names)
        if kind < 0.8:
            return os.urandom(r.choice([0, 1, 15, 16, 17, 32, 1000]))
        return copy.deepcopy(r.choice(_OTHER))

    def _paths(self, node, path, out):
        out.append(path)
        if isinstance(node, list):
            for i, child in enumerate(node):
                self._paths(child, path + (i,), out)

    def mutate(self) -> bytes:
        r = self.rng
        i = r.randrange(len(self.frames))
        op = r.random()
        if op < 0.05:
            return self.frames[i]                                   # replay as captured
        if op < 0.2:                                                # byte-level damage
            b = bytearray(self.frames[i])
            how = r.random()
            if how < 0.4:
                return bytes(b[:r.randrange(len(b))])
            if how < 0.8:
                for _ in range(r.randint(1, 4)):
                    j = r.randrange(len(b))
                    b[j] ^= 1 << r.randrange(8)
                return bytes(b)
            j = r.randrange(len(b) + 1)
            return bytes(b[:j] + os.urandom(r.randint(1, 16)) + b[j:])
        msg = msgspec.msgpack.decode(self.frames[i])
        for _ in range(r.choice([1, 1, 1, 2, 3])):
            paths: list[tuple] = []
            self._paths(msg, (), paths)
            path = r.choice(paths[1:] or paths)
            parent = msg
            for step in path[:-1]:
                parent = parent[step]
            last = path[-1] if path else None
            if last is None:
                break
            how = r.random()
            if path == (0,) and how < 0.5:
                parent[0] = r.choice([0, 7, 14, 63, 74, 200, -1, 2**40, "hello", None])
            elif how < 0.75:
                parent[last] = self._value(parent[last])
            elif how < 0.85:
                del parent[last]
            elif how < 0.95:
                parent.insert(last, copy.deepcopy(parent[last]))
            else:
                parent.append(self._value(None))
        try:
            return msgspec.msgpack.encode(msg)
        except (OverflowError, TypeError):
            return self.frames[i]


def run(workdir: Path, frames: int = 1_000_000, seconds: float = 3600, seed: int = 5,
        sockets: int = 4, window: int = 64) -> dict:
    rng = random.Random(seed)
    d = Daemon(workdir / "fuzz", pool_size="64MiB", extent_size="4MiB",
               extra=["--max-request-bytes", "1048576"])
    d.start()
    decoy_dir = workdir / "fuzz"
    decoy_file = decoy_dir / "decoy-file"
    decoy_file.write_bytes(b"decoy" * 100)
    decoy_shm = f"kvpool-decoy-{os.getpid()}"
    decoy = ShmBlocks(4, 4096, name=decoy_shm)       # not an engine segment: never to be opened
    decoy.blocks[:] = 7
    from bench.soak.client import Engine
    guardian = Engine(d.socket, 64, "soak fuzz guardian", model="soak-guardian-model")
    gids = list(range(5_000_000, 5_000_032))
    guardian.fill(list(range(32)), guardian.keys(gids))
    assert guardian.written(guardian.store(list(range(32)), guardian.keys(gids))) == 32
    own = ShmBlocks(64, 4096)                        # a segment of the fuzzer's own to name
    names = ["../../../../etc/passwd", "/dev/shm/x", "..", ".", "", "/", "x\0y",
             "kvpool-kv-../x", "kvpool-kv-" + "a" * 300, "kvpool-kv-\0", d.pool_name,
             "/" + d.pool_name, decoy_shm, "kvpool-engine-no-such-segment", "kvpool-engine-../x", own.name,
             str(decoy_file), "../" + decoy_file.name, "kvpool-kv-" + "\n" * 3]
    t0 = time.monotonic()
    sent = answered = 0
    codes: dict[str, int] = {}
    ctx = zmq.Context()
    try:
        captured = _capture(d.socket)
        hello = next(f for f in captured if msgspec.msgpack.decode(f)[0] == 1)
        fuzz_ns = next(m[2] for m in map(msgspec.msgpack.decode, captured) if m[0] == 15)
        retired = _retired_tag_refused(ctx, d.socket, hello, fuzz_ns)
        captured.append(retired_prepare_frame(77, fuzz_ns, [os.urandom(16) for _ in range(4)]))
        refs = [x for f in captured for x in _ints_of(msgspec.msgpack.decode(f)) if x > 2**32]
        mut = _Mutator(rng, captured, names, refs)
        socks = []
        for _ in range(sockets):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{d.socket}")
            socks.append(s)
        pending = [0] * sockets
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        for k, s in enumerate(socks):
            s.send(hello)
            pending[k] += 1
            sent += 1
        stalled_since = None
        while sent < frames and time.monotonic() - t0 < seconds:
            for k, s in enumerate(socks):
                while pending[k] < window and sent < frames:
                    # Now and then a fresh hello, so what follows reaches the handlers.
                    s.send(hello if rng.random() < 0.02 else mut.mutate())
                    pending[k] += 1
                    sent += 1
            ready = dict(poller.poll(1000))
            if not ready:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 30:
                    break                    # the daemon stopped answering: reported below
                continue
            stalled_since = None
            answered += _collect(socks, ready, pending, codes)
        # Drain what is still owed, bounded.
        deadline = time.monotonic() + 30
        while sum(pending) and time.monotonic() < deadline:
            answered += _collect(socks, dict(poller.poll(500)), pending, codes)
        internal = codes.get(ErrorCode.INTERNAL.name, 0)
        elapsed = time.monotonic() - t0
        survived = d.alive
        intact = 0
        if survived:
            d.wait_ready(30)
            hit = guardian.sched.lookup(guardian.ns, [guardian.keys(gids)], pin=True)
            guardian.mem.blocks[32:] = 0xA5
            ok = guardian.worker.wait([guardian.worker.submit_load(
                guardian.reg, hit.slots[0], list(range(32, 32 + hit.hits[0])))], 30)[0].ok
            if ok and hit.hits[0] == 32:
                intact = int(guardian.mismatches(list(range(32, 64)), guardian.keys(gids)) == 0)
            guardian.sched.release(hit.leases)
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text() if survived else ""
        decoys_touched = int("decoy" in maps or decoy_file.read_bytes() != b"decoy" * 100
                             or not (decoy.blocks == 7).all()
                             or not Path("/dev/shm/" + decoy_shm).exists())
        log_tail = d.log_tail(20)
    finally:
        for s in locals().get("socks", []):
            s.close(0)
        ctx.term()
        guardian.close()
        own.close()
        decoy.close()
        unlink_shm(decoy_shm)
        d.stop()
        d.cleanup()
    internal_lines = [line for line in log_tail.splitlines() if "internal error" in line][:3]
    return {
        "fuzz_frames": sent,
        "daemon_survived_fuzz": int(survived),
        "fuzz_other_client_intact": intact,
        "fuzz_internal_errors": internal,
        "fuzz_unanswered": sent - answered,
        "fuzz_decoys_touched": decoys_touched,
        "fuzz_retired_tag_refused": retired["refused"],
        "fuzz_detail": {"seconds": round(elapsed, 1), "frames_per_s": round(sent / elapsed),
                        "captured_frames": len(captured), "sockets": sockets,
                        "retired_tag": retired,
                        "error_codes": codes, "internal_error_log": internal_lines},
    }


def _collect(socks: list, ready: dict, pending: list[int], codes: dict[str, int]) -> int:
    """Read every reply waiting on the ``ready`` sockets; count them and their error codes."""
    n = 0
    for k, s in enumerate(socks):
        if s not in ready:
            continue
        while True:
            try:
                frame = s.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            pending[k] -= 1
            n += 1
            code = getattr(p.decode_reply(frame), "code", 0)
            if code:
                name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
                codes[name] = codes.get(name, 0) + 1
    return n


def _ints_of(node):
    if isinstance(node, list):
        for x in node:
            yield from _ints_of(x)
    elif isinstance(node, int) and not isinstance(node, bool):
        yield node
