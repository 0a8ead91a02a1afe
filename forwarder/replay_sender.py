"""Replay's sending side: schedule-log records re-sent to RocketMQ through the wire producer.

`spark.replay` reads the records and hands each to a sender made by a factory on the executor;
this module is the RocketMQ sender and its factory (picklable, so Spark ships it to executors), so
that spark itself imports nothing of `forwarder`. The sender has the shape of `spark.replay.Sender`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from forwarder.rocketmq import OutgoingMessage, RemotingProducer

__all__ = ["ReplaySender", "replay_sender"]


class ReplaySender:
    """Sends replayed messages one at a time through a RemotingProducer; raises when one is not stored."""

    def __init__(self, namesrv: str, group: str, timeout_ms: int = 3000) -> None:
        """A producer of `group` on the NameServer(s) `namesrv` (connects on the first send)."""
        self._producer = RemotingProducer(namesrv, group, timeout_ms=timeout_ms)

    def send(self, topic: str, body: bytes, tags: str | None, keys: Sequence[str],
             properties: Mapping[str, str]) -> None:
        """Send one message; raises the RemotingError of a send the broker did not store."""
        keys_text = " ".join(keys)  # RocketMQ's key separator
        self._producer.send_batch(topic, [OutgoingMessage(topic, body, tags or None, keys_text or None,
                                                          dict(properties))])

    def close(self) -> None:
        """Close the producer's connections."""
        self._producer.close()


def replay_sender(namesrv: str, group: str, timeout_ms: int = 3000) -> Callable[[], ReplaySender]:
    """A picklable factory of replay senders, one per Spark task."""
    return functools.partial(ReplaySender, namesrv, group, timeout_ms)
