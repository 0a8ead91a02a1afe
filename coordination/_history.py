"""Tell a ZooKeeper that lost its history from one that is only down.

ZooKeeper refuses a client's connect when the client has seen a later transaction (zxid) than the
server's last ("client must try another server"): that keeps a client off a server behind the
ensemble. An ensemble rebuilt empty, or restored from an older backup, is behind every client that
ran before it, and kazoo keeps presenting the zxid it saw, so a running replica would wait, fenced,
for ever. A fresh client (zxid 0) is let in and learns where the ensemble stands; when that is
before what the replica's client saw, the history the replica joined is gone, and only a new
client, in a restarted process, can join the new one.
"""
from __future__ import annotations

from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError

from coordination.errors import ZooKeeperHistoryLostError

__all__ = ["LostHistoryWatch", "ensemble_zxid"]


def ensemble_zxid(hosts: str, timeout_s: float) -> int | None:
    """The ensemble's last transaction id as a fresh client at `hosts` learns it, after a sync (so a
    follower's lag does not show as a loss); None when it does not answer within `timeout_s`."""
    probe = KazooClient(hosts=hosts, timeout=timeout_s)
    try:
        probe.start(timeout=timeout_s)
        probe.sync("/")
        probe.exists("/")  # its answer carries the server's last zxid
        return int(probe.last_zxid)
    except (KazooException, KazooTimeoutError):
        return None  # down, or dropped the probe: nothing to tell yet, asked again later
    finally:
        probe.stop()
        probe.close()


class LostHistoryWatch:
    """While a replica's client is not connected, asks every session timeout (from one session after the
    drop) whether ZooKeeper stands before what that client saw: it will then never take the client back."""

    def __init__(self, hosts: str, session_timeout_s: float, monotonic: Callable[[], float]) -> None:
        """`hosts`: the connect string (`ha.zookeeper`) a fresh client probes."""
        self._hosts, self._every, self._monotonic = hosts, session_timeout_s, monotonic
        self._next: float | None = None  # when to probe next; None while connected

    def check(self, client: KazooClient) -> None:
        """One look, each round of the replica; ZooKeeperHistoryLostError when the ensemble is behind `client`."""
        if client.connected:
            self._next = None
            return
        now = self._monotonic()
        if self._next is None:
            # a dropped connection that comes back within a session is the common case: no probe for it
            self._next = now + self._every
        if now < self._next:
            return
        seen = client.last_zxid  # what kazoo presents at each connect (kept until a session is lost)
        at = ensemble_zxid(self._hosts, self._every)
        self._next = self._monotonic() + self._every
        if at is not None and at < seen and not client.connected:
            raise ZooKeeperHistoryLostError(self._hosts, seen, at)
