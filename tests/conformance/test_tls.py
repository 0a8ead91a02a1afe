"""A TLS-only cluster (`tls.server.mode=enforcing` on NameServer and broker, a self-signed certificate):
plain connections are refused, so TLS is really on; the engine with `[rocketmq] tls = true` consumes
the delay topic and delivers over TLS; in the slow suite, RocketMQ's Java client produces every codec
over TLS and reads the deliveries back over TLS."""
from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest

from forwarder.config import RocketMQConfig
from forwarder.java_client import JavaClient, JavaMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.replay_sender import replay_sender_for
from forwarder.rocketmq import (ClientSecurity, ConnectionFailedError, OutgoingMessage, ReceivedMessage,
                                RemotingError, RemotingProducer, RemotingPullConsumer)
from forwarder.rocketmq.connection import call
from forwarder.rocketmq.protocol import GET_BROKER_CLUSTER_INFO, GET_MIN_OFFSET, SUCCESS
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = pytest.mark.rocketmq

@pytest.fixture(scope="module")
def tls_only() -> Iterator[LocalRocketMQ]:
    mq = LocalRocketMQ(stop_timeout=3.0, tls=True)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


@pytest.fixture(scope="module")
def trusted_tls(tls_only: LocalRocketMQ) -> ClientSecurity:
    """TLS trusting the certificate the launcher made (and nothing else)."""
    return ClientSecurity(tls=True, ca_file=str(tls_only.tls_ca_file))


@pytest.fixture
def engine(tls_only: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RocketMQConfig, str]]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=tls_only.namesrv_addr, delay_topic=f"TW_DELAY_T{run}",
                         dead_letter_topic=f"TW_DLQ_T{run}", consumer_group=f"tw_ingest_t{run}",
                         producer_group=f"tw_delivery_t{run}", tls=True, tls_ca_file=str(tls_only.tls_ca_file))
    target = f"TLS_TARGET_{run}"
    tls_only.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    service = Service(Settings(engine=EngineConfig(tmp_path_factory.mktemp("tls"), max_delay_ms=3_600_000),
                               rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0"))).start()
    try:
        yield cfg, target
    finally:
        service.stop()


def test_plain_connections_are_refused_and_tls_ones_answered(tls_only: LocalRocketMQ,
                                                             trusted_tls: ClientSecurity) -> None:
    asks = [(tls_only.namesrv_addr, GET_BROKER_CLUSTER_INFO, {}),
            (tls_only.broker_addr, GET_MIN_OFFSET, {"topic": "TBW102", "queueId": "0"})]
    for addr, code, ext in asks:
        with pytest.raises(ConnectionFailedError):
            call(addr, code, ext, b"", 5.0)
        # checked against the certificate the launcher made, the broker is trusted
        assert call(addr, code, ext, b"", 5.0, trusted_tls).code == SUCCESS
        # by default, against the system's CAs: an unknown certificate is refused
        with pytest.raises(ConnectionFailedError, match="CERTIFICATE_VERIFY_FAILED"):
            call(addr, code, ext, b"", 5.0, ClientSecurity(tls=True))
        # and so is it through the engine's own config without a CA file
        default = RocketMQConfig(namesrv=tls_only.namesrv_addr, tls=True).security()
        with pytest.raises(ConnectionFailedError, match="CERTIFICATE_VERIFY_FAILED"):
            call(addr, code, ext, b"", 5.0, default)
        # only when asked for by name are certificates not checked
        insecure = RocketMQConfig(namesrv=tls_only.namesrv_addr, tls=True, tls_insecure=True).security()
        assert call(addr, code, ext, b"", 5.0, insecure).code == SUCCESS


def test_the_engine_consumes_and_delivers_over_tls(tls_only: LocalRocketMQ, engine: tuple[RocketMQConfig, str],
                                                   trusted_tls: ClientSecurity) -> None:
    cfg, target = engine
    producer = RemotingProducer(cfg.namesrv, f"tls_producer_{uuid.uuid4().hex[:6]}", security=trusted_tls)
    try:
        sent = [OutgoingMessage(cfg.delay_topic, f"over tls {i}".encode() * (1 + i * 100), "tls", f"k{i}",
                                {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "800"}) for i in range(20)]
        producer.send_batch(cfg.delay_topic, sent)
    finally:
        producer.close()
    got: list[ReceivedMessage] = []

    def take(batch: list[ReceivedMessage]) -> bool:
        got.extend(batch)
        return True

    reader = RemotingPullConsumer(cfg.namesrv, f"tls_reader_{uuid.uuid4().hex[:6]}", target, take,
                                  security=trusted_tls)
    reader.start()
    try:
        assert wait_for(lambda: len(got) >= len(sent), timeout=60), f"{len(got)} of {len(sent)} delivered"
    finally:
        reader.stop()
    assert sorted(m.body for m in got) == sorted(m.body for m in sent)
    assert wait_for(lambda: tls_only.consumer_lag(cfg.consumer_group, cfg.delay_topic) == 0, timeout=30)


@pytest.mark.slow
def test_java_clients_every_codec_over_tls(tls_only: LocalRocketMQ, engine: tuple[RocketMQConfig, str]) -> None:
    cfg, target = engine
    plain = JavaClient(tls_only.namesrv_addr).produce([JavaMessage(target, b"no tls")])
    assert [r["ok"] for r in plain] == [False], plain  # RocketMQ's own client is refused without TLS too
    java = JavaClient(tls_only.namesrv_addr, tls=True)
    sent = []
    for codec in ("zlib", "lz4", "zstd", "none"):
        batch = [JavaMessage(cfg.delay_topic, f"{codec}-{i}-ü-".encode() * 1500, f"tag-{codec}", f"key-{i}",
                             {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "1000", "codec": codec}) for i in range(5)]
        results = java.produce(batch, compress=codec)
        assert all(r["ok"] for r in results), results
        sent += batch
    got = java.consume(target, len(sent), group=f"tls_java_reader_{uuid.uuid4().hex[:6]}", timeout_s=90)
    assert sorted(m.body for m in got) == sorted(m.body for m in sent)
    assert all(m.props["codec"] == m.body.split(b"-")[0].decode() for m in got)


def test_replay_sends_over_tls_from_the_engines_config(tls_only: LocalRocketMQ,
                                                       engine: tuple[RocketMQConfig, str], trusted_tls: ClientSecurity) -> None:
    """Replay's sender takes TLS (and ACL) from `[rocketmq]` as the engine does; Spark ships its factory
    pickled to the executors."""
    cfg, target = engine
    factory = pickle.loads(pickle.dumps(replay_sender_for(cfg, f"tls_replay_{uuid.uuid4().hex[:6]}")))
    sender = factory()
    try:
        sender.send(target, b"replayed over tls", "r", ["k1"], {"TW_REPLAY": "1"})
    finally:
        sender.close()
    plain = replay_sender_for(replace(cfg, tls=False, tls_ca_file=""), "tls_replay_plain")()
    try:
        with pytest.raises(RemotingError):
            plain.send(target, b"not over tls", None, [], {})
    finally:
        plain.close()
    got: list[ReceivedMessage] = []

    def take(batch: list[ReceivedMessage]) -> bool:
        got.extend(batch)
        return True

    reader = RemotingPullConsumer(cfg.namesrv, f"tls_replay_reader_{uuid.uuid4().hex[:6]}", target, take,
                                  security=trusted_tls)
    reader.start()
    try:
        assert wait_for(lambda: any(m.body == b"replayed over tls" for m in got), timeout=30)
    finally:
        reader.stop()
