"""The delivery gate: what lets one replica of a shard send while the others only store.

Several engines may hold the same schedule (replicas of one shard of the delay topic, each
consuming it into its own data directory). Only the holder of the shard's lease sends; the
dispatcher asks its gate, a small protocol the core defines and `coordination` implements:

- `may_send()` is asked once per pass, before anything is read: when it answers False (a standby)
  the entries are held (queued again without counting an attempt), never dropped. The fence on
  each send itself is the delivery sink's (`coordination.FencedSink` around it, asked right before
  the send and at the write): the rows it holds come back `SendResults.held` and are held the same way;
- `delivered_elsewhere_up_to()` is the latest watermark published by the shard's holders: no
  entry due after it was delivered elsewhere, so only entries due at or before it are asked about;
- `delivered_elsewhere(due, origins, queue_names)` says, entry by entry, which of those the holder
  delivered: due at or before its watermark **and** below the offset up to which it had stored the
  entry's queue (a message that reached the shard late, after the watermark passed its due time,
  is not one the holder sent). This replica records those as delivered (a dispatch-log row with
  attempts 0) without sending them.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import numpy as np

#: no watermark: nothing is known to be delivered elsewhere
NO_WATERMARK = -1

#: one entry a holder has not finished although it is due by its watermark: (queue, offset, due ms)
PendingEntry = tuple[str, int, int]


class DeliveredMark(NamedTuple):
    """A holder's delivered-up-to watermark with its exceptions: every entry due at or before
    `up_to` has its outcome recorded, except the few listed by origin (queue `broker:id`, offset,
    due ms), which are still being retried. `frozen`: computed after a failure on the delivery path,
    it is the last mark from before (publish nothing new: paired with offsets read since, it could
    cover a message stored after the failure that nobody sent)."""

    up_to: int
    exceptions: tuple[PendingEntry, ...] = ()
    frozen: bool = False


class DeliveryGate(Protocol):
    """Whether this engine may send now, and what another replica delivered already."""

    #: how long held entries wait before the dispatcher looks at them again
    hold_ms: int

    @property
    def took_over_ms(self) -> int:
        """When (epoch ms) this replica last became the holder, 0 never: what the previous holder may
        have sent is due up to then (looked up before it is sent again: `timewheel._recovery`)."""
        ...

    def may_send(self) -> bool:
        """True while this engine holds the shard's lease and its fencing deadline has not passed."""
        ...

    def delivered_elsewhere_up_to(self) -> int:
        """No entry due after this (epoch ms) was delivered by another replica (NO_WATERMARK: none was)."""
        ...

    def delivered_elsewhere(self, due: np.ndarray, origins: np.ndarray, queue_names: Sequence[str]) -> np.ndarray:
        """Which entries (due times, and origins as `storage.ORIGIN_DTYPE` rows numbered by
        `queue_names`) another replica delivered: a bool per entry."""
        ...

    def count(self, peer_delivered: int, held: int) -> None:
        """Entries recorded as delivered by another replica, and entries held by the fence, in one pass."""
        ...
