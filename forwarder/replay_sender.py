"""Replay's sending side: schedule-log records re-sent to RocketMQ through the wire producer.

`spark.replay` reads the records and hands each to a sender made by a factory on the executor;
this module is the RocketMQ sender and its factory (picklable, so Spark ships it to executors), so
that spark itself imports nothing of `forwarder`. The sender has the shape of `spark.replay.Sender`.
It reaches a secured cluster as the engine does: ACL signing and TLS from `[rocketmq]`
(`replay_sender_for`). It sends only to topics ingest accepts as targets (`check_target_topic`):
never to RocketMQ's system topics (`%DLQ%...`, `%RETRY%...`, `SCHEDULE_TOPIC_XXXX`, `RMQ_SYS_*`, ...)
nor to the engine's own delay and dead-letter topics.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from forwarder.config import RocketMQConfig
from forwarder.contract import check_target_topic
from forwarder.rocketmq import ClientSecurity, OutgoingMessage, RemotingProducer

__all__ = ["ReplaySender", "replay_sender", "replay_sender_for"]


class ReplaySender:
    """Sends replayed messages one at a time through a RemotingProducer; raises when one is not stored."""

    def __init__(self, namesrv: str, group: str, timeout_ms: int = 3000,
                 security: ClientSecurity | None = None, reserved: frozenset[str] = frozenset()) -> None:
        """A producer of `group` on the NameServer(s) `namesrv` (connects on the first send), signing
        and wrapping its connections as `security` says; `reserved`: the engine's own topics."""
        self._producer = RemotingProducer(namesrv, group, timeout_ms=timeout_ms, security=security)
        self._reserved = reserved

    def send(self, topic: str, body: bytes, tags: str | None, keys: Sequence[str],
             properties: Mapping[str, str]) -> None:
        """Send one message; raises the RemotingError of a send the broker did not store, and
        ContractViolation (a ValueError, not worth a retry) for a topic that is not a delivery target."""
        check_target_topic(topic, self._reserved)
        keys_text = " ".join(keys)  # RocketMQ's key separator
        self._producer.send_batch(topic, [OutgoingMessage(topic, body, tags or None, keys_text or None,
                                                          dict(properties))])

    def close(self) -> None:
        """Close the producer's connections."""
        self._producer.close()


def replay_sender(namesrv: str, group: str, timeout_ms: int = 3000, security: ClientSecurity | None = None,
                  reserved: frozenset[str] = frozenset()) -> Callable[[], ReplaySender]:
    """A picklable factory of replay senders, one per Spark task."""
    return functools.partial(ReplaySender, namesrv, group, timeout_ms, security, reserved)


def replay_sender_for(cfg: RocketMQConfig, group: str) -> Callable[[], ReplaySender]:
    """A picklable factory of replay senders reaching the cluster of `cfg` as the engine does
    (its NameServers, send timeout, ACL credentials and TLS settings), under producer group `group`."""
    return replay_sender(cfg.namesrv, group, cfg.send_timeout_ms, cfg.security(),
                         frozenset({cfg.delay_topic, cfg.dead_letter_topic}))
