"""Ingest lag per queue of the delay topic: what the broker holds that the engine has not taken.

Lag is RocketMQ's own measure (its admin tool's consumerProgress "diff"): the queue's max offset
minus the consumer group's committed offset, asked from each broker master by the wire client.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from forwarder.config import RocketMQConfig
from forwarder.rocketmq import QueueLag, RemotingError, queue_lags
from timewheel.errors import TimewheelError

__all__ = ["IngestLagError", "QueueLag", "ingest_lag", "lag_dict"]


class IngestLagError(TimewheelError):
    """The brokers could not be asked; the message says which and why."""


def ingest_lag(cfg: RocketMQConfig, timeout_s: float = 3.0) -> list[QueueLag]:
    """The lag of every readable queue of the delay topic for the engine's consumer group."""
    try:
        return queue_lags(cfg.namesrv, cfg.consumer_group, cfg.delay_topic, timeout_s, cfg.security())
    except RemotingError as e:
        raise IngestLagError(f"cannot ask the brokers of {cfg.delay_topic} (NameServer {cfg.namesrv}) for the "
                             f"offsets of {cfg.consumer_group}: {e}") from e


def lag_dict(q: QueueLag) -> dict[str, Any]:
    """Plain dict for JSON."""
    return asdict(q)
