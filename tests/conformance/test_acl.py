"""A cluster with authentication and authorization on: the engine signs every request; an unsigned
producer is refused (the ACL is really on); a Java producer's 10 KiB bodies under each codec, sent
with credentials, are all delivered."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from forwarder.config import RocketMQConfig
from forwarder.java_client import JavaClient, JavaMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import Credentials
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]

ADMIN = Credentials("tw-admin", "s3cret-key-for-tests")


@pytest.fixture(scope="module")
def secured() -> Iterator[LocalRocketMQ]:
    mq = LocalRocketMQ(stop_timeout=3.0, acl=ADMIN)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


def test_signed_engine_delivers_every_codec_and_unsigned_clients_are_refused(
        secured: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=secured.namesrv_addr, delay_topic=f"TW_DELAY_A{run}",
                         dead_letter_topic=f"TW_DLQ_A{run}", consumer_group=f"tw_ingest_a{run}",
                         producer_group=f"tw_delivery_a{run}", access_key=ADMIN.access_key,
                         secret_key=ADMIN.secret_key)
    target = f"ACL_TARGET_{run}"
    secured.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])

    anonymous = JavaClient(secured.namesrv_addr).produce([JavaMessage(target, b"no credentials")])
    assert [r["ok"] for r in anonymous] == [False], anonymous
    wrong = JavaClient(secured.namesrv_addr, access_key=ADMIN.access_key, secret_key="not-the-secret")
    assert [r["ok"] for r in wrong.produce([JavaMessage(target, b"wrong secret")])] == [False]

    service = Service(Settings(engine=EngineConfig(tmp_path_factory.mktemp("acl"), max_delay_ms=3_600_000),
                               rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0"))).start()
    try:
        java = JavaClient(secured.namesrv_addr, access_key=ADMIN.access_key, secret_key=ADMIN.secret_key)
        sent = []
        for codec in ("zlib", "lz4", "zstd"):
            batch = [JavaMessage(cfg.delay_topic, f"{codec}-{i}-".encode() * 2000, f"tag-{codec}", f"key-{i}",
                                 {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "1000", "codec": codec})
                     for i in range(5)]
            results = java.produce(batch, compress=codec)
            assert all(r["ok"] for r in results), results
            sent += batch
        assert all(len(m.body) >= 10 * 1024 for m in sent)
        got = java.consume(target, len(sent), group=f"acl_reader_{run}", timeout_s=90)
        assert sorted(m.body for m in got) == sorted(m.body for m in sent)
        assert wait_for(lambda: secured.consumer_lag(cfg.consumer_group, cfg.delay_topic) == 0, timeout=30)
        assert service.stats()["ingest"]["dead_lettered_raw"] == 0  # type: ignore[index]
    finally:
        service.stop()

