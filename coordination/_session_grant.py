"""The session timeout ZooKeeper granted a replica's client, which its fence is measured against.

A client asks for a session timeout; the server grants one within its own `minSessionTimeout` and
`maxSessionTimeout` (by default 2 and 20 ticks) and expires the session that long after the last
request it received. A standby takes over at that expiry, so a holder whose fence is measured
against the timeout it asked for, longer than the one granted, would still be sending then: two
senders. Kazoo reads the granted timeout from the server's connect answer but keeps only the one
it asked for, so a replica's client records each answer's grant itself (`record_grants`).
"""
from __future__ import annotations

import logging
from typing import Any

from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Connect

__all__ = ["granted_session_timeout_s", "record_grants"]

log = logging.getLogger("timewheel.replica")


class _GrantRecordingConnection(ConnectionHandler):
    """Kazoo's connection handler, keeping the session timeout of the server's last connect answer."""

    granted_ms: int | None = None

    def _invoke(self, timeout: float, request: Any, xid: int | None = None) -> Any:
        result = super()._invoke(timeout, request, xid)
        if isinstance(request, Connect) and isinstance(result, tuple) and result[0].time_out > 0:
            granted, asked = result[0].time_out, request.time_out
            if granted != self.granted_ms and granted < asked:
                log.warning("ZooKeeper granted a session of %g s where ha.session_timeout_s asks for %g s (its "
                            "maxSessionTimeout is lower): the lease is fenced within %g s; set ha.session_timeout_s "
                            "within the server's minSessionTimeout..maxSessionTimeout", granted / 1000,
                            asked / 1000, granted / 1000)
            self.granted_ms = granted
        return result


def record_grants(client: KazooClient) -> KazooClient:
    """Make `client` (not started yet) keep the session timeout each connect is granted; returns it."""
    # the handler is made in KazooClient's constructor: turning it into the subclass keeps its state
    client._connection.__class__ = _GrantRecordingConnection
    return client


def granted_session_timeout_s(client: KazooClient, asked_s: float) -> float:
    """The session timeout the server last granted `client` (`asked_s` before any grant, or without
    `record_grants`)."""
    granted = getattr(client._connection, "granted_ms", None)
    return granted / 1000 if granted else asked_s
