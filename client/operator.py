"""``OperatorClient``: what ``kvpool ping``, ``info`` and ``top`` use to ask a daemon about itself.

It connects under a role of its own (``Role.OPERATOR``), so the tools that list the engines
connected to a daemon do not count themselves among them, and it sends no heartbeats: each
command is a few round trips, each bounded by ``timeout_ms`` (``DaemonUnavailable`` past it).
It stores, loads and pins nothing.
"""

from __future__ import annotations

from kvpool.client.transport import Transport
from kvpool.shared import protocol as p
from kvpool.shared.config import ClientConfig
from kvpool.shared.errors import ProtocolError


class OperatorClient:
    def __init__(self, config: ClientConfig, name: str = "kvpool-cli") -> None:
        self._t = Transport(config, p.Role.OPERATOR, name, heartbeat=False)

    def connect(self) -> None:
        """Connect now (bounded by ``timeout_ms``), so that ``ping`` times the round trip
        alone."""
        self._t.ensure_connected()

    def ping(self) -> p.Pong:
        return self._call(p.Ping, p.Pong)

    def info(self) -> p.PoolInfo:
        return self._call(p.InfoRequest, p.InfoReply).info

    def close(self) -> None:
        self._t.close()

    def _call(self, request: type, reply_type: type):
        reply = self._t.call(request)
        if not isinstance(reply, reply_type):
            raise ProtocolError(f"kvpoold answered {type(reply).__name__} to "
                                f"{request.__name__}")
        return reply
