"""Conformance with RocketMQ's own Java client: it produces delay messages and consumes deliveries.

Every codec a Java producer can write (bodies of 4 KiB and more are compressed by default), single
and batch sends, bodies from 0 bytes up, unicode tags, keys and properties, and every time
property of the contract: each message arrives once, intact, near its due time, and the engine's
group ends with no lag. A zlib bomb (a small stored body that inflates past `max_body_bytes`) is
dead-lettered raw and holds up nothing behind it. Bodies go up to the engine's limit, so the
largest a Java producer may send is covered too.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from forwarder.config import RocketMQConfig
from forwarder.contract import delay_message_id
from forwarder.java_client import JavaClient, JavaMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import ReceivedMessage, RemotingPullConsumer
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = pytest.mark.rocketmq

CODECS = ("zlib", "lz4", "zstd", "none")


@dataclass
class Pipeline:
    mq: LocalRocketMQ
    cfg: RocketMQConfig
    service: Service
    java: JavaClient
    target: str


@pytest.fixture  # one per test: each run counts its own deliveries and dead letters from the first offset
def pipeline(broker: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    rocketmq = broker
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_J{run}",
                         dead_letter_topic=f"TW_DLQ_J{run}", consumer_group=f"tw_ingest_j{run}",
                         producer_group=f"tw_delivery_j{run}")
    target = f"JAVA_TARGET_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("conformance"), max_delay_ms=3_600_000,
                                            max_body_bytes=1 << 20), rocketmq=cfg,
                        admin=AdminConfig(listen="127.0.0.1:0"))
    service = Service(settings).start()
    try:
        yield Pipeline(rocketmq, cfg, service, JavaClient(rocketmq.namesrv_addr), target)
    finally:
        service.stop()


def _delay_message(p: Pipeline, body: bytes, n: int, tag: str, **time_props: str) -> JavaMessage:
    props = {"TW_TARGET_TOPIC": p.target, "n": str(n), "üñí": "çødé ⏰", **time_props}
    return JavaMessage(p.cfg.delay_topic, body, tag, f"order-{n} ключ", props)


#: bodies from 0 bytes, each side of the Java producer's 4 KiB compression threshold, up to the limit
SIZES = (0, 1, 4095, 4096, 10 * 1024, 200 * 1024, 512 * 1024, (1 << 20) - 4096)


def _consume(p: Pipeline, topic: str, count: int, timeout_s: float) -> list[JavaMessage]:
    """Up to `count` messages of `topic` from its first offset, read by RocketMQ's Java client.

    On a 4.9 broker they are read by the wire client instead: RocketMQ 5's Java lite-pull consumer
    receives nothing from a 4.9 broker (not even what its own producer sent there), and the 4.9
    Java client cannot write LZ4 or ZSTD, so the harness is built on the 5 client only.
    """
    group = f"java_reader_{uuid.uuid4().hex[:6]}"
    if p.mq.version.startswith("5."):
        return p.java.consume(topic, count, group=group, timeout_s=timeout_s)
    got: list[JavaMessage] = []

    def take(batch: list[ReceivedMessage]) -> bool:
        got.extend(JavaMessage(m.topic, m.body, m.tags or None, m.keys or None, dict(m.properties), m.msg_id,
                               int(time.time() * 1000)) for m in batch)
        return True

    reader = RemotingPullConsumer(p.mq.namesrv_addr, group, topic, take)
    reader.start()
    try:
        wait_for(lambda: len(got) >= count, timeout=timeout_s)
        time.sleep(1.0)  # a duplicate would arrive within this
    finally:
        reader.stop()
    return got


def test_a_java_producers_messages_arrive_once_intact_and_on_time(pipeline: Pipeline) -> None:
    p = pipeline
    now = int(time.time() * 1000)
    sent: list[JavaMessage] = []
    n = 0
    time_kinds = [{"TW_DELAY_MS": "1500"}, {"TW_DELIVER_AT_MS": str(now + 2500)},
                  {"__STARTDELIVERTIME": str(now + 2000)}]
    for codec in CODECS:
        batch = []
        for size in SIZES:
            body = (f"{codec}:{n}:".encode() + bytes(range(256)) * (size // 256 + 1))[:max(size, 8)]
            batch.append(_delay_message(p, body, n, f"tag-{codec}-ü", **time_kinds[n % 3]))
            n += 1
        results = p.java.produce(batch, compress=codec)
        assert all(r["ok"] for r in results), results
        sent += batch
    small = [_delay_message(p, f"batch:{i}".encode(), n + i, "batch", TW_DELAY_MS="1000") for i in range(10)]
    [result] = p.java.produce(small, batch=True)
    assert result["ok"] and result["count"] == 10, result
    sent += small
    # A bomb: 4 MiB of zeros, compressed to a few KiB by the Java client, inflates past max_body_bytes (1 MiB).
    bomb = _delay_message(p, b"\0" * (4 << 20), 10_000, "bomb", TW_DELAY_MS="1000")
    [r] = p.java.produce([bomb], compress="zlib", compress_over=0)
    assert r["ok"], r
    after = _delay_message(p, b"after the bomb", 10_001, "after", TW_DELAY_MS="1000")
    assert p.java.produce([after], compress="none")[0]["ok"]
    sent.append(after)

    got = _consume(p, p.target, len(sent), timeout_s=90)
    by_n = {}
    for m in got:
        assert m.props["n"] not in by_n, f"message {m.props['n']} delivered twice"
        by_n[m.props["n"]] = m
    assert sorted(by_n, key=int) == sorted((m.props["n"] for m in sent), key=int)
    for m in sent:
        d = by_n[m.props["n"]]
        assert (d.body, d.tags, d.keys) == (m.body, m.tags, m.keys), f"message {m.props['n']} changed"
        assert {k: d.props[k] for k in m.props if not k.startswith("TW_") and k != "__STARTDELIVERTIME"} == \
            {k: v for k, v in m.props.items() if not k.startswith("TW_") and k != "__STARTDELIVERTIME"}
        due = int(d.props["TW_DUE_MS"])
        assert d.received_ms is not None and d.received_ms >= due  # never early

    dead = _consume(p, p.cfg.dead_letter_topic, 1, timeout_s=30)
    assert len(dead) == 1 and dead[0].tags == "TW_RAW"
    assert "inflates past the limit" in dead[0].props["TW_DEAD_LETTER_REASON"]
    # offsets are committed with the next pull: give it a few of them
    assert wait_for(lambda: p.mq.consumer_lag(p.cfg.consumer_group, p.cfg.delay_topic) == 0, timeout=30), \
        f"the engine's group is behind: {p.service.stats().get('ingest')}"


def test_a_java_batch_of_identical_messages_arrives_whole_under_the_ids_the_producer_was_given(
        pipeline: Pipeline) -> None:
    # The broker appends a batch's own properties (its UNIQ_KEY among them) to each of its messages:
    # read naively, every message of the batch has the batch's id, and identical ones look like one.
    p = pipeline
    same = [JavaMessage(p.cfg.delay_topic, b"the same", "same", None,
                        {"TW_TARGET_TOPIC": p.target, "TW_DELAY_MS": "500"}) for _ in range(6)]
    [result] = p.java.produce(same, batch=True, compress="none")
    assert result["ok"] and result["count"] == 6, result
    given = set(result["msgId"].split(","))
    got = _consume(p, p.target, 6, timeout_s=30)
    assert len(got) == 6, f"{len(got)} of 6 identical batched messages delivered"
    assert {delay_message_id(m.props["TW_ORIGINAL_MSG_ID"]) for m in got} == given


def test_a_java_producers_resend_of_a_delay_message_is_delivered_once(pipeline: Pipeline) -> None:
    # The client's retry of a send (after a timeout the broker may have stored the first) sends the same
    # message again: the same UNIQ_KEY, born again. A TW_DELAY_MS message's due time moves with its born
    # time; it is still the one message its producer sent.
    p = pipeline
    now = int(time.time() * 1000)
    kinds = [{"TW_DELAY_MS": "1500"}, {"TW_DELIVER_AT_MS": str(now + 2500)}, {"__STARTDELIVERTIME": str(now + 2000)}]
    sent = [_delay_message(p, f"resent:{n}".encode(), n, "resent", **kinds[n % 3]) for n in range(6)]
    results = p.java.produce(sent, compress="none", resend_after_ms=300)
    assert len(results) == 12 and all(r["ok"] for r in results), results
    assert [r["msgId"] for r in results[::2]] == [r["msgId"] for r in results[1::2]], "each resend keeps its id"
    got = _consume(p, p.target, 12, timeout_s=30)
    counts = {m.props["n"]: 0 for m in got}
    for m in got:
        counts[m.props["n"]] += 1
    assert counts == {str(n): 1 for n in range(6)}, f"deliveries of each message: {counts}"
