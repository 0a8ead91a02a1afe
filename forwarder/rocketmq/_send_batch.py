"""Send batches in the making: messages cut per topic within a request's limits, and their header.

A producer cuts what it sends into SEND_BATCH_MESSAGE requests, at most `max_count` messages and
`max_bytes` bytes each, one topic per request; `batch_header` is the SendMessageRequestHeaderV2 of
one (its fields in `producer`'s module docstring). Each message's outcome lands in an `out` list
at its position in what the caller sent.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from forwarder.rocketmq.answers import answer_rows
from forwarder.rocketmq.errors import (ConnectionFailedError, MessageRejectedError, RemotingError,
                                       TopicNotFoundError)
from forwarder.rocketmq.message import WAIT, Receipt, SendStatus, join_properties
from forwarder.rocketmq.namesrv import TopicRoute
from forwarder.rocketmq.protocol import (FLUSH_DISK_TIMEOUT, FLUSH_SLAVE_TIMEOUT, MESSAGE_ILLEGAL, SLAVE_NOT_AVAILABLE,
                                         SUCCESS, Response, error_for_code)
from forwarder.rocketmq._routes import DEFAULT_TOPIC, DEFAULT_TOPIC_QUEUES

__all__ = ["EncodedBatches", "Outcome", "SendBatch", "batch_header", "cut_encoded", "fail", "settle",
           "stored_or_error"]

#: what one message came to: its receipt, True (stored, no receipt asked for), its error, or None (not yet)
Outcome = Receipt | RemotingError | bool | None
#: Response codes that mean "stored", with the status a send result reports for them.
_STORED = {
    SUCCESS: SendStatus.OK,
    FLUSH_DISK_TIMEOUT: SendStatus.FLUSH_DISK_TIMEOUT,
    FLUSH_SLAVE_TIMEOUT: SendStatus.FLUSH_SLAVE_TIMEOUT,
    SLAVE_NOT_AVAILABLE: SendStatus.SLAVE_NOT_AVAILABLE,
}


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


def settle(addr: str, batches: Sequence[SendBatch], replies: Sequence[Response | RemotingError], out: list[Outcome],
           receipts: bool, answers: np.ndarray | None, broker_failed: Callable[[str, str], None],
           mark_stale: Callable[[str], None]) -> None:
    """Turn each batch's reply (from the broker at `addr`) into per-message receipts (or True,
    without `receipts`, and rows of `answers` when given) or errors; `broker_failed(broker, topic)`
    when the broker could not be reached, `mark_stale(topic)` when it refused the topic."""
    for b, answer in zip(batches, replies):
        if isinstance(answer, RemotingError):
            if isinstance(answer, ConnectionFailedError):
                broker_failed(b.queue[0], b.topic)
            fail(out, [b], answer)
            continue
        status = _STORED.get(answer.code)
        if status is None:
            err = error_for_code(answer.code, answer.remark, f"broker {b.queue[0]} ({addr}) for {b.topic}")
            if err.retriable or isinstance(err, TopicNotFoundError):
                mark_stale(b.topic)
            fail(out, [b], err)
            continue
        try:
            queue_id = int(answer.ext.get("queueId", b.queue[1]))
            first = int(answer.ext.get("queueOffset", -1))
        except ValueError:
            queue_id, first = b.queue[1], -1
        offset_ids = answer.ext.get("msgId", "")
        if not receipts:
            for i in b.index:
                out[i] = True
            if answers is not None:
                answer_rows(answers, b.index, queue_id, first, offset_ids)
            continue
        split = offset_ids.split(",") if offset_ids else []
        for k, (i, msg_id) in enumerate(zip(b.index, b.ids)):
            out[i] = Receipt(msg_id, b.topic, b.queue[0], queue_id, first + k if first >= 0 else -1, status,
                             split[k] if len(split) == len(b.index) else "")


def stored_or_error(out: list[Outcome]) -> list[RemotingError | None]:
    """Per message, None once stored or its error (one never answered: not sent)."""
    if out.count(True) == len(out):  # the usual answer, without a test per message
        return [None] * len(out)
    return [None if r is True else r if isinstance(r, RemotingError) else ConnectionFailedError("not sent")
            for r in out]
