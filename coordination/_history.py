"""Tell a ZooKeeper that lost its history from one that is only down.

ZooKeeper refuses a client's connect when the client has seen a later transaction (zxid) than the
server's last ("client must try another server"): that keeps a client off a server behind the
ensemble. An ensemble rebuilt empty, or restored from an older backup, is behind every client that
ran before it, and kazoo keeps presenting the zxid it saw, so a running replica would wait, fenced,
for ever. A fresh client (zxid 0) is let in and learns where the ensemble stands; when that is
before what the replica's client saw, the history the replica joined is gone, and only a new
client, in a restarted process, can join the new one.

A replacement already past what the client saw (a new ensemble other clients used, another
cluster's backup) takes it back in a new session, as after an ordinary expiry, but without the
shard's tree, which a replica creates at start: so under each new session the replica looks for the
`<shard>/lease` znode it joined, told by its creation (zxid and time), which an expiry leaves in
place. One gone or created again is the same loss: epochs counted again from 1, and znode versions
of another history, would mislead what the replica kept of the old one.

Under the session that found it, only a delete by hand or by a tool takes that znode (ZooKeeper
never removes a persistent one): the replica looks for it every round (one read) and, gone or
created again, stops with LeasePathDeletedError, its thread's end revoking its fence. Carrying on
under a path created again is not safe. Not for the epochs: ZooKeeper numbers a znode's children by
its child version (`cversion`), which a new znode counts from 0, so the next holder's epoch would
be 1 again, at or below those the shard's watermark and its delivered messages carry (the
watermark's compare-and-set refuses every mark of such a holder, which then loses the lease each
round it takes it, and a standby files its marks under an old holder's epoch, or drops them as
older than the last eight it keeps). Nor for the holders: the delete took the holder's lease node
while its session, and so its fence, lived on, and another replica could confirm a lease in the new
path before the old holder's next round. A process started again keeps nothing of the old epochs
and may join a new path, but not under the old one's watermark: a start refuses
(LeasePathDeletedError) while the shard's watermark holds an epoch above the path's child version
(the path gone, or created again after the watermark was written), which within one history is
never below an epoch its children gave. Counting epochs from 1 again is left to an operator, who
deletes the watermark once the replicas have stopped, as after a ZooKeeper rebuilt empty.

The look is taken by the replica's own thread each round and by a thread of the watch's own
(`join(stopping=...)`): a request the replica's thread made while its client was reconnecting waits
in kazoo's queue until a connection is made, so against a ZooKeeper that refuses it for good that
thread never comes back to look. The watch's thread then stops the client, which fails the waiting
request, and the replica's next round raises what the watch found.

A replica's client tries to reconnect at least every half session however long ZooKeeper was down
(kazoo's own wait doubles up to an hour), so that it is back, and may keep its session, soon after
ZooKeeper is.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from coordination._bounded_requests import BoundedRequestsHandler
from coordination._session_grant import record_grants
from coordination.errors import LeasePathDeletedError, ZooKeeperHistoryLostError
from coordination.watermark import MalformedWatermark, read_watermark

__all__ = ["LostHistoryWatch", "end_session", "ensemble_zxid", "lease_path_deleted", "replica_client"]

log = logging.getLogger(__name__)


def replica_client(hosts: str, session_timeout_s: float) -> KazooClient:
    """A replica's ZooKeeper client, which waits at most half a session (plus kazoo's jitter, up to 40 %)
    between reconnects, so that it is back within a session of ZooKeeper, however long that was down."""
    retry = KazooRetry(max_tries=-1, max_delay=session_timeout_s / 2)
    # a request waits a session at most, not until a lost connection is back (`coordination._bounded_requests`)
    return record_grants(KazooClient(hosts=hosts, timeout=session_timeout_s, connection_retry=retry,
                                     handler=BoundedRequestsHandler(session_timeout_s)))


def end_session(client: KazooClient) -> None:
    """Stop and close a replica's client: its session ends, and its ephemeral nodes (the lease node) go with it."""
    try:
        client.stop()
        client.close()
    except KazooException:
        log.warning("closing the ZooKeeper session failed", exc_info=True)


def ensemble_zxid(hosts: str, timeout_s: float) -> int | None:
    """The ensemble's last transaction id as a fresh client at `hosts` learns it, after a sync (so a
    follower's lag does not show as a loss); None when it does not answer within `timeout_s`."""
    probe = KazooClient(hosts=hosts, timeout=timeout_s, handler=BoundedRequestsHandler(timeout_s))
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
    drop) whether ZooKeeper stands before what that client saw: it will then never take the client back.
    Under each new session, looks (after a sync) for the shard's tree the replica joined at start (`join`),
    and under the session that found it, every round: only a delete by hand or by a tool takes it then."""

    def __init__(self, hosts: str, session_timeout_s: float, monotonic: Callable[[], float]) -> None:
        """`hosts`: the connect string (`ha.zookeeper`) a fresh client probes."""
        self._hosts, self._every, self._monotonic = hosts, session_timeout_s, monotonic
        self._next: float | None = None  # when to probe next; None while connected
        self._tree: tuple[str, int, int] | None = None  # the lease path joined, its czxid and ctime
        self._session: int | None = None  # the last session under which the tree was found (synced with once each)
        self._lock = threading.Lock()  # the probes' schedule: the replica's thread and the watch's both look
        self._found: Exception | None = None  # what the watch's thread found, raised by the replica's next look

    def join(self, client: KazooClient, lease_path: str, stopping: threading.Event | None = None) -> None:
        """At start: create the shard's tree down to `lease_path` (LeasePathDeletedError when the shard's watermark
        holds an epoch it cannot have given), and remember which one this replica joined; with `stopping` (set
        when the replica stops), look from a thread of the watch's own as well."""
        deleted = lease_path_deleted(client, lease_path)
        if deleted is not None:
            raise deleted
        client.ensure_path(lease_path)
        stat, client_id = client.exists(lease_path), client.client_id
        if client_id is None:
            raise ConnectionLoss("the connection to ZooKeeper dropped while the replica joined its shard")
        if stat is None:
            raise NoNodeError(f"{lease_path} was deleted as the replica created it")
        self._tree, self._session = (lease_path, stat.czxid, stat.ctime), client_id[0]
        if stopping is not None:
            threading.Thread(target=self._watch, args=(client, stopping), name="timewheel-zookeeper-history",
                             daemon=True).start()

    def _watch(self, client: KazooClient, stopping: threading.Event) -> None:
        """Probe while the client is not connected, from beside the replica's thread; once ZooKeeper is found
        behind (or the probe fails unexpectedly), keep it for the replica's next look and stop the client, so
        that a request the replica's thread waits on fails instead of waiting for a connection never made."""
        while not stopping.wait(self._every / 2):
            try:
                if not client.connected:
                    self._probe_if_due(client)
            except Exception as e:  # the replica's thread raises it: this one only records and unblocks
                self._found = e
                client.stop()
                return

    def check(self, client: KazooClient) -> None:
        """One look, each round of the replica; ZooKeeperHistoryLostError when the ensemble is behind `client`,
        or took it back in a new session without the shard's tree it joined (or what the watch's thread found);
        LeasePathDeletedError when that tree's lease path is gone, or another, under the session that found it."""
        if self._found is not None:
            raise self._found
        if client.connected:
            with self._lock:
                self._next = None
            self._same_tree(client)
            return
        self._probe_if_due(client)

    def _probe_if_due(self, client: KazooClient) -> None:
        """Probe the ensemble once a session has passed since the client was last seen connected (and every
        session after); ZooKeeperHistoryLostError when it stands before what the client saw."""
        with self._lock:
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

    def _same_tree(self, client: KazooClient) -> None:
        """Under a session not yet looked at, ZooKeeperHistoryLostError when the lease path joined is gone or
        was created again; under the one that last found it, LeasePathDeletedError."""
        tree = self._tree
        client_id = client.client_id if tree is not None else None
        if tree is None or client_id is None:
            return
        path, czxid, ctime = tree
        if client_id[0] == self._session:
            # a session's reads never go back: once gone (or another znode) under it, it was deleted since
            stat = client.exists(path)
            if stat is None or (stat.czxid, stat.ctime) != (czxid, ctime):
                raise LeasePathDeletedError(path, f"{path.rsplit('/', 1)[0]}/watermark")
            return
        client.sync(path)  # a new session may start on a follower behind the leader
        stat = client.exists(path)
        if stat is None or (stat.czxid, stat.ctime) != (czxid, ctime):
            raise ZooKeeperHistoryLostError(self._hosts, czxid, int(client.last_zxid), lost_path=path)
        self._session = client_id[0]


def lease_path_deleted(client: KazooClient, lease_path: str) -> LeasePathDeletedError | None:
    """LeasePathDeletedError (not raised) when the shard's watermark holds an epoch `lease_path` cannot have
    given: it is gone, or was created again, since the watermark was written; None otherwise."""
    shard_path = lease_path.rsplit("/", 1)[0]
    # the watermark first: the path's child version read after it is at least its epoch in one history
    epoch = _watermark_epoch(client, shard_path)
    found = client.exists(lease_path)
    if epoch and (found is None or found.cversion < epoch):
        return LeasePathDeletedError(lease_path, f"{shard_path}/watermark", watermark_epoch=epoch,
                                     next_epoch=None if found is None else found.cversion + 1)
    return None


def _watermark_epoch(client: KazooClient, shard_path: str) -> int:
    """The epoch of the shard's watermark (0: none published)."""
    try:
        return read_watermark(client, shard_path).epoch
    except MalformedWatermark:
        # says nothing of the epochs: the replica's rounds report it, and its next holder writes over it
        return 0
