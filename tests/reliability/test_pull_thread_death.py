"""A delay-topic pull thread that an unexpected error ends makes the service not ready (its
supervisor restarts it), instead of the thread being started again by each rebalance to die again
while /readyz said ready; the message it could not read is stored and delivered by the restart.
So does an engine that refuses to store every batch for `consume_refused_max_s` (a failing disk):
its batches were pulled again for ever while the service said ready."""
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


def _settings(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory, run: str,
              **rmq: Any) -> tuple[Settings, str]:
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_D{run}",
                         dead_letter_topic=f"TW_DLQ_D{run}", consumer_group=f"tw_ingest_d{run}",
                         producer_group=f"tw_delivery_d{run}", send_timeout_ms=2000, **rmq)
    target = f"DIE_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target], queues=2)
    return Settings(engine=EngineConfig(tmp_path_factory.mktemp("pulldeath")), rocketmq=cfg), target


def _restart_delivers_the_one_message(settings: Settings) -> None:
    again = Service(settings).start()
    try:
        assert wait_for(lambda: _ingested(again) == 1, timeout=30), again.stats()["ingest"]
        assert wait_for(lambda: again.stats()["delivered"] == 1, timeout=30), again.stats()
        assert again.ready() and again.dead_threads() == []
    finally:
        again.stop()


def test_a_dead_pull_thread_stops_the_service_and_the_restart_stores_what_it_held(
        rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = uuid.uuid4().hex[:8]
    settings, target = _settings(rocketmq, tmp_path_factory, run)
    cfg = settings.rocketmq
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
        assert service.endpoint_stats()["serving"] is False  # timewheel_serving 0, for an alert
        assert _ingested(service) == 0
    finally:
        service.stop()
    _restart_delivers_the_one_message(settings)


def test_an_engine_that_refuses_every_batch_stops_not_ready_and_the_restart_stores_it(
        rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = uuid.uuid4().hex[:8]
    settings, target = _settings(rocketmq, tmp_path_factory, run, consume_refused_max_s=3.0)
    cfg = settings.rocketmq
    service = Service(settings).start()
    try:
        assert wait_for(service.ready, timeout=30)
        engine = service.engine
        assert engine is not None

        def failing_disk(*args: Any, **kwargs: Any) -> Any:
            raise OSError(5, "Input/output error")

        engine.schedule_encoded = failing_disk  # type: ignore[method-assign]
        engine.schedule = failing_disk  # type: ignore[method-assign]
        with RemotingProducer(rocketmq.namesrv_addr, f"refuse_producer_{run}") as p:
            [receipt] = p.send([OutgoingMessage(cfg.delay_topic, b"held", None, None,
                                                {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "100"})])
        assert isinstance(receipt, Receipt)
        ingest = service._endpoints.source  # type: ignore[union-attr]
        assert wait_for(lambda: ingest.counters["redelivered"] >= 2, timeout=30), "the batch was not refused again"
        assert service.ready(), "refused for less than consume_refused_max_s: still ready"
        assert wait_for(lambda: not service.ready(), timeout=30), "batches refused for ever leave the service ready"
        assert service.dead_threads() == ["ingest-pull-broker-a"]
        assert [w for w in service.not_ready_why()
                if "thread(s) died: ingest-pull-broker-a (BatchesRefusedError: " in w], service.not_ready_why()
        failures = ingest._puller._puller.failures  # type: ignore[union-attr]
        assert "BatchesRefusedError" in failures["broker-a"] and "refused every batch" in failures["broker-a"]
        assert _ingested(service) == 0
    finally:
        service.stop()
    _restart_delivers_the_one_message(settings)
