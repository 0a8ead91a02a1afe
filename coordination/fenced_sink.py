"""The fence on delivery, decided in one place: a sink that sends only while this replica may.

RocketMQ brokers check no token on send, so a holder fences itself (docs/HA.md, "Fencing by
time"). `FencedSink` wraps the delivery sink and is where a send batch's fence is decided:

- before the batch goes: a closed fence holds the whole batch, nothing is sent;
- at the write: the fence goes down to the producer as its last check, under each broker
  connection's lock (`RemotingProducer.send_encoded(fence=...)`), so a pause that lands while the
  batch is encoded still finds the deadline passed; what it stops comes back not sent;
- after the send: only rows the write's check stopped (the inner sink marks them held) are held.
  A row that failed after its request was written (a timeout) may be stored by the broker, even if
  the fence closed meanwhile: it stays a failed attempt, so it is looked up before it is sent
  again, by this replica once its fence opens or by the next holder.

Held rows are marked in `SendResults.held`; the dispatcher queues them again without spending an
attempt (for whoever holds the lease), never records them delivered.

Dead letters are sends too: `FencedDeadLetters` refuses them while the fence is closed. A replica
whose last attempt of a message failed as its lease ran out must not park it on the dead-letter
topic while the next holder looks it up and delivers it; the refusal keeps it for another attempt
(the dead-letter path's own failure handling), made once this replica may send again.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from storage import RecordBytes
from coordination.errors import CoordinationError
from timewheel.errors import NotSendingNowError
from timewheel.message import DeadLetterSink, Fence, Message, RecordSink, SendResults

__all__ = ["FencedDeadLetters", "FencedSink", "NotHoldingError"]


class NotHoldingError(CoordinationError, NotSendingNowError):
    """Not sent: this replica may not send now (its lease fence is closed); kept for another attempt."""


class FencedSink:
    """A RecordSink that passes batches on to `inner` only while `fence()` answers True."""

    def __init__(self, inner: RecordSink, fence: Fence) -> None:
        """Wrap the delivery sink; `fence` is the replica's `may_send`."""
        self.inner = inner
        self.fence = fence
        self.max_in_flight = int(getattr(inner, "max_in_flight", 1))
        self.linger_ms = int(getattr(inner, "linger_ms", 0))
        # how far the linger grows under load: dropped here, it would stay at its quiet floor
        self.linger_max_ms: int | None = getattr(inner, "linger_max_ms", None)

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Fence | None = None) -> list[bool]:
        """Send stored records unless fenced; the fence is also the write's last check."""
        if not self.fence():
            return _all_held(len(records))
        return self.inner.send_records(records, extra, self.fence)

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send messages unless fenced; one bool per message."""
        if not self.fence():
            return _all_held(len(messages))
        return self.inner.send_batch(messages)


def _all_held(n: int) -> SendResults:
    """Nothing sent: every row held."""
    return SendResults([False] * n, errors=["held: this replica may not send now"] * n, held=np.ones(n, bool))


class FencedDeadLetters:
    """A DeadLetterSink that parks messages through `inner` only while `fence()` answers True."""

    def __init__(self, inner: DeadLetterSink, fence: Fence) -> None:
        """Wrap the dead-letter sink; `fence` is the replica's `may_send`."""
        self.inner = inner
        self.fence = fence

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        """Park messages unless fenced; raises NotHoldingError (nothing sent) when fenced."""
        if not self.fence():
            raise NotHoldingError(f"{len(messages)} message(s) not dead-lettered: this replica may not send now "
                                  f"(its lease fence is closed); kept for another attempt")
        self.inner.dead_letter(messages, reason)
