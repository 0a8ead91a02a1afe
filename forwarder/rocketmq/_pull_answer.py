"""What a pull answer's body is read into: the `Answer` a `BodyReader` makes (the default: the
answer's `ReceivedMessage`s, as `codec.decode_messages` reads them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from forwarder.rocketmq.codec import decode_messages
from forwarder.rocketmq.compression import InflateBudget
from forwarder.rocketmq.message import ReceivedMessage

__all__ = ["Answer", "BatchCallback", "BodyReader"]

#: accepts a batch (True: stored or dead-lettered, commit it) or refuses it (False: pull it again;
#: raising `BatchesRefusedError`: no retry can succeed, that broker's pull thread stops)
BatchCallback = Callable[[list[ReceivedMessage]], bool]


class Answer(Protocol):
    """A pull answer's messages as a `BodyReader` reads them."""

    def __len__(self) -> int:
        """How many messages."""
        ...

    def unreadable(self) -> list[str]:
        """Why each message that cannot be read cannot."""
        ...

    def last_offset(self) -> int:
        """The queue offset of the last message."""
        ...


@dataclass(frozen=True)
class BodyReader:
    """How pull answers' bodies are read when not into `ReceivedMessage`s (ingest's one pass): the
    callback then gets one `Answer` per pull answer instead of their messages in one list."""

    #: (body, max_body_bytes, broker, the commit's inflate budget) -> its messages; a framing fault
    #: raises MessageDecodeError as `codec.decode_messages` does
    read: Callable[[bytes, int, str, InflateBudget], Answer]
    #: (messages decoded otherwise: what came before a framing fault and its rest, broker) -> an answer
    wrap: Callable[[list[ReceivedMessage], str], Answer]


class _Messages(list[ReceivedMessage]):
    """The messages of one pull answer as `decode_messages` reads them: the default `Answer`."""

    def unreadable(self) -> list[str]:
        return [m.undecodable for m in self if m.undecodable]

    def last_offset(self) -> int:
        return self[-1].queue_offset


_DECODE = BodyReader(lambda body, limit, broker, budget: _Messages(decode_messages(body, limit, broker, budget)),
                     lambda messages, broker: _Messages(messages))
