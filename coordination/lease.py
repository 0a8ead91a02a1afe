"""Names and counts of a shard's lease: sequence numbers and epochs of lease nodes, a replica's counters."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaCounters", "ReplicaIdTaken", "epoch_of", "lease_sequence"]


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


class ReplicaIdTaken(RuntimeError):
    """Another live process of the shard already uses this replica's id."""
