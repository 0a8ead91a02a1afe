"""The delivery gate: what lets one replica of a shard send while the others only store.

Several engines may hold the same schedule (replicas of one shard of the delay topic, each
consuming it into its own data directory). Only the holder of the shard's lease sends; the
dispatcher asks its gate, a small protocol the core defines and `coordination` implements:

- `may_send()` is checked right before every send batch (the fence): when it answers False the
  batch is held (queued again without counting an attempt), never dropped;
- `delivered_elsewhere_up_to()` is the watermark published by the shard's (last) active replica:
  every entry due at or before it was delivered there, so this replica records it as delivered
  (a dispatch-log row with attempts 0) without sending it.
"""
from __future__ import annotations

from typing import Protocol

#: no watermark: nothing is known to be delivered elsewhere
NO_WATERMARK = -1


class DeliveryGate(Protocol):
    """Whether this engine may send now, and what another replica delivered already."""

    #: how long held entries wait before the dispatcher looks at them again
    hold_ms: int

    def may_send(self) -> bool:
        """True while this engine holds the shard's lease and its fencing deadline has not passed."""
        ...

    def delivered_elsewhere_up_to(self) -> int:
        """Entries due at or before this (epoch ms) were delivered by another replica (NO_WATERMARK: none)."""
        ...

    def count(self, peer_delivered: int, held: int) -> None:
        """Entries recorded as delivered by another replica, and entries held by the fence, in one pass."""
        ...
