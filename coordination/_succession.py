"""When a replica whose lease node became the lowest may send: after every earlier holder's fence is shut.

A holder's lease node vanishes in one of two ways:

- its session ended. ZooKeeper expired it, no earlier than a session timeout after the last request
  it received, so after the holder's fence (`fence_fraction` of that timeout from when the request
  was sent, `coordination.fencing`) had passed; or the holder closed it, revoking its fence first.
  Either way the session's other ephemeral znodes went in the same transaction, among them
  `<shard>/replicas/<replica_id>` (`coordination.lease.claim_replica_id`). The next replica may
  send at once, as it always did.
- the node alone was deleted (zkCli's `delete`, a tool) while the session lives. The holder learns
  it from a watch on its own node (revoking its fence at once) or at its next round, but watches
  are delivered asynchronously and a round can be held up (a slow answer, a pause of its thread),
  while its fence stays open for up to `fence_fraction` x session timeout after its last
  confirmation. Taking over at once let both replicas send the same due messages.

So a replica that sees a node below its own gone looks for the holder's session, in the same
session as that look (so no older view): its `replicas/<id>` znode still owned by that session
means the node was deleted by hand, and it waits out the longest fence that holder can have (its
`fence_s`, published in that znode; this replica's own, if longer or unreadable) counted from the
answer that showed the node gone. That bound holds whatever the holder's threads do: each of its
confirmations was a request the server answered before the delete, sent earlier still, so its fence
shuts before the delete plus that length, and the delete came before the answer that showed it. At
a lease node's first look (at start, under a new session, once eligible) a node deleted before
that look is one it never saw: it waits the same if another replica's `replicas/<id>` znode lives
with no lease node of that replica among those it saw (deleted, or not yet made: waiting costs that
case nothing but the wait). A replica that lost its node revokes its fence before it makes a new
one, so a replica seen with a node holds no fence but that node's. What it costs: nothing when
every replica is seen with its node (a start, a restart, a takeover after a holder died, was
stopped or lost its session), one fence after a delete by hand. Not covered: a delete by hand of both the
holder's lease node and its `replicas/<id>` znode (the holder then looks dead), and holders whose
clocks' rates differ by more than the fence's margin (as for every fence).
"""
from __future__ import annotations

import json
import logging
import math
from typing import Callable, Sequence

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

__all__ = ["Succession", "fence_advert"]

log = logging.getLogger("timewheel.replica")

#: the longest fence any replica's settings give (fence_fraction 0.9 of a 60 s session): a larger `fence_s`
#: in a znode (written by hand) must not keep a replica from the lease for longer
_LONGEST_FENCE_S = 0.9 * 60.0


def fence_advert(fence_s: float) -> bytes:
    """The data of a replica's `replicas/<id>` znode: the longest fence it can hold, in seconds."""
    return json.dumps({"fence_s": fence_s}).encode()


def _advertised(data: bytes) -> float:
    """The `fence_s` a `replicas/<id>` znode holds (0 when it holds none: the reader's own then counts)."""
    try:
        got = json.loads(data.decode()).get("fence_s", 0.0)
        return min(float(got), _LONGEST_FENCE_S) if isinstance(got, (int, float)) and math.isfinite(got) else 0.0
    except (ValueError, UnicodeDecodeError, AttributeError):
        return 0.0


class Succession:
    """The lease nodes seen below this replica's and whose session owned each; until when it may not send."""

    def __init__(self, shard_path: str, replica_id: str, fence_s: float, monotonic: Callable[[], float]) -> None:
        """`fence_s`: the longest fence this replica's own settings give (fence_fraction x session timeout)."""
        self._replicas = f"{shard_path}/replicas"
        self._replica_id = replica_id
        self.fence_s, self._monotonic = fence_s, monotonic
        self._below: dict[str, tuple[int, str] | None] = {}  # node -> (owner session, replica id); None: unread
        self._looked = False
        self.hold_until = -math.inf

    def new_node(self) -> None:
        """This replica's lease node is a new one: what it saw below the last one says nothing of this one."""
        self._below, self._looked = {}, False

    def look(self, client: KazooClient, lease_path: str, children: Sequence[str], ours: str) -> None:
        """After a look at the lease nodes (`children`, lowest first, `ours` among them): wait out the fence of
        any earlier holder that may still be sending."""
        seen_at = self._monotonic()  # after the answer: later than any delete it showed
        below = list(children[:children.index(ours)])
        if not self._looked:
            self._looked = True
            if self._unseen_replica(client, lease_path, children):
                self._hold(seen_at + self.fence_s)
        for gone in [n for n in self._below if n not in below]:
            owner = self._below.pop(gone)
            fence_s = self._live_fence(client, owner) if owner is not None else 0.0  # unread: held when read
            if fence_s:
                self._hold(seen_at + fence_s)
                log.warning("%s: the lease node %s vanished while its replica's session lives (deleted by hand or "
                            "by a tool); this replica sends nothing for %.1f s, the longest that holder's fence can "
                            "stay open", lease_path, gone, fence_s)
        for node in below:
            if node not in self._below:
                self._below[node] = self._owner(client, f"{lease_path}/{node}")

    def wait_s(self) -> float:
        """Seconds before this replica may take the lease (0: now)."""
        return max(0.0, self.hold_until - self._monotonic())

    def _unseen_replica(self, client: KazooClient, lease_path: str, children: Sequence[str]) -> bool:
        """Whether another replica's `replicas/<id>` znode lives with none of `children` its lease node (a lease
        node holds its replica's id): one deleted by hand before this look may still be fenced to send."""
        try:
            others = set(client.get_children(self._replicas)) - {self._replica_id}
        except NoNodeError:
            return True  # not even ours: a view it cannot judge by, so it waits
        for node in children:
            if not others:
                break
            try:
                data, _ = client.get(f"{lease_path}/{node}")
            except NoNodeError:
                return True  # gone since the look: as if never seen
            others.discard(data.decode(errors="replace"))
        return bool(others)

    def _hold(self, until: float) -> None:
        self.hold_until = max(self.hold_until, until)

    def _owner(self, client: KazooClient, path: str) -> tuple[int, str] | None:
        """The session owning a lease node and its replica's id; gone already: hold as for a live one."""
        try:
            data, stat = client.get(path)
        except NoNodeError:
            self._hold(self._monotonic() + self.fence_s)  # vanished unread: the answer came after the delete
            return None
        return stat.ephemeralOwner, data.decode(errors="replace")

    def _live_fence(self, client: KazooClient, owner: tuple[int, str]) -> float:
        """The longest fence of a vanished node's holder whose session lives (0: it ended)."""
        session, replica_id = owner
        try:
            data, stat = client.get(f"{self._replicas}/{replica_id}")
        except NoNodeError:
            return 0.0
        return max(self.fence_s, _advertised(data)) if stat.ephemeralOwner == session else 0.0
