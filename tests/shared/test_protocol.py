import msgspec
import pytest

from kvpool.shared import protocol as p
from kvpool.shared.layout import Layout, SegmentPlacement

LAYOUT = Layout(16, 2, "bfloat16", (32768, 32768), "llama L1")
NS, KEY = b"n" * 16, b"k" * 16

REQUESTS = [
    p.Hello(1, p.PROTOCOL_VERSION, p.Role.WORKER, "w", 42, "eng"),
    p.Heartbeat(2, 7),
    p.Ping(3),
    p.RegisterRequest(4, NS, LAYOUT, 1, 100, [p.HostRegion("shm", 4096), p.CudaRegion(
        "GPU-1", b"\x01" * 64, 8192, 512)], [SegmentPlacement(0, 0, 64), SegmentPlacement(1, 8, 64)]),
    p.UnregisterRequest(5, 3),
    p.LookupRequest(6, NS, [[KEY], [KEY, KEY]], True),
    p.AbortStoreRequest(8, [p.make_slot_ref(3, 9)]),
    p.ReleaseRequest(9, [1, 2]),
    p.StoreRequest(10, 1, 2, [0, 1], [5, 6], b"ev"),
    p.LoadRequest(11, 1, 3, [5, 6], [7, 8]),
    p.InfoRequest(12),
    p.ResetRequest(13, NS),
    p.ByeRequest(14),
    p.ReserveRequest(15, NS, 256),
    p.StoreRequest(16, 1, 2, [0, 1], [5, 6], b"", [KEY, KEY], "d"),
    p.LoadRequest(17, 1, 3, [5, 0], [7, 8], [KEY, KEY]),
    p.TouchRequest(18, NS, [KEY, KEY], 3),
]
REPLIES = [
    p.HelloReply(1, p.PROTOCOL_VERSION, "d", 3, 1 << 30, 100, 1 << 20),
    p.HeartbeatReply(2, "d"),
    p.Pong(3, "d", 1.5),
    p.RegisterReply(4, 9),
    p.LookupReply(6, [1, 0], [5, 0], [[p.make_slot_ref(1, 2)], []]),
    p.OkReply(8, 2),
    p.JobDone(10, 2, 0, "", 65536, b"e"),
    p.JobDone(11, 3, 0, "", 4096, b"", [1]),
    p.HelloReply(1, p.PROTOCOL_VERSION, "d", 3, 1 << 30, 100, 1 << 20, "/kvpool-index"),
    p.InfoReply(12, p.PoolInfo("d", 1.0, 10, 4, 6, 1, 2, 1, 5, 6, 7, 8, 9, 10, 11, 12, 13, [
        p.ClientInfo(1, p.Role.SCHEDULER, "s", 5, "e", 0, 1, 0)], 3)),
    p.ErrorReply(99, 3, "unknown"),
    p.ReserveReply(14, [p.make_slot_ref(3, 9)], 10_000, "d"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips(msg):
    assert p.decode_request(p.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(msg):
    assert p.decode_reply(p.encode(msg)) == msg


def test_union_covers_every_message():
    assert set(type(m) for m in REQUESTS) == set(p.Request.__args__)
    assert len({p.decode_request(p.encode(m)).__struct_config__.tag for m in REQUESTS}) == \
        len(p.Request.__args__)
    assert set(type(m) for m in REPLIES) == set(p.Reply.__args__)


# Golden bytes pin the positional (array_like) layouts: a reordered or retyped field fails here.
GOLDEN = [
    (p.Hello(1, 1, p.Role.WORKER, "w", 42, "eng"), "9701010102a1772aa3656e67"),
    (p.LookupRequest(6, NS, [[KEY]], True), "950606c4106e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e9191c4106b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6bc3"),
    (p.StoreRequest(10, 1, 2, [0], [5], b""), "990a0a010291009105c40090a0"),
    (p.StoreRequest(10, 1, 2, [0], [5], b"", [KEY], "d"),
     "990a0a010291009105c40091c4106b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6ba164"),
    (p.ByeRequest(14), "920e0e"),
    # ReserveRequest is tag 15: it was 14 on its branch, which ByeRequest took first.
    (p.ReserveRequest(14, NS, 256), "940f0ec4106e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6ecd0100"),
    (p.ReserveReply(14, [p.make_slot_ref(3, 9)], 10_000, "d"),
     "954a0e91cf0000000900000003cd2710a164"),
    (p.JobDone(10, 2, 6, "full", 0, b""), "98470a0206a466756c6c00c40090"),
    (p.JobDone(10, 2, 0, "", 8, b"", [3]), "98470a0200a008c4009103"),
    (p.LoadRequest(11, 1, 3, [5, 0], [7, 8], [KEY]),
     "970b0b010392050092070891c4106b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b"),
    (p.TouchRequest(5, NS, [KEY], 2), "951005c4106e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e91c4106b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b02"),
    (p.ErrorReply(9, 1, "x"), "94490901a178"),
]


@pytest.mark.parametrize("msg,golden", GOLDEN, ids=lambda m: type(m).__name__)
def test_golden_bytes(msg, golden):
    assert p.encode(msg).hex() == golden


def test_retired_tags_are_refused_as_malformed():
    """Protocol 2 retired PrepareStoreRequest (tag 7): a frame of it is a decode error (the
    daemon answers PROTOCOL), never another message."""
    frame = msgspec.msgpack.encode([7, 5, NS, [KEY]])
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(frame)
    assert p.PROTOCOL_VERSION == 2


def test_appended_fields_keep_older_frames_readable_both_ways():
    # A store from a client before reservations (7 fields) still decodes, with no keys...
    old = bytes.fromhex("970a0a010291009105c400")
    assert p.decode_request(old) == p.StoreRequest(10, 1, 2, [0], [5], b"", [], "")
    # ...and a newer frame's extra trailing fields are ignored by a struct that lacks them.
    class OldStore(msgspec.Struct, tag=10, array_like=True):
        req_id: int
        registration_id: int
        job_id: int
        block_ids: list[int]
        slots: list[int]
        wait_event: bytes = b""
    new = p.encode(p.StoreRequest(10, 1, 2, [0], [5], b"", [KEY], "d"))
    assert msgspec.msgpack.decode(new, type=OldStore).slots == [5]


def test_garbage_is_a_decode_error_and_req_id_is_recovered_when_possible():
    with pytest.raises(msgspec.DecodeError):
        p.decode_request(b"\xc1\xc1")
    bad = msgspec.msgpack.encode([6, 77, "not bytes", [], False])
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(bad)
    assert p.peek_req_id(bad) == 77
    assert p.peek_req_id(b"\xc1") == 0


def test_slot_ref_packs_index_and_generation():
    ref = p.make_slot_ref(123456, 789)
    assert (p.slot_ref_index(ref), p.slot_ref_generation(ref)) == (123456, 789)


@pytest.mark.parametrize("msg", [
    p.LookupRequest(6, NS, [[KEY, b"k" * 15]]),           # a short key would shift its record
    p.LookupRequest(6, NS, [[b"k" * 17]]),
    p.LookupRequest(6, b"n" * 17, [[KEY]]),
    p.ResetRequest(13, b""),
    p.RegisterRequest(4, b"n" * 8, LAYOUT, 0, 1, [p.HostRegion("shm", 4096)], []),
    p.Hello(1, 1, p.Role.WORKER, "w" * 257),               # names are bounded
    p.ReserveRequest(15, b"n" * 15, 4),
    p.StoreRequest(10, 1, 2, [0], [5], b"", [b"k" * 15], "d"),   # a reserved slot's key too
    p.StoreRequest(10, 1, 2, [0], [5], b"", [KEY], "d" * 257),
], ids=lambda m: type(m).__name__)
def test_keys_namespaces_and_names_are_checked_when_decoded(msg):
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(p.encode(msg))
