"""The ``remote_store`` setting: ``mooncake://MASTER_HOST:RPC_PORT[?query]``, parsed and checked.

Query keys: ``metadata`` (the transfer engine's metadata service; default
``http://MASTER_HOST:8080/metadata``, the master's own HTTP metadata server, or
``P2PHANDSHAKE``), ``protocol`` (``tcp`` or ``rdma``), ``device`` (the RDMA device(s), e.g.
``mlx5_0``; only with rdma), ``local`` (the address other hosts reach this host's memory at;
default: the address this host uses to reach the master).

Every mistake is a ``ConfigError`` that names the setting and says what is expected, raised
once at start (``kvpoold`` exits 2, like any other bad setting). Pure parsing except
``resolve_local``, which asks the kernel for a route (no packet is sent).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from kvpool.shared.errors import ConfigError

SCHEME = "mooncake"
PROTOCOLS = ("tcp", "rdma")
# mooncake_master --http_metadata_server_port defaults to 8080.
DEFAULT_METADATA_PORT = 8080
_KEYS = {"metadata", "protocol", "device", "local"}
MOONCAKE_MISSING = ("remote_store needs Mooncake Store: pip install 'kvpool[mooncake]' (and "
                    "apt-get install libibverbs1 librdmacm1 libnuma1)")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9_.:,-]{1,256}$")


@dataclass(frozen=True)
class RemoteUrl:
    master_host: str
    rpc_port: int
    metadata: str            # URL of the metadata service, or "P2PHANDSHAKE"
    protocol: str            # "tcp" | "rdma"
    device: str              # RDMA device list ("" for tcp)
    local_host: str          # "" until resolve_local

    @property
    def master(self) -> str:
        """``HOST:PORT`` as Mooncake's ``master_server_addr`` takes it."""
        host = f"[{self.master_host}]" if ":" in self.master_host else self.master_host
        return f"{host}:{self.rpc_port}"

    def display(self) -> str:
        return f"{SCHEME}://{self.master}"


def _bad(text: str, why: str) -> ConfigError:
    return ConfigError(f"invalid setting remote_store={text!r}: {why} (expected mooncake://"
                       f"MASTER_HOST:RPC_PORT[?metadata=URL&protocol=tcp|rdma&device=NAME"
                       f"&local=ADDR])")


def parse_remote_url(text: str) -> RemoteUrl:
    """The parts of a ``remote_store`` URL; ``ConfigError`` saying what is wrong."""
    try:
        u = urlsplit(text.strip())
        port = u.port
    except ValueError as e:
        raise _bad(text, str(e)) from None
    if u.scheme != SCHEME:
        raise _bad(text, f"the scheme must be {SCHEME}://, not {u.scheme + '://' if u.scheme else 'none'}")
    host = u.hostname or ""
    if not host or not (_HOST.match(host) or ":" in host):
        raise _bad(text, "no master host")
    if port is None or not 0 < port < 65536:
        raise _bad(text, "no master RPC port (mooncake_master --rpc_port, usually 50051)")
    if u.username or u.password or u.path not in ("", "/") or u.fragment:
        raise _bad(text, "only host, port and query are allowed")
    query = parse_qs(u.query, keep_blank_values=True, strict_parsing=False)
    unknown = set(query) - _KEYS
    if unknown:
        raise _bad(text, f"unknown query key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    repeated = [k for k, v in query.items() if len(v) > 1]
    if repeated:
        raise _bad(text, f"query key(s) {repeated} given twice")
    q = {k: v[0] for k, v in query.items()}
    protocol = q.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise _bad(text, f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    device = q.get("device", "")
    if device and protocol != "rdma":
        raise _bad(text, "device= names RDMA devices: it needs protocol=rdma")
    if device and not _DEVICE.match(device):
        raise _bad(text, f"not a device name: {device!r}")
    bracketed = f"[{host}]" if ":" in host else host
    metadata = q.get("metadata", f"http://{bracketed}:{DEFAULT_METADATA_PORT}/metadata")
    if metadata != "P2PHANDSHAKE":
        m = urlsplit(metadata)
        if m.scheme != "http" or not m.hostname:
            raise _bad(text, f"metadata must be an http:// URL (the master's "
                             f"--http_metadata_server) or P2PHANDSHAKE, not {metadata!r}")
    local = q.get("local", "")
    if "local" in q and not (_HOST.match(local) or ":" in local):
        raise _bad(text, f"local must be this host's address, not {local!r}")
    return RemoteUrl(host, port, metadata, protocol, device, local)


def resolve_local(url: RemoteUrl) -> RemoteUrl:
    """``url`` with ``local_host`` set: the given one, else the source address of this host's
    route to the master. ``ConfigError`` if the master's name does not resolve."""
    try:
        infos = socket.getaddrinfo(url.master_host, url.rpc_port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConfigError(f"invalid setting remote_store: the master host {url.master_host!r} "
                          f"does not resolve ({e.strerror})") from None
    if url.local_host:
        return url
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)                 # a UDP connect only picks the route
        local = s.getsockname()[0]
    return RemoteUrl(url.master_host, url.rpc_port, url.metadata, url.protocol, url.device,
                     local)
