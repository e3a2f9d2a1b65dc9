"""The wire protocol: every message between kvpoold and its clients, in one module.

Transport: a client's ZeroMQ DEALER talks to the daemon's ROUTER over ``ipc://``; each message
is one frame holding one msgpack-encoded struct from the ``Request`` or ``Reply`` union. Structs
are ``array_like`` (positional) with an integer tag as the first item, so frames stay small and
decoding is one pass. Fields added later must be appended last, with a default, so older peers
still decode them positionally; anything else bumps ``PROTOCOL_VERSION``.

Conversation:

- ``Hello`` first, on every new connection; the reply assigns the peer an ``owner_id`` that
  owns its registrations, leases, tickets and jobs. Any other request from a peer the
  daemon does not know (first contact, or the daemon restarted) gets ``HELLO_REQUIRED``.
- ``Heartbeat`` carries an ``owner_id`` from a second socket of the same process; an owner whose
  heartbeats stop for ``peer_timeout_ms`` is released (registrations, leases, jobs, slots).
- Every request carries a client-chosen ``req_id`` that its reply echoes. Store and load
  requests are answered once, by ``JobDone``, when the copy has finished or failed.
- Every failure is an ``ErrorReply`` (or a ``JobDone`` with a non-zero code) naming an
  ``ErrorCode``; the connection stays usable.
- One store path, with no round trip on the scheduler's: ``ReserveRequest`` grants a stock of
  *tickets* of a namespace ahead of need (refs bound to no key and no pool space; they expire
  unused after the reply's ``ttl_ms``); the scheduler assigns them to keys locally, and each
  worker's ``StoreRequest`` names each ticket's key (``keys``) and the daemon life that granted
  it (``grant``). The daemon gives a ticket a slot for its key when the first rank's store
  arrives (evicting LRU blocks then), and later ranks' stores naming the ticket land in that
  slot; a key already committed or being written by anyone is a *duplicate*: nobody writes it,
  so no key is ever visible twice. A ticket that finds no slot (every one written or pinned) is
  not stored either. (Protocol 1's ``PrepareStoreRequest``, tag 7, is retired: protocol 2.)
- Requests whose reply nobody waits for (``ReleaseRequest``, ``AbortStoreRequest``,
  ``ResetRequest`` sent by a scheduler that must not block) are answered like any other; the
  client folds those answers into its next poll.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Union

import msgspec

from kvpool.shared.layout import Layout, SegmentPlacement

# 2: PrepareStoreRequest/Reply retired (every store goes through tickets); loads may fail per
# block (JobDone.failed) and name their keys (LoadRequest.keys).
PROTOCOL_VERSION = 2

# Most slots one ReserveRequest may ask for: a larger count is refused as malformed.
MAX_RESERVE = 65536

# Blocks one store or load request may name (a vLLM step names a few thousand): more is
# refused as TOO_LARGE.
MAX_BLOCKS_PER_REQUEST = 65536

# A worker sends a store or load of at least ``SPLIT_MIN_BLOCKS`` blocks as two requests of one
# job: its first ``LEAD_BLOCKS`` blocks, then the rest. The daemon checks a request and finds
# its room before its copy can start, a cost per block (0.68 ms for 1024 keyed blocks on an
# idle H200 host): the lead's copy starts after a sixteenth of it, and the rest's checks run
# while the lead copies (64 blocks of 2 MiB: ~2.4 ms). The daemon launches a job of at most
# ``LEAD_BLOCKS`` blocks on its loop's thread, as it does a big job's first chunk. (A job over
# ``MAX_BLOCKS_PER_REQUEST`` goes whole, to be refused whole.)
LEAD_BLOCKS = 64
SPLIT_MIN_BLOCKS = 4 * LEAD_BLOCKS


def make_slot_ref(index: int, generation: int) -> int:
    """A slot ref names a slot *and* the tenancy of it, so a stale ref can never write into a
    slot that has since been reused for another key."""
    return (generation << 32) | index


def slot_ref_index(ref: int) -> int:
    return ref & 0xFFFF_FFFF


def slot_ref_generation(ref: int) -> int:
    return ref >> 32


class Role(IntEnum):
    SCHEDULER = 1
    WORKER = 2
    OPERATOR = 3


_WIRE = dict(array_like=True, gc=False)

# Namespaces and block hashes are exactly 16 bytes: the daemon keeps a slot's key as the two
# concatenated (32 bytes in the pool's records), so a key of another length would shift every
# record written next to it. Checked when the frame is decoded.
Key = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
# Free text a client sends about itself: shown, never parsed; bounded so a thousand clients
# cannot make the daemon hold gigabytes of names.
Label = Annotated[str, msgspec.Meta(max_length=256)]


# ---- regions a worker registers (where its KV tensors live) ------------------------------------

# Shared-memory objects that engines create for their KV (``client.host_memory``) start with this;
# kvpoold removes such names once no live process holds their lock, and never touches others.
# (Before the lock existed, clients named them "kvpool-kv-...": those are never reaped, since
# nothing tells a live one of them from a dead one.)
ENGINE_SHM_PREFIX = "kvpool-engine-"

class HostRegion(msgspec.Struct, tag=1, **_WIRE):
    """KV memory in a POSIX shared-memory object the daemon can open by name."""

    shm_name: str
    nbytes: int
    offset_bytes: int = 0   # where the registered bytes start inside the shm object


class CudaRegion(msgspec.Struct, tag=2, **_WIRE):
    """KV memory on a GPU, shared as a CUDA IPC handle of its backing allocation."""

    device_uuid: str        # matched by UUID: engine and daemon may see different ordinals
    ipc_handle: bytes       # cudaIpcMemHandle_t of the allocation's base
    nbytes: int             # bytes from base + offset_bytes that belong to the KV cache
    offset_bytes: int = 0   # the KV tensor's offset inside the allocation


Region = Union[HostRegion, CudaRegion]


# ---- requests ------------------------------------------------------------------------------

class Hello(msgspec.Struct, tag=1, **_WIRE):
    req_id: int
    protocol_version: int
    role: Role
    name: Label = ""        # free text shown by `kvpool info` (e.g. "vllm worker tp0")
    pid: int = 0
    engine_id: Label = ""   # vLLM engine id; groups a scheduler with its workers


class Heartbeat(msgspec.Struct, tag=2, **_WIRE):
    req_id: int
    owner_id: int


class Ping(msgspec.Struct, tag=3, **_WIRE):
    req_id: int


class RegisterRequest(msgspec.Struct, tag=4, **_WIRE):
    """A worker's KV memory for one TP rank of one layout. Idempotent per (owner, namespace,
    rank): registering again replaces the earlier registration."""

    req_id: int
    namespace: Key
    layout: Layout
    tp_rank: int
    num_blocks: int
    regions: list[Region]
    placement: list[SegmentPlacement]
    # Appended last (array_like positional): older peers still decode the fields above.
    # A byte cap for the namespace (0: none). Eviction under it takes only this namespace's
    # blocks; the daemon's namespace_quota caps it further.
    quota_bytes: int = 0
    # Ignored: P/D engines once declared a hand-off family so that the daemon could refuse a
    # TP mismatch; head-split slots serve every TP size. Kept so later fields keep positions.
    handoff: bytes = b""


class UnregisterRequest(msgspec.Struct, tag=5, **_WIRE):
    req_id: int
    registration_id: int


class LookupRequest(msgspec.Struct, tag=6, **_WIRE):
    """Many requests' key lists in one round trip; each answer is its run of leading hits."""

    req_id: int
    namespace: Key
    key_lists: list[list[Key]]
    pin: bool = False       # pin each hit run under a lease until released or expired


class AbortStoreRequest(msgspec.Struct, tag=8, **_WIRE):
    """Give back tickets that will not be written (request aborted or
    preempted, a store that failed, a reservation the client will not use)."""

    req_id: int
    slots: list[int]


class ReleaseRequest(msgspec.Struct, tag=9, **_WIRE):
    req_id: int
    leases: list[int]


class StoreRequest(msgspec.Struct, tag=10, **_WIRE):
    """Copy ``block_ids`` of a registration into the slots its tickets (``slots``) bind to
    ``keys`` (this rank's shard)."""

    req_id: int
    registration_id: int
    job_id: int
    block_ids: list[int]
    slots: list[int]
    wait_event: bytes = b""  # CUDA IPC event the copy waits on (engine compute done)
    # Appended last (array_like positional): older peers still decode the fields above.
    # Per ticket, the block hash it stores (16 bytes): the first rank's store binds each ticket
    # to its key; later ranks' are checked against it. Required (one per ticket).
    keys: list[Key] = []
    # The daemon_id whose ReserveReply granted the slots (empty: not checked). A store whose
    # slots another daemon life granted is refused (UNKNOWN_ID) instead of touching this pool.
    grant: Label = ""


class LoadRequest(msgspec.Struct, tag=11, **_WIRE):
    """Copy blocks (this rank's shard) into ``block_ids`` of a registration: per block, the slot
    ref a lookup found (0: none, a lower tier holds it) and, appended, its block hash. Refs are
    optimistic (lookups pin nothing): a ref whose slot was evicted or reused since is replaced
    by the key's slot if the pool holds the key again, by a fill from a lower tier if one holds
    it, and otherwise that block fails alone (``JobDone.failed``): never a reused slot's bytes."""

    req_id: int
    registration_id: int
    job_id: int
    slots: list[int]
    block_ids: list[int]
    # Appended (protocol 2): per block, its hash (16 bytes), or empty: refs only, no fallback.
    keys: list[Key] = []


class InfoRequest(msgspec.Struct, tag=12, **_WIRE):
    req_id: int


class ResetRequest(msgspec.Struct, tag=13, **_WIRE):
    """Forget every block of ``namespace``: committed ones now, in-flight ones when they land."""

    req_id: int
    namespace: Key


class ByeRequest(msgspec.Struct, tag=14, **_WIRE):
    """The client is closing this connection: release what it holds now, not at the peer
    timeout (a process that exits is released at once anyway; this is for one that lives on).
    Appended as a new tag: a daemon that does not know it answers PROTOCOL, which is harmless."""

    req_id: int


class TouchRequest(msgspec.Struct, tag=16, **_WIRE):
    """Hits a scheduler read in the shared-memory index (``keys``: block hashes of
    ``namespace``) and how many blocks it looked up and missed: the daemon makes those blocks
    most recently used, as a round-trip lookup would, and counts the hits and misses. Sent
    without waiting, once per step."""

    req_id: int
    namespace: Key
    keys: list[Key]
    missed_blocks: int = 0


class ReserveRequest(msgspec.Struct, tag=15, **_WIRE):
    """Tickets for stores of ``namespace`` to come, bound to no key or slot yet (see the module
    docstring). A ticket takes no pool space and evicts nothing: the daemon finds its slot when
    the first rank's store names its key (a block that finds none then is not stored), so it
    grants ``count`` unless this client would hold more tickets of the namespace's slot size
    than the pool has slots of that size."""

    req_id: int
    namespace: Key
    count: int


Request = Union[Hello, Heartbeat, Ping, RegisterRequest, UnregisterRequest, LookupRequest,
                AbortStoreRequest, ReleaseRequest, StoreRequest,
                LoadRequest, InfoRequest, ResetRequest, ByeRequest, ReserveRequest, TouchRequest]


# ---- replies -------------------------------------------------------------------------------

class HelloReply(msgspec.Struct, tag=64, **_WIRE):
    req_id: int
    protocol_version: int
    daemon_id: str          # new on every daemon start: a change means "re-register"
    owner_id: int
    pool_bytes: int
    heartbeat_interval_ms: int
    max_request_bytes: int
    # The daemon's shared-memory index (``shared/index_format.py``; empty: none): schedulers
    # map it read-only and read their hits there, without a round trip.
    index_segment: str = ""


class HeartbeatReply(msgspec.Struct, tag=65, **_WIRE):
    req_id: int
    daemon_id: str


class Pong(msgspec.Struct, tag=66, **_WIRE):
    req_id: int
    daemon_id: str
    uptime_s: float


class RegisterReply(msgspec.Struct, tag=67, **_WIRE):
    req_id: int
    registration_id: int


class LookupReply(msgspec.Struct, tag=68, **_WIRE):
    req_id: int
    hits: list[int]          # per key list: leading keys the pool or a lower tier holds
    leases: list[int]        # per key list: lease pinning the pool's leading slots (0: none)
    slots: list[list[int]]   # per key list: slot refs of the hit run, for LoadRequest; 0 where
    #                          a lower tier holds the block (the load names its key)


class OkReply(msgspec.Struct, tag=70, **_WIRE):
    req_id: int
    count: int = 0           # how many things the request affected


class JobDone(msgspec.Struct, tag=71, **_WIRE):
    req_id: int
    job_id: int
    code: int = 0            # 0: done; else an ErrorCode and nothing was committed or loaded
    message: str = ""
    nbytes: int = 0
    # Always empty: a load is reported only once its copy has finished, so the engine waits on
    # nothing. Kept so that peers of this protocol version still decode JobDone positionally.
    done_event: bytes = b""
    # Appended (protocol 2): positions in a load job of the blocks that were not loaded (their
    # slot was evicted since the lookup and no tier held them, or a fill failed), the job
    # otherwise done (code 0). The engine recomputes exactly those.
    failed: list[int] = []


class ClientInfo(msgspec.Struct, **_WIRE):
    owner_id: int
    role: Role
    name: str
    pid: int
    engine_id: str
    registrations: int
    leases: int
    jobs_in_flight: int


class NamespaceInfo(msgspec.Struct, **_WIRE):
    """One namespace's share of the pool."""

    namespace: bytes
    description: str         # what its engines said the layout is (model group, heads, ...)
    tp_size: int             # 0: any (head-split slots, shared by every TP size)
    blocks: int              # committed
    used_bytes: int          # committed and being written
    quota_bytes: int         # 0: no cap


class TierInfo(msgspec.Struct, **_WIRE):
    """One tier under the pool (the disk tier; later ones the same way). Counters only grow
    over one daemon's life; rates are differences between snapshots."""

    name: str                # "disk", "remote"
    is_enabled: bool         # False once a fault turned it off (the pool keeps serving)
    location: str            # where it keeps blocks (the disk tier's directory)
    capacity_bytes: int
    used_bytes: int          # bytes of blocks held and being written
    blocks: int              # blocks held (loadable)
    hit_blocks: int          # lookups answered from this tier (each promotes its block)
    demoted_blocks: int      # blocks written down from the pool
    demoted_bytes: int
    promoted_blocks: int     # blocks read back into the pool, verified
    promoted_bytes: int
    verify_failures: int     # blocks whose checksum failed on the way up (misses, dropped)
    io_errors: int           # I/O faults (the first one turns the tier off)
    evicted_blocks: int      # dropped by the tier's own LRU to make room
    missed_blocks: int       # left the pool before they could be written down
    adopted_blocks: int      # found on disk at start
    status: str = ""         # "ok", or why the tier is off
    # Appended with the remote tier (defaults keep older replies decodable):
    lost_blocks: int = 0     # hits that could not be brought up (gone from the tier meanwhile,
                             # or the transfer failed): misses, the engine recomputes them
    rejected_blocks: int = 0  # blocks the tier refused for want of room


class PoolInfo(msgspec.Struct, **_WIRE):
    """The daemon's numbers, as `kvpool info` prints them."""

    daemon_id: str
    uptime_s: float
    pool_bytes: int
    used_bytes: int
    free_bytes: int
    slots_writing: int
    slots_committed: int
    namespaces: int
    hit_blocks: int
    miss_blocks: int
    evictions: int
    leases: int
    stored_blocks: int
    loaded_blocks: int
    stored_bytes: int
    loaded_bytes: int
    errors: int
    clients: list[ClientInfo]
    adopted_blocks: int = 0
    # Appended last (array_like positional): older peers still decode the fields above.
    slots_pinned: int = 0    # committed slots held by a lease (not evictable now)
    hit_tokens: int = 0      # hit_blocks weighted by each namespace's tokens per block
    miss_tokens: int = 0
    namespace_usage: list[NamespaceInfo] = []
    tiers: list[TierInfo] = []   # tiers under the pool, top down (empty: the pool only)
    slots_reserved: int = 0      # tickets granted to schedulers, not bound yet (no pool space)
    duplicate_blocks: int = 0    # stores of keys already held: freed unwritten, never shown twice
    no_room_blocks: int = 0      # reserved stores that found no slot (all written or pinned)
    index_segment: str = ""      # the shared-memory index schedulers read hits in
    index_keys: int = 0          # keys published there now (pool and lower tiers)
    index_unpublished: int = 0   # keys the index was too full to take (lookups miss them)
    load_stale_blocks: int = 0   # load refs evicted or reused since their lookup read them
    load_failed_blocks: int = 0  # blocks of load jobs not loaded (stale and in no tier, fills
                                 # that failed): their engines recompute them


class InfoReply(msgspec.Struct, tag=72, **_WIRE):
    req_id: int
    info: PoolInfo


class ErrorReply(msgspec.Struct, tag=73, **_WIRE):
    req_id: int              # 0 when the frame was too broken to read one
    code: int
    message: str


class ReserveReply(msgspec.Struct, tag=74, **_WIRE):
    req_id: int
    slots: list[int]         # slot refs granted (possibly fewer than asked, possibly none)
    ttl_ms: int              # a granted slot no store has named by then is taken back
    daemon_id: str           # the life that granted them: StoreRequest.grant


Reply = Union[HelloReply, HeartbeatReply, Pong, RegisterReply, LookupReply, OkReply, JobDone, InfoReply, ErrorReply, ReserveReply]

# Shared codec objects: building them is the expensive part, encoding/decoding is not.
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes | memoryview) -> Request:
    """Raises ``msgspec.DecodeError``/``ValidationError`` for anything that is not a request."""
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(frame)


class _Head(msgspec.Struct, array_like=True):
    """The first two items every request starts with; the rest of the frame is skipped."""

    tag: object
    req_id: int


_head_decoder = msgspec.msgpack.Decoder(_Head)


def peek_req_id(frame: bytes | memoryview) -> int:
    """Best effort: the ``req_id`` of a frame that failed to decode or was refused unread (too
    large), so the error reply can still be matched by the client; 0 if even that cannot be
    read. Costs a scan of the frame, no Python objects for the rest of it."""
    try:
        return _head_decoder.decode(frame).req_id
    except Exception:
        return 0
