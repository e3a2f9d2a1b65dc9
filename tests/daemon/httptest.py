"""Helpers for tests of kvpoold's HTTP endpoints (/metrics, /healthz)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for flags that take a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> tuple[int, str]:
    """(status, body) of a GET; HTTP errors are answers too (503 from /healthz)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
