"""The public message type and the protocols the engine talks to its outside through."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from storage import EncodedRecords, Origin, Record, RecordBytes

if TYPE_CHECKING:
    from timewheel.cancels import CancelRequest
    from timewheel.errors import InvalidMessageError


@dataclass(frozen=True, slots=True)
class Message:
    """A message to deliver to `topic` at `deliver_at_ms` (UTC epoch ms)."""

    topic: str
    body: bytes
    deliver_at_ms: int
    tags: str | None = None
    keys: Sequence[str] = ()
    properties: Mapping[str, str] | None = None
    msg_id: str | None = None
    attempts: int = field(default=0, compare=False)

    def to_record(self, msg_id: str) -> Record:
        """The storage record of this message under `msg_id`."""
        return Record(msg_id, self.topic, self.body, self.deliver_at_ms, 0, self.tags or "",
                      tuple(self.keys), dict(self.properties) if self.properties else {})

    @classmethod
    def from_record(cls, rec: Record, attempts: int = 0) -> "Message":
        """The message a stored record describes."""
        return cls(rec.topic, rec.body, rec.due_ms, rec.tags or None, rec.keys, rec.properties or None,
                   rec.msg_id, attempts)


class SendResults(list[bool]):
    """A sink's answer to a send batch: True per stored message (a list, as before), with where the
    broker stored each (`answers`, rows of `storage.ANSWER_DTYPE`, or None), why each failed one
    failed (`errors`, None where stored), for the dispatch log, which were held by a fence
    (`held`: not sent because this engine may not send now; queued again, no attempt spent), and
    the rows of each target topic (`by_topic`), when the sink grouped them anyway."""

    def __init__(self, ok: Sequence[bool], answers: np.ndarray | None = None,
                 errors: Sequence[str | None] | None = None, held: np.ndarray | None = None,
                 by_topic: Mapping[str, list[int]] | None = None) -> None:
        """`ok` per message; `answers`, `errors` and `held` aligned with it, `by_topic` every row
        once under its target topic, when the sink knows them."""
        super().__init__(ok)
        self.answers = answers
        self.errors = list(errors) if errors is not None else None
        self.held = held
        self.by_topic = by_topic


class Sink(Protocol):
    """Where due messages go: True per delivered message; raising means the whole batch failed.

    A sink may also have an int attribute `max_in_flight`: the engine then runs that many dispatch
    threads, each calling `send_batch` while the others wait on the network (one slow answer
    then holds up only its own batch). Such a sink must be thread-safe.

    A sink may also have `send_records` (a `RecordSink`), the same contract for records as stored
    (CRC-checked bytes and header columns): the dispatcher then hands it those instead of a
    `Message` per due message.

    Either may answer a `SendResults` (a list of bools too): the broker's answers and the errors
    it carries go to the dispatch log, so `timewheel find` can show them.
    """

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send messages; one bool per message."""
        ...


#: whether this engine may send now (a replica's lease and its fencing deadline); asked right before a write
Fence = Callable[[], bool]


class RecordSink(Sink, Protocol):
    """A Sink that also sends records as stored: the delivery sink, and what wraps it.

    `send_records` has the contract of `send_batch` for CRC-checked record bytes; `extra`
    properties go on every message, and `fence`, when given, is asked once more right before the
    bytes are written: what it stops comes back not sent (and `held`, when the sink says so).
    """

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Fence | None = None) -> list[bool]:
        """Send stored records; one bool per record."""
        ...


class CopyCheck(NamedTuple):
    """A `CopyFinder`'s answer, aligned with the records asked about."""

    found: np.ndarray  # bool: a copy is stored on the record's target (not to be sent again)
    unknown: np.ndarray  # bool: no copy seen, and some broker could not say (not to be sent yet)
    answers: np.ndarray | None = None  # where each found copy is stored (`storage.ANSWER_DTYPE` rows)
    errors: list[str | None] | None = None  # why, for each unknown row


class CopyFinder(Protocol):
    """Which records already have a copy on their targets: asked before sending again what a crash,
    a takeover or a failed send left ambiguous (`timewheel._recovery`)."""

    #: how long after a restart or takeover to wait before asking (a predecessor's last writes land)
    quiet_ms: int
    #: how far apart this engine's clock and the targets' may be (widens every window asked about)
    clock_skew_ms: int

    def find_copies(self, records: RecordBytes, sent_from_ms: int, written_before_ms: int) -> CopyCheck:
        """Per record, whether a copy sent at or after `sent_from_ms` (this engine's clock) is stored;
        every copy written before `written_before_ms` must be visible to the answer."""
        ...


class DeadLetterSink(Protocol):
    """Where messages go that failed every attempt or break the contract."""

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        """Park messages with the reason they could not be delivered."""
        ...


class Shaper(Protocol):
    """Traffic shaping: how many due messages of each topic may go now (rates, priorities, backoff)."""

    def grant(self, backlog: Mapping[str, int], now_ms: int) -> dict[str, int]:
        """Given how many are waiting per topic, how many of each may be sent now (tokens taken)."""
        ...

    def next_grant_ms(self, now_ms: int) -> int | None:
        """When more could be granted to the topics that wait (None: as soon as asked)."""
        ...

    def release(self, topic: str, n: int) -> None:
        """Give back `n` granted messages of `topic` that were not taken."""
        ...

    def record(self, topic: str, sent: int, failed: int, held_ms: float, now_ms: int) -> None:
        """Outcome of a send: successes, failures (for backoff), and the total time held back."""
        ...

    def stats(self) -> dict[str, object]:
        """Counters per topic and class: throttled, held time."""
        ...

    def passes_through(self) -> bool:
        """Whether no rule applies now: due messages may go at once, past the held queues, without
        grants (their outcomes are still reported with `record`)."""
        ...


class Source(Protocol):
    """Where new messages come from (the delay topic's consumer): it calls `schedule` per batch
    and acknowledges upstream only once `schedule` returned (the messages are stored)."""

    def start(self, schedule: "ScheduleFn", cancel: "CancelFn | None" = None,
              encoded: "EncodedScheduler | None" = None) -> None:
        """Begin feeding messages to `schedule`, and the cancels it reads to `cancel`; a source that
        encodes records itself may store them through `encoded` instead (the engine)."""
        ...

    def stop(self) -> None:
        """Stop feeding; return once no call to `schedule` is in progress."""
        ...


class EncodedScheduler(Protocol):
    """The engine's way in for a source that encodes records itself (ingest's one pass over a pull
    answer): the messages it could not encode, made rows as `schedule` would store them, and the
    whole batch stored in one commit (`timewheel.Engine` implements it)."""

    def encode_messages(self, messages: Sequence[Message], origins: Sequence[Origin] | None = None
                        ) -> tuple[EncodedRecords, list["InvalidMessageError | None"]]:
        """Rows of the messages the engine takes; per message, its refusal or None."""
        ...

    def schedule_encoded(self, rows: EncodedRecords) -> list[str]:
        """Store the rows as `schedule` stores messages; InvalidMessageError with the first offender's index."""
        ...


#: stores messages, with where each came from on the delay topic (or None), and returns their ids
ScheduleFn = Callable[[Sequence[Message], Sequence[Origin] | None], list[str]]
CancelFn = Callable[[Sequence["CancelRequest"]], int]
"""The engine's `apply_cancels`: keep cancels (durably) and apply them; returns messages cancelled."""
