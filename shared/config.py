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
    """``$XDG_RUNTIME_DIR/kvpool/kvpoold.sock`` for a user daemon, else the systemd unit's
    ``/run/kvpool/kvpoold.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvpool" if runtime else Path("/run/kvpool")
    return str(base / "kvpoold.sock")


Size = Annotated[str, msgspec.Meta(pattern=r"^(auto|\s*\d+(\.\d+)?\s*([KMGTkmgt]i?[Bb]?|[Bb])?\s*)$")]
Octal = Annotated[str, msgspec.Meta(pattern=r"^0?[0-7]{3}$")]


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every daemon setting. Each field is also a ``kvpoold`` flag and a ``KVPOOL_<NAME>`` variable."""

    # ZeroMQ ipc:// endpoint path; "" means default_socket_path().
    socket: str = ""
    # File mode of the socket; 0660 lets the socket's group (the engines) connect.
    socket_mode: Octal = "0600"
    # POSIX shm object holding the pool (/dev/shm/<name>); one daemon per name.
    pool_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")] = "kvpool"
    # Pool size: "auto" (a quarter of available memory, capped by /dev/shm) or e.g. 64GiB.
    pool_size: Size = "auto"
    # Allocation unit handed to one slot size at a time; "auto" scales with the pool.
    extent_size: Size = "auto"
    # Keep the shm pool on clean shutdown so the next start adopts it (upgrades keep the cache).
    keep_pool: bool = False
    # A lookup's pin holds its slots this long unless released first.
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    # Prepared slots not fully written by then are dropped (a rank never sent its store).
    write_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120.0
    # A client whose heartbeats stop this long is treated as dead and released.
    peer_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 600
    # How often clients send heartbeats (told to them in HelloReply).
    heartbeat_interval_ms: Annotated[int, msgspec.Meta(ge=10, le=60_000)] = 100
    # Frames longer than this are refused with TOO_LARGE before decoding.
    max_request_bytes: Annotated[int, msgspec.Meta(ge=4096, le=1 << 30)] = 16 << 20
    # Host-path copy threads (GPU copies use CUDA streams instead).
    copy_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    # CUDA copy engines: "auto" uses them when CUDA is available.
    cuda: Literal["auto", "on", "off"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    # ---- operations (appended; see docs/operating.md) ----
    # Address of the /metrics and /healthz HTTP server. Loopback by default: the numbers name
    # engines and sizes, and Prometheus on the node (or a sidecar) can reach 127.0.0.1.
    metrics_host: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    # Port of that server; 0 turns it off. 9471 sits in the Prometheus exporter range and clear
    # of 9464 (the OpenTelemetry exporter's default), vLLM's 8000 and its KV events' 5557.
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9471
    # /healthz turns 503 when the daemon's event loop has not checked in for this long, which
    # catches a wedged loop that the HTTP thread would otherwise hide.
    health_stale_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    # ZeroMQ PUB endpoint for vLLM-compatible KV events (BlockStored/BlockRemoved/
    # AllBlocksCleared, medium "CPU"), e.g. "tcp://127.0.0.1:5560" or "ipc:///run/kvpool/events";
    # "" turns events off.
    events_endpoint: str = ""
    # Topic frame of each batch; "{engine_id}" is replaced by the engine the batch is for, so a
    # router subscribing per engine (topic prefix) sees only the blocks that engine can load.
    events_topic: Annotated[str, msgspec.Meta(max_length=256)] = "{engine_id}"
    # Block hashes as the 16-byte kvpool keys ("bytes"), or folded to 64-bit integers ("int64")
    # the way vLLM does under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
    events_hash_format: Literal["bytes", "int64"] = "bytes"
    # Events are batched and sent by a background thread at most this often (vLLM sends one
    # batch per scheduler step, ~10-50 ms); the event loop only appends to a list.
    events_interval_ms: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 50

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
