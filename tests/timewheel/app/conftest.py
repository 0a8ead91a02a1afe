"""A running engine for the app's tests: an in-process Service on the session's real RocketMQ."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from forwarder._rmq_native import NativeProducer, OutgoingMessage
from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from tests.polling import wait_for
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig


@dataclass
class Running:
    """A started Service, its admin address, and a producer on its delay topic."""

    service: Service
    admin: str
    cfg: RocketMQConfig
    producer: NativeProducer
    target: str

    def send(self, props: dict[str, str], body: bytes = b"x", keys: str | None = None) -> str:
        """Send one message to the delay topic; its id."""
        return self.producer.send(OutgoingMessage(self.cfg.delay_topic, body, None, keys, props)).msg_id


def _delivered(service: Service) -> int:
    """The engine's delivered counter."""
    n = service.stats().get("delivered", 0)
    assert isinstance(n, int)
    return n


@pytest.fixture(scope="module")
def running(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """An engine serving its own delay topic, with one probe already delivered end to end."""
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}",
                         dead_letter_topic=f"TW_DLQ_{run}", consumer_group=f"tw_ingest_{run}",
                         producer_group=f"tw_delivery_{run}")
    target = f"ORDERS_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    # the next segment loads 59 minutes ahead, so a message due within minutes is in a loaded segment
    # (and counted as pending) whatever the time of day the test runs
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("app"), max_delay_ms=3 * 3_600_000,
                                            preload_seconds=3540),
                        rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0"))
    service = Service(settings).start()
    producer = NativeProducer(f"tw_app_producer_{run}", rocketmq.namesrv_addr)
    producer.start()
    assert service.admin is not None
    r = Running(service, service.admin.address, cfg, producer, target)
    try:
        r.send({"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "0"})
        assert wait_for(lambda: _delivered(service) >= 1, 90), "the probe was never delivered"
        yield r
    finally:
        producer.shutdown()
        service.stop()
