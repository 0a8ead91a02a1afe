"""Send batches in the making: messages cut per topic within a request's limits, and their header.

A producer cuts what it sends into SEND_BATCH_MESSAGE requests, at most `max_count` messages and
`max_bytes` bytes each, one topic per request; `batch_header` is the SendMessageRequestHeaderV2 of
one (its fields in `producer`'s module docstring). Each message's outcome lands in an `out` list
at its position in what the caller sent.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from forwarder.rocketmq.errors import MessageRejectedError, RemotingError
from forwarder.rocketmq.message import WAIT, Receipt, join_properties
from forwarder.rocketmq.namesrv import TopicRoute
from forwarder.rocketmq.protocol import MESSAGE_ILLEGAL
from forwarder.rocketmq._routes import DEFAULT_TOPIC, DEFAULT_TOPIC_QUEUES

__all__ = ["EncodedBatches", "Outcome", "SendBatch", "batch_header", "cut_encoded", "fail"]

#: what one message came to: its receipt, True (stored, no receipt asked for), its error, or None (not yet)
Outcome = Receipt | RemotingError | bool | None


@dataclass
class SendBatch:
    """One SEND_BATCH_MESSAGE request in the making: its messages' positions, ids and bytes."""

    topic: str
    index: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    parts: list[bytes | memoryview] = field(default_factory=list)  # joined, they are the request's body
    size: int = 0
    queue: tuple[str, int] = ("", -1)


@dataclass
class EncodedBatches:
    """Messages already encoded and cut into batches (one per topic at a time, within the limits),
    for `RemotingProducer.send_batches`: the batches, the rows that could not go with why (and their
    topic), and every row's id."""

    batches: list[SendBatch]
    rejected: list[tuple[int, str, RemotingError]]
    ids: list[str]


def cut_encoded(topics: Sequence[str], encoded: Sequence[bytes | RemotingError], ids: Sequence[str],
                routes: Mapping[str, TopicRoute | RemotingError], out: list[Outcome], *, max_message: int,
                max_count: int, max_bytes: int) -> list[SendBatch]:
    """Cut encoded messages into batches per topic within the count and byte limits; a message of
    a topic without a route, not encodable or too large gets its error in `out`."""
    open_batch: dict[str, SendBatch] = {}
    batches: list[SendBatch] = []
    for i, (topic, data) in enumerate(zip(topics, encoded)):
        route = routes[topic]
        if isinstance(route, RemotingError):
            out[i] = route
            continue
        if isinstance(data, RemotingError):
            out[i] = data
            continue
        size = len(data)
        if size > max_message:
            out[i] = MessageRejectedError(f"message of {size} bytes exceeds the maximum of {max_message}",
                                          code=MESSAGE_ILLEGAL)
            continue
        b = open_batch.get(topic)
        if b is None or len(b.index) >= max_count or b.size + size > max_bytes:
            b = open_batch[topic] = SendBatch(topic)
            batches.append(b)
        b.index.append(i)
        b.ids.append(ids[i])
        b.parts.append(data)
        b.size += size
    return batches


def batch_header(group: str, b: SendBatch, born: str) -> dict[str, str]:
    """SendMessageRequestHeaderV2 of a batch (see the producer's module docstring)."""
    return {
        "a": group,
        "b": b.topic,
        "c": DEFAULT_TOPIC,
        "d": str(DEFAULT_TOPIC_QUEUES),
        "e": str(b.queue[1]),
        "f": "0",
        "g": born,
        "h": "0",
        # The batch's own properties, as the Java client's MessageBatch has them; the broker
        # stores each message with its own properties only.
        "i": join_properties({WAIT: "true"}),
        "j": "0",
        "k": "false",
        "m": "true",
        "n": b.queue[0],
    }


def fail(out: list[Outcome], batches: Iterable[SendBatch], error: RemotingError) -> None:
    """Every message of the batches gets `error`."""
    for b in batches:
        for i in b.index:
            out[i] = error
