"""A serving engine whose host clock is an hour ahead of the broker's holds what it would send early."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from forwarder._rmq_native import NativeProducer, OutgoingMessage
from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from tests.forwarder.target_reader import TargetReader
from tests.polling import wait_for
from timewheel.app.metrics import EngineCollector
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.clock import SystemClock
from timewheel.config import EngineConfig

HOUR_MS = 3_600_000


def test_an_engine_an_hour_ahead_delivers_nothing_due_in_ten_minutes_and_says_why(
        rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}", dead_letter_topic=f"TW_DLQ_{run}",
                         consumer_group=f"tw_ingest_{run}", producer_group=f"tw_delivery_{run}")
    target = f"ORDERS_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    settings = Settings(engine=EngineConfig(tmp_path / "data", max_delay_ms=3 * HOUR_MS),
                        rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0"))
    service = Service(settings, SystemClock(HOUR_MS)).start()
    producer = NativeProducer(f"tw_producer_{run}", rocketmq.namesrv_addr)
    producer.start()
    try:
        with TargetReader(rocketmq.namesrv_addr, f"tw_reader_{run}", target) as reader:
            # due ten minutes after the broker stored it: fifty minutes in the past by this host's clock
            producer.send(OutgoingMessage(cfg.delay_topic, b"early?", None, None,
                                          {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": str(10 * 60_000)}))
            assert wait_for(lambda: service.stats().get("scheduled") == 1, 30), "the message was never stored"
            guard = service.clock_guard
            assert guard is not None
            # the dispatcher has tried to send it, and the guard held it back
            assert wait_for(lambda: guard.counters["held"] >= 1, 30), "the engine never tried to send it"
            assert not wait_for(lambda: bool(reader.messages()), 3.0), "delivered fifty minutes early"
            assert service.stats().get("delivered") == 0
            why = " ".join(service.not_ready_why())
            assert "clock" in why and "ahead" in why and "NTP" in why, why
            status = service.status()["broker_clock"]
            assert HOUR_MS - 60_000 < status["offset_ms"] < HOUR_MS + 60_000, status
            assert service.engine is not None
            engine = service.engine
            gauges = {s.name: s.value for m in EngineCollector(engine.stats, lambda: engine.lateness_buckets,
                                                               service.endpoint_stats).collect() for s in m.samples}
            assert gauges["timewheel_broker_clock_offset_ms"] == status["offset_ms"]
    finally:
        producer.shutdown()
        service.stop()
