"""Loopback ports for the real processes tests start (engines, admin endpoints, ZooKeeper)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
