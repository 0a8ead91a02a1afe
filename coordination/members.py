"""Every live replica of a delay topic, where each sees the others whatever its `root` and `shards`.

Replicas coordinate under `<root>/<delay topic>/shard-<k>-of-<shards>`: two that disagree on `root`
or `shards` never meet there, so each would hold a lease of its own and both would deliver the
queues they share. So each live replica also holds an ephemeral znode at a path no setting moves,
`/timewheel-replica-sets/<delay topic>/member-<seq>` (inside the connect string's chroot, if any),
whose data says how it is configured:

    {"root": R, "shards": N, "shard": K, "replica_id": I, "namesrv": [A, ...], "host": H, "pid": P}

A starting replica registers before it creates anything under its root, then reads the other
members of its delay topic on its RocketMQ cluster (NameServer lists that share an address; a member
that names none counts as on every cluster), and is refused (`ReplicaSetMismatch`) when one of them
has another `root` or `shards`. It registers again, unchecked, under each new session, so that it
stays visible to the replicas that start after it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from typing import Iterable, Iterator, Mapping

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoNodeError

from coordination.config import HAConfig
from coordination.errors import CoordinationError
from coordination.lease import ReplicaIdTaken

__all__ = ["SETS_PATH", "Membership", "ReplicaSetMismatch", "mismatch"]

log = logging.getLogger("timewheel.replica")

#: the parent of every delay topic's members: fixed, so that replicas with different roots meet there
SETS_PATH = "/timewheel-replica-sets"
#: the settings every replica of a delay topic (every shard's) must share
_SHARED = ("root", "shards")


class ReplicaSetMismatch(ReplicaIdTaken, CoordinationError):
    """A live replica of the same delay topic has another `root` or `shards`: this one is refused at
    start, as a replica whose id is live is, rather than hold a lease of its own beside theirs."""

    def __init__(self, setting: str, ours: object, theirs: object, peer: Mapping[str, object],
                 delay_topic: str) -> None:
        """The message names the setting, both values, and the live replica that has the other one."""
        self.setting, self.ours, self.theirs = setting, ours, theirs
        where = f"shard {peer.get('shard')} of {peer.get('shards')}, host {peer.get('host')}, pid {peer.get('pid')}"
        super().__init__(
            f"ha.{setting} = {ours!r} differs from the live replica {peer.get('replica_id')!r} ({where}) of delay "
            f"topic {delay_topic}, which has ha.{setting} = {theirs!r}: replicas of one delay topic must share "
            f"ha.root and ha.shards, or each holds a lease of its own and both deliver. Start this one with "
            f"ha.{setting} = {theirs!r}, or stop that one first (a replica that died is forgotten once its "
            "ZooKeeper session expires); a separate deployment that shares this ZooKeeper and the delay topic's "
            "name needs a chroot of its own (ha.zookeeper = \"HOST:PORT/chroot\")")


def mismatch(ours: Mapping[str, object], members: Iterable[Mapping[str, object]],
             delay_topic: str) -> ReplicaSetMismatch | None:
    """The refusal for the first member on our RocketMQ cluster with another root or shards (None: all agree)."""
    ours_ns = _addresses(ours.get("namesrv"))
    for m in members:
        theirs_ns = _addresses(m.get("namesrv"))
        if theirs_ns and ours_ns and not theirs_ns & ours_ns:
            continue  # another RocketMQ cluster's delay topic of the same name
        for setting in _SHARED:
            if setting in m and m[setting] != ours[setting]:
                return ReplicaSetMismatch(setting, ours[setting], m[setting], m, delay_topic)
    return None


class Membership:
    """This replica's member znode: registered and checked at start, registered again under each new session."""

    def __init__(self, cfg: HAConfig, delay_topic: str, namesrv: str = "") -> None:
        """`namesrv`: the RocketMQ NameServer list (`;`-separated) the replica reads its delay topic from."""
        self.delay_topic = delay_topic
        self.path = f"{SETS_PATH}/{delay_topic}"
        #: this replica's member document
        self.doc: dict[str, object] = {
            "root": cfg.root, "shards": cfg.shards, "shard": cfg.shard, "replica_id": cfg.replica_id,
            "namesrv": sorted({a.strip().lower() for a in namesrv.split(";") if a.strip()}),
            "host": socket.gethostname(), "pid": os.getpid()}
        self._session: int | None = None  # the session our member znode lives in
        self._checked = False

    def join(self, client: KazooClient) -> None:
        """Register under the client's session, unless already done; the first time, ReplicaSetMismatch
        (our znode removed) when a live member of the delay topic has another root or shards."""
        client_id = client.client_id
        if client_id is None:
            raise ConnectionLoss("the connection to ZooKeeper dropped while the replica registered")
        if client_id[0] == self._session:
            return
        node = client.create(f"{self.path}/member-", json.dumps(self.doc).encode(), ephemeral=True, sequence=True,
                             makepath=True)
        self._session = client_id[0]
        if self._checked:
            return
        refused = mismatch(self.doc, self._others(client, node.rsplit("/", 1)[1]), self.delay_topic)
        if refused is not None:
            client.delete(node)
            self._session = None
            raise refused
        self._checked = True

    def _others(self, client: KazooClient, mine: str) -> Iterator[Mapping[str, object]]:
        for child in client.get_children(self.path):
            if child == mine:
                continue
            try:
                doc = json.loads(client.get(f"{self.path}/{child}")[0])
            except NoNodeError:  # left while we read
                continue
            except ValueError:
                log.warning("replica set member %s/%s cannot be read; not compared", self.path, child)
                continue
            if isinstance(doc, dict):
                yield doc


def _addresses(value: object) -> set[str]:
    return {str(a) for a in value} if isinstance(value, list) else set()
