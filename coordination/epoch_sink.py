"""The holder's sink: every message it sends carries the lease epoch it was sent under."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

from storage import RecordBytes
from timewheel.message import Message, Sink

if TYPE_CHECKING:
    from coordination.replica import ShardReplica

__all__ = ["EPOCH_PROPERTY", "EpochStampingSink"]

#: the message property carrying the lease epoch under which a message was sent
EPOCH_PROPERTY = "TW_LEASE_EPOCH"


class EpochStampingSink:
    """A Sink that adds the lease epoch to every message it passes on (`TW_LEASE_EPOCH`)."""

    def __init__(self, inner: Sink, replica: ShardReplica) -> None:
        self.inner = inner
        self.replica = replica
        self.max_in_flight = int(getattr(inner, "max_in_flight", 1))
        self.linger_ms = int(getattr(inner, "linger_ms", 0))
        send_records = getattr(inner, "send_records", None)
        if callable(send_records):
            # A sink that takes records as stored gets them still: the epoch is one more property.
            self.send_records = lambda records: self._send_records(send_records, records)

    def _send_records(self, send: Callable[..., list[bool]], records: RecordBytes) -> list[bool]:
        # The lease is asked again right before the write, not only before the batch was read and encoded.
        results = send(records, {EPOCH_PROPERTY: str(self.replica.epoch)}, self.replica.may_send)
        self.replica.note_sent_due(records.header["due_ms"])
        return results

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Stamp and send; one bool per message."""
        epoch = str(self.replica.epoch)
        stamped = [replace(m, properties={**(m.properties or {}), EPOCH_PROPERTY: epoch}) for m in messages]
        results = self.inner.send_batch(stamped)
        self.replica.note_sent(messages)
        return results
