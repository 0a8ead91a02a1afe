"""A delay-topic pull thread that an unexpected error ends makes the service not ready (its
supervisor restarts it), instead of the thread being started again by each rebalance to die again
while /readyz said ready; the message it could not read is stored and delivered by the restart."""
from __future__ import annotations

import uuid
from typing import Any

import pytest

from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, Receipt, RemotingProducer
from forwarder.rocketmq._puller import BodyReader
from forwarder.rocketmq.compression import InflateBudget
from timewheel.app.service import Service
from timewheel.app.settings import Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]


def _ingested(service: Service) -> int:
    ingest = service.stats()["ingest"]
    assert isinstance(ingest, dict)
    return int(ingest["ingested"])


def test_a_dead_pull_thread_stops_the_service_and_the_restart_stores_what_it_held(
        rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_D{run}",
                         dead_letter_topic=f"TW_DLQ_D{run}", consumer_group=f"tw_ingest_d{run}",
                         producer_group=f"tw_delivery_d{run}", send_timeout_ms=2000)
    target = f"DIE_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target], queues=2)
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("pulldeath")), rocketmq=cfg)
    service = Service(settings).start()
    try:
        assert wait_for(service.ready, timeout=30)
        puller = service._endpoints.source._puller._puller  # type: ignore[union-attr]

        def broken(body: bytes, limit: int, broker: str, budget: InflateBudget) -> Any:
            raise RuntimeError("a reader that fails in a way nobody imagined")

        puller.reader = BodyReader(broken, puller.reader.wrap)
        with RemotingProducer(rocketmq.namesrv_addr, f"die_producer_{run}") as p:
            [receipt] = p.send([OutgoingMessage(cfg.delay_topic, b"held", None, None,
                                                {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "100"})])
        assert isinstance(receipt, Receipt)
        assert wait_for(lambda: not service.ready(), timeout=30), "a dead pull thread leaves the service ready"
        assert service.dead_threads() == ["ingest-pull-broker-a"]
        assert _ingested(service) == 0
    finally:
        service.stop()
    again = Service(settings).start()
    try:
        assert wait_for(lambda: _ingested(again) == 1, timeout=30), again.stats()["ingest"]
        assert wait_for(lambda: again.stats()["delivered"] == 1, timeout=30), again.stats()
        assert again.ready() and again.dead_threads() == []
    finally:
        again.stop()
