"""The one place that builds the RocketMQ side of a running engine: source, sink, dead letters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits
from forwarder.control import CancelSent, send_cancel
from forwarder.delivery import RocketMQSink
from forwarder.ingest import DelayTopicIngest
from forwarder.rocketmq import RemotingProducer


@dataclass
class RocketMQEndpoints:
    """The ingest Source and the delivery Sink of one engine, and the producer of their dead letters."""

    source: DelayTopicIngest
    sink: RocketMQSink
    dead_letters: RemotingProducer

    def send_cancel(self, msg_id: str | None, key: str | None) -> CancelSent:
        """Put a cancel on every queue of the delay topic (`forwarder.control.send_cancel`)."""
        return send_cancel(self.dead_letters, self.source.cfg.delay_topic, msg_id, key)

    def close(self) -> None:
        """Stop the consumer, then close the senders' connections."""
        self.source.stop()
        self.sink.close()
        self.dead_letters.close()


def connect_rocketmq(cfg: RocketMQConfig, limits: ContractLimits, now_ms: Callable[[], int], *,
                     queue_ids: Callable[[int], bool] | None = None) -> RocketMQEndpoints:
    """Build the delivery sink and (not started) the ingest consumer; nothing connects before first use.
    `queue_ids`: the ingest reads only the delay topic's queues whose id it accepts (a replica's shard)."""
    dead_letters = RemotingProducer(cfg.namesrv, cfg.producer_group, timeout_ms=cfg.send_timeout_ms,
                                    security=cfg.security())
    return RocketMQEndpoints(DelayTopicIngest(cfg, limits, now_ms, dead_letters, queue_ids=queue_ids),
                             RocketMQSink(cfg, dead_letters), dead_letters)
