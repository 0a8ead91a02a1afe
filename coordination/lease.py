"""Names and counts of a shard's lease: sequence numbers and epochs of lease nodes, a replica's counters,
the znodes that are a replica's own (its lease node, its id)."""
from __future__ import annotations

from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NodeExistsError

from coordination.errors import CoordinationError

__all__ = ["ReplicaCounters", "ReplicaIdTaken", "claim_replica_id", "epoch_of", "lease_sequence", "our_node"]


@dataclass
class ReplicaCounters:
    """What a replica counted since it started."""

    takeovers: int = 0  # times it became the holder
    losses: int = 0  # times it stopped holding (revoked, expired, superseded)
    peer_delivered: int = 0  # entries recorded as delivered by another replica (due by its watermark)
    held: int = 0  # entries held back because this replica could not send (standby, fence)
    possible_duplicates: int = 0  # sent after a takeover, due after the last holder's watermark, by its next one
    watermarks_published: int = 0
    late_arrivals: int = 0  # due by a holder's watermark but not stored by it then (offset past its mark): sent here
    watermark_ahead: int = 0  # times a holder's watermark was ahead of this replica's clock (clamped to it)
    malformed_watermarks: int = 0  # watermark znodes that could not be read (ignored: sent, not dropped)


def lease_sequence(node: str) -> int:
    """The sequence number ZooKeeper appended to a lease node's name (its last ten digits)."""
    return int(node[-10:])


def epoch_of(node: str) -> int:
    """The epoch of a lease node: its sequence number plus one (0 means no lease)."""
    return lease_sequence(node) + 1


class ReplicaIdTaken(CoordinationError, RuntimeError):
    """Another live process of the shard already uses this replica's id."""


def our_node(client: KazooClient, lease_path: str, prefix: str, session: int | None) -> str | None:
    """A lease node `session` created though the answer was lost (a protected node: its name carries the
    replica's random `prefix`), so that no orphan lowest node is left that nobody holds."""
    for child in client.get_children(lease_path):
        if child.startswith(prefix):
            stat = client.exists(f"{lease_path}/{child}")
            if stat is not None and stat.ephemeralOwner == session:
                return str(child)
    return None


def claim_replica_id(client: KazooClient, shard_path: str, replica_id: str, data: bytes = b"") -> None:
    """Hold `<shard>/replicas/<replica_id>` (ephemeral, holding `data`): a second process with this replica's id
    is refused (ReplicaIdTaken)."""
    path = f"{shard_path}/replicas/{replica_id}"
    try:
        client.create(path, data, ephemeral=True, makepath=True)
        return
    except NodeExistsError:
        stat = client.exists(path)
        # the session as it is now, once ZooKeeper answered: read before the create, while the
        # connection was down, it was none, and our own node looked like another process's
        client_id = client.client_id
        if client_id is None:
            raise ConnectionLoss("the connection to ZooKeeper dropped while the replica id was claimed") from None
        if stat is None or stat.ephemeralOwner == client_id[0]:
            return
    raise ReplicaIdTaken(f"ha.replica_id = {replica_id!r} is already live in shard {shard_path} (another "
                         "process holds it): give each replica of a shard its own id")
