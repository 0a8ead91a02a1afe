"""The one place that builds the RocketMQ side of a running engine: source, sink, dead letters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from forwarder._rmq_native import LogLevel, NativeProducer
from forwarder.contract import ContractLimits
from forwarder.delivery import RocketMQSink
from forwarder.ingest import DelayTopicIngest
from forwarder.config import RocketMQConfig


@dataclass
class RocketMQEndpoints:
    """The ingest Source and the delivery Sink (also the dead-letter sink) of one engine."""

    source: DelayTopicIngest
    sink: RocketMQSink
    producer: NativeProducer

    def close(self) -> None:
        """Stop the consumer and shut the producer down (after its sends in flight)."""
        self.source.stop()
        self.sink.close()
        self.producer.shutdown()


def connect_rocketmq(cfg: RocketMQConfig, limits: ContractLimits, now_ms: Callable[[], int],
                     *, instance_name: str | None = None) -> RocketMQEndpoints:
    """Start a producer for delivery and dead letters, and build (not start) the ingest consumer."""
    producer = NativeProducer(cfg.producer_group, cfg.namesrv, send_timeout_ms=cfg.send_timeout_ms,
                              instance_name=instance_name, log_level=LogLevel.ERROR)
    producer.start()
    return RocketMQEndpoints(DelayTopicIngest(cfg, limits, now_ms, producer), RocketMQSink(cfg, producer), producer)
