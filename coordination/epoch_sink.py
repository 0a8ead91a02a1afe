"""The holder's sink: every message it sends carries the lease epoch it was sent under."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Sequence

from storage import RecordBytes
from timewheel.message import Fence, Message, RecordSink

if TYPE_CHECKING:
    from coordination.replica import ShardReplica

__all__ = ["EPOCH_PROPERTY", "EpochStampingSink"]

#: the message property carrying the lease epoch under which a message was sent
EPOCH_PROPERTY = "TW_LEASE_EPOCH"


class EpochStampingSink:
    """A RecordSink that adds the lease epoch to every message it passes on (`TW_LEASE_EPOCH`).

    It stamps, it does not fence: `FencedSink` around it decides whether a batch may go, and the
    fence it hands down reaches the write unchanged."""

    def __init__(self, inner: RecordSink, replica: ShardReplica) -> None:
        """Stamp what goes through to `inner` with `replica`'s epoch."""
        self.inner = inner
        self.replica = replica
        self.max_in_flight = int(getattr(inner, "max_in_flight", 1))
        self.linger_ms = int(getattr(inner, "linger_ms", 0))
        # how far the linger grows under load: dropped here, it would stay at its quiet floor
        self.linger_max_ms: int | None = getattr(inner, "linger_max_ms", None)

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Fence | None = None) -> list[bool]:
        """Stamp and send stored records (the epoch is one more property); one bool per record."""
        results = self.inner.send_records(records, {**(extra or {}), EPOCH_PROPERTY: str(self.replica.epoch)}, fence)
        self.replica.note_sent_due(records.header["due_ms"])
        return results

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Stamp and send; one bool per message."""
        epoch = str(self.replica.epoch)
        stamped = [replace(m, properties={**(m.properties or {}), EPOCH_PROPERTY: epoch}) for m in messages]
        results = self.inner.send_batch(stamped)
        self.replica.note_sent(messages)
        return results
