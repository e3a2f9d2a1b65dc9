"""Command lines: ``kvpoold`` (the daemon) and ``kvpool`` (the operator's tool).

``kvpoold`` only builds a ``DaemonConfig`` (defaults < TOML < ``KVPOOL_*`` env < flags, merged
once here) and hands it to the server. Every ``DaemonConfig`` field becomes a flag generated
from the struct itself, so flags, env vars, TOML keys and their help cannot drift apart.

Exit codes: 0 clean stop, 2 bad usage or configuration, 3 failed start (pool or socket busy,
shm not creatable), 1 daemon unreachable (operator commands).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import click
import msgspec

from kvpool.shared.config import (ClientConfig, DaemonConfig, build_config, config_file_variable,
                                  toml_layer, unknown_variables)
from kvpool.shared.errors import ConfigError, KvpoolError

STARTUP_FAILURE = 3
UNREACHABLE = 1
# ``kvpool ping --wait``: how often to knock on a daemon that is starting.
_WAIT_RETRY_S = 0.1


def _describe(t) -> tuple[str, object]:
    """(help text, inner type) of a DaemonConfig field's msgspec.inspect type."""
    if isinstance(t, msgspec.inspect.Metadata):
        return (t.extra_json_schema or {}).get("description", ""), t.type
    return "", t


def _daemon_options(func):
    """One click option per DaemonConfig field, defaulting to None so only given ones count."""
    info = msgspec.inspect.type_info(DaemonConfig)
    for field in reversed(info.fields):
        help_text, inner = _describe(field.type)
        flag = "--" + field.name.replace("_", "-")
        shown = f"{help_text} [default: {field.default}]"
        if isinstance(inner, msgspec.inspect.BoolType):
            opt = click.option(f"{flag}/--no-{flag[2:]}", field.name, default=None, help=shown)
        elif isinstance(inner, msgspec.inspect.LiteralType):
            opt = click.option(flag, field.name, type=click.Choice([str(v) for v in inner.values]),
                               default=None, help=shown)
        else:
            py = {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float}.get(type(inner), str)
            opt = click.option(flag, field.name, type=py, default=None, help=shown)
        func = opt(func)
    return func


def settings_table() -> str:
    """The README's table of settings, generated from DaemonConfig (a test keeps them equal)."""
    rows = ["| flag | env var | default | meaning |", "| --- | --- | --- | --- |"]
    for f in msgspec.inspect.type_info(DaemonConfig).fields:
        default = f.default if f.default != "" else "(empty)"
        if isinstance(default, bool):
            default = str(default).lower()
        desc = _describe(f.type)[0].replace("|", "\\|")
        rows.append(f"| `--{f.name.replace('_', '-')}` | `KVPOOL_{f.name.upper()}` | `{default}` "
                    f"| {desc} |")
    rows.append("| `--config FILE` | `KVPOOL_CONFIG` | (none) | TOML file with the keys above "
                "(underscores) |")
    return "\n".join(rows)


def _setup_logging(config: DaemonConfig) -> None:
    from kvpool.daemon import log_queue
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        class _Json(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                out = {"ts": record.created, "level": record.levelname.lower(),
                       "logger": record.name, "msg": record.getMessage()}
                if record.exc_info:
                    out["exc"] = self.formatException(record.exc_info)
                return json.dumps(out)
        handler.setFormatter(_Json())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    # written by a thread: a blocked stderr must not stall the event loop (daemon/log_queue.py)
    root.handlers[:] = [log_queue.queued(handler)]
    root.setLevel(config.log_level.upper())


def load_daemon_config(config_file: str | None, given: dict[str, Any],
                       take_free_metrics_port: bool = False) -> tuple[DaemonConfig, list[str]]:
    """The effective configuration, checked as a start checks it (``startup.check_config``),
    and warnings to show. ``take_free_metrics_port``: when no layer set ``metrics_port`` and the
    default port is taken (another user's daemon), serve without /metrics rather than fail."""
    from kvpool.daemon import startup
    from kvpool.daemon.metrics import port_is_free
    layers = toml_layer(config_file)
    config = build_config(DaemonConfig, layers, given)
    startup.check_config(config)
    notes = []
    explicit = set(layers) | {k for k, v in given.items() if v is not None}
    if take_free_metrics_port and "metrics_port" not in explicit and config.metrics_port \
            and not port_is_free(config.metrics_host, config.metrics_port):
        notes.append(f"metrics_port {config.metrics_port} on {config.metrics_host} is taken "
                     f"(by another kvpoold?): serving without /metrics and /healthz; set "
                     f"metrics_port to a free port to have them")
        config = msgspec.structs.replace(config, metrics_port=0)
    return config, notes


def _warn(text: str) -> None:
    click.echo(f"kvpoold: warning: {text}", err=True)


@click.command(context_settings={"auto_envvar_prefix": "KVPOOL", "show_default": True})
@click.version_option(package_name="kvpool", prog_name="kvpoold")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              allow_from_autoenv=False, help="TOML file with the same keys as the flags "
              "(underscores) [env var: KVPOOL_CONFIG]")
@click.option("--check-config", is_flag=True, default=False,
              help="check the configuration as a start would, print it and exit (0: valid, "
              "2: invalid)")
@_daemon_options
def serve(config_file: str | None, check_config: bool, **given: Any) -> None:
    """Run kvpoold, the host's KV-cache pool daemon."""
    notes: list[str] = []
    if config_file is None:
        config_file, notes = config_file_variable()
    notes += unknown_variables()
    try:
        config, more = load_daemon_config(config_file, given,
                                          take_free_metrics_port=not check_config)
    except ConfigError as e:
        for note in notes:
            _warn(note)
        click.echo(f"kvpoold: {e.message}", err=True)
        sys.exit(2)
    notes += more
    if check_config:
        for note in notes:
            _warn(note)
        click.echo(json.dumps(msgspec.to_builtins(config), indent=2))
        click.echo(f"kvpoold: configuration valid: socket {config.socket_path}, pool "
                   f"/dev/shm/{config.pool}", err=True)
        return
    _setup_logging(config)
    log = logging.getLogger("kvpoold")
    for note in notes:
        log.warning(note)
    log.info("effective configuration: %s", json.dumps(msgspec.to_builtins(config)))
    from kvpool.daemon import startup
    try:
        code = startup.run_daemon(config)
    except (KvpoolError, OSError) as e:
        log.error("failed to start: %s", e)
        sys.exit(STARTUP_FAILURE)
    sys.exit(code)


# ---- operator CLI ------------------------------------------------------------------------------

def _operator_client(socket: str | None, timeout_ms: int):
    from kvpool.client.operator import OperatorClient
    cfg = build_config(ClientConfig, {"socket": socket, "timeout_ms": timeout_ms,
                                      "reconnect_backoff_ms": 0})
    return OperatorClient(cfg)


_socket_opt = click.option("--socket", envvar="KVPOOL_SOCKET", default=None,
                           help="daemon socket path [default: the daemon's default]")
_timeout_opt = click.option("--timeout-ms", default=2000, show_default=True,
                            help="give up after this long")


@click.group()
@click.version_option(package_name="kvpool", prog_name="kvpool")
def operator() -> None:
    """Talk to a running kvpoold."""


@operator.command()
@_socket_opt
@_timeout_opt
@click.option("--wait", "wait_s", is_flag=False, flag_value=60.0, default=0.0, type=float,
              metavar="[SECONDS]", help="wait for a daemon that is starting: try again until "
              "it answers, for up to SECONDS (60 if none given)")
def ping(socket: str | None, timeout_ms: int, wait_s: float) -> None:
    """Round trip to the daemon; exit 1 if it does not answer."""
    from kvpool.shared.errors import DaemonUnavailable, KvpoolError, SocketForbidden
    deadline = time.monotonic() + wait_s
    said_waiting = False
    while True:
        client = _operator_client(socket, timeout_ms)
        try:
            client.connect()
            t0 = time.perf_counter()
            pong = client.ping()
            click.echo(f"pong from kvpoold {pong.daemon_id} in "
                       f"{(time.perf_counter() - t0) * 1e6:.0f} us (up {pong.uptime_s:.0f} s)")
            return
        except DaemonUnavailable as e:
            # A daemon that is starting has no socket yet, or one that refuses: try again.
            if isinstance(e, SocketForbidden) or time.monotonic() >= deadline:
                waited = f" (waited {wait_s:g} s)" if wait_s else ""
                click.echo(f"kvpool: {e.message}{waited}", err=True)
                sys.exit(UNREACHABLE)
            if not said_waiting:
                click.echo(f"kvpool: {e.message}; waiting up to {wait_s:g} s for it", err=True)
                said_waiting = True
        except KvpoolError as e:          # answered, but refused us (allow list, version)
            click.echo(f"kvpool: {e.message}", err=True)
            sys.exit(UNREACHABLE)
        finally:
            client.close()
        time.sleep(_WAIT_RETRY_S)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def info_as_dict(info) -> dict[str, Any]:
    """PoolInfo with named fields (it is positional on the wire)."""
    from kvpool.daemon.top import engine_clients
    out = msgspec.structs.asdict(info)
    out["clients"] = [{**msgspec.structs.asdict(c), "role": c.role.name.lower()}
                      for c in engine_clients(info)]
    out["namespace_usage"] = [{**msgspec.structs.asdict(n), "namespace": n.namespace.hex()}
                              for n in info.namespace_usage]
    out["tiers"] = [msgspec.structs.asdict(t) for t in info.tiers]
    return out


def format_tier(t) -> list[str]:
    """A tier under the pool, as `kvpool info` prints it."""
    state = "on" if t.is_enabled else f"OFF ({t.status})"
    return [
        f"{t.name} tier  {t.location}   {state}",
        f"  used     {_human(t.used_bytes)} of {_human(t.capacity_bytes)}   blocks {t.blocks}"
        f"   adopted at start {t.adopted_blocks}",
        f"  moved    demoted {t.demoted_blocks} blocks ({_human(t.demoted_bytes)})   promoted "
        f"{t.promoted_blocks} blocks ({_human(t.promoted_bytes)})   hits {t.hit_blocks}",
        f"  dropped  evicted {t.evicted_blocks}   missed {t.missed_blocks}   verify failures "
        f"{t.verify_failures}   I/O errors {t.io_errors}   lost {t.lost_blocks}   rejected "
        f"{t.rejected_blocks}",
    ]


def format_info(info) -> str:
    total = info.hit_blocks + info.miss_blocks
    lines = [
        f"daemon     {info.daemon_id}   up {info.uptime_s:.0f} s",
        "pool",
        f"  total    {_human(info.pool_bytes)}",
        f"  used     {_human(info.used_bytes)}",
        f"  free     {_human(info.free_bytes)}",
        f"slots      committed {info.slots_committed}   writing {info.slots_writing}"
        f"   pinned {info.slots_pinned}   namespaces {info.namespaces}",
        f"tickets    outstanding {info.slots_reserved}   duplicates {info.duplicate_blocks}"
        f"   not stored for want of room {info.no_room_blocks}",
        f"lookups    hits {info.hit_blocks} blocks ({info.hit_tokens} tokens)   misses "
        f"{info.miss_blocks} blocks ({info.miss_tokens} tokens)"
        f"   hit rate {info.hit_blocks / total:.1%}" if total else
        "lookups    hits 0 blocks   misses 0 blocks",
        f"transfers  stored {info.stored_blocks} blocks ({_human(info.stored_bytes)})"
        f"   loaded {info.loaded_blocks} blocks ({_human(info.loaded_bytes)})",
        f"evictions  {info.evictions}   leases {info.leases}   errors {info.errors}"
        f"   adopted at start {info.adopted_blocks}",
    ]
    for n in info.namespace_usage:
        quota = f" of {_human(n.quota_bytes)} quota" if n.quota_bytes else ""
        lines.append(f"  ns {n.namespace.hex()[:12]}  tp {n.tp_size or 'any'}  {n.blocks} blocks  "
                     f"{_human(n.used_bytes)}{quota}  {n.description[:60]}")
    for t in info.tiers:
        lines += format_tier(t)
    from kvpool.daemon.top import engine_clients
    clients = engine_clients(info)
    lines.append(f"clients    {len(clients)}" if clients else "clients    none connected")
    for c in clients:
        lines.append(f"  #{c.owner_id} {c.role.name.lower():9s} pid {c.pid:<7d} {c.name}"
                     f"{' engine ' + c.engine_id if c.engine_id else ''}   registrations "
                     f"{c.registrations} leases {c.leases} jobs {c.jobs_in_flight}")
    return "\n".join(lines)


@operator.command()
@_socket_opt
@click.option("--interval", default=1.0, show_default=True, type=float,
              help="seconds between refreshes")
@click.option("--iterations", default=None, type=click.IntRange(min=1),
              help="stop after this many screens [default: until Ctrl-C]")
def top(socket: str | None, interval: float, iterations: int | None) -> None:
    """Live view: hit rate, GB/s each way, pool occupancy (Ctrl-C quits)."""
    from kvpool.daemon.top import run_top
    from kvpool.shared.errors import KvpoolError
    client = _operator_client(socket, 2000)
    try:
        code = run_top(client.info, interval, iterations=iterations)
    except KvpoolError as e:     # refused (allow list, version): unavailability is waited out
        click.echo(f"kvpool: {e.message}", err=True)
        code = UNREACHABLE
    finally:
        client.close()
    sys.exit(code)


@operator.command()
@_socket_opt
@_timeout_opt
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def info(socket: str | None, timeout_ms: int, as_json: bool) -> None:
    """Pool occupancy, hits, transfers, evictions and connected clients."""
    from kvpool.shared.errors import KvpoolError
    client = _operator_client(socket, timeout_ms)
    try:
        snapshot = client.info()
    except KvpoolError as e:     # unreachable, or refused (allow list, version)
        click.echo(f"kvpool: {e.message}", err=True)
        sys.exit(UNREACHABLE)
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(info_as_dict(snapshot), indent=2))
    else:
        click.echo(format_info(snapshot))


def serve_main() -> None:
    serve()


def operator_main() -> None:
    operator()
