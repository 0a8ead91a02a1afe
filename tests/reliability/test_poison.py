"""Every poison kind a hostile producer can send, through the real broker from RocketMQ's own Java
client, interleaved with good messages: good traffic flows, each poison message is in the
dead-letter topic with its reason, nothing reaches a system topic, the engine's group ends with no
lag and nothing retries forever."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from forwarder.config import RocketMQConfig
from forwarder.java_client import JavaClient, JavaMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import queue_lags
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]

SYSTEM_TARGETS = ["%DLQ%orders-consumers", "%RETRY%orders-consumers", "RMQ_SYS_TRANS_HALF_TOPIC",
                  "SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer"]


@pytest.fixture
def engine(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RocketMQConfig, str,
                                                                                                   Service]]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_P{run}",
                         dead_letter_topic=f"TW_DLQ_P{run}", consumer_group=f"tw_ingest_p{run}",
                         producer_group=f"tw_delivery_p{run}", send_timeout_ms=2000)
    target = f"GOOD_P{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    service = Service(Settings(engine=EngineConfig(tmp_path_factory.mktemp("poison"), max_delay_ms=3_600_000,
                                                   max_body_bytes=256 * 1024, max_attempts=3, retry_base_ms=200,
                                                   retry_max_ms=400), rocketmq=cfg,
                               admin=AdminConfig(listen="127.0.0.1:0"))).start()
    try:
        yield cfg, target, service
    finally:
        service.stop()


def test_poison_of_every_kind_is_parked_and_good_traffic_flows(rocketmq: LocalRocketMQ,
                                                               engine: tuple[RocketMQConfig, str, Service]) -> None:
    cfg, target, service = engine
    java = JavaClient(rocketmq.namesrv_addr)
    t = {"TW_DELAY_MS": "500"}
    poison: list[tuple[str, JavaMessage, str]] = [
        *((f"system target {s}", JavaMessage(cfg.delay_topic, b"p", None, None, {**t, "TW_TARGET_TOPIC": s}),
           "TW_TARGET_TOPIC") for s in SYSTEM_TARGETS),
        ("the engine's own dead-letter topic, reason forged",
         JavaMessage(cfg.delay_topic, b"p", None, None, {**t, "TW_TARGET_TOPIC": cfg.dead_letter_topic,
                                                        "TW_DEAD_LETTER_REASON": "forged"}), "engine's own topics"),
        ("the delay topic itself", JavaMessage(cfg.delay_topic, b"p", None, None,
                                               {**t, "TW_TARGET_TOPIC": cfg.delay_topic}), "engine's own topics"),
        ("a target with a trailing newline", JavaMessage(cfg.delay_topic, b"p", None, None,
                                                         {**t, "TW_TARGET_TOPIC": target + "\n"}), "not a valid topic"),
        ("NUL in tags", JavaMessage(cfg.delay_topic, b"p", "t\u0000g", None, {**t, "TW_TARGET_TOPIC": target}),
         "tags or keys"),
        ("NUL in keys", JavaMessage(cfg.delay_topic, b"p", None, "k\u0000", {**t, "TW_TARGET_TOPIC": target}),
         "tags or keys"),
        ("full-width digits", JavaMessage(cfg.delay_topic, b"p", None, None,
                                          {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "１０００"}), "milliseconds"),
        ("Arabic-Indic digits", JavaMessage(cfg.delay_topic, b"p", None, None,
                                            {"TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": "١٢٣"}), "milliseconds"),
        ("past int64", JavaMessage(cfg.delay_topic, b"p", None, None,
                                   {"TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": "99999999999999999999"}),
         "milliseconds"),
        ("delay past the maximum", JavaMessage(cfg.delay_topic, b"p", None, None,
                                               {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": str(10 ** 12)}),
         "maximum delay"),
    ]
    good = [JavaMessage(cfg.delay_topic, f"good-{i}".encode(), "g", f"k{i}", {**t, "TW_TARGET_TOPIC": target})
            for i in range(len(poison) + 1)]
    interleaved = [m for pair in zip(good, [p for _, p, _ in poison] + [None]) for m in pair if m is not None]
    # the broker's own delay levels write to SCHEDULE_TOPIC_XXXX for other tests: compare, not zero
    def stored(topic: str) -> int:
        return sum(q.max_offset for q in queue_lags(rocketmq.namesrv_addr, "nobody", topic))

    system_before = {topic: stored(topic) for topic in SYSTEM_TARGETS}
    results = java.produce(interleaved, compress="none")
    assert all(r["ok"] for r in results), results
    ids = {m.body + repr(sorted(m.props.items())).encode(): r["msgId"] for m, r in zip(interleaved, results)}
    # a body that inflates past max_body_bytes: parked raw, holding up nothing behind it
    [bomb] = java.produce([JavaMessage(cfg.delay_topic, b"\0" * (2 << 20), None, None,
                                       {**t, "TW_TARGET_TOPIC": target})], compress="zlib", compress_over=0)
    [after] = java.produce([JavaMessage(cfg.delay_topic, b"after-the-bomb", None, None,
                                        {**t, "TW_TARGET_TOPIC": target})], compress="none")
    assert bomb["ok"] and after["ok"]

    delivered = java.consume(target, len(good) + 1, group=f"poison_reader_{uuid.uuid4().hex[:6]}", timeout_s=90)
    assert sorted(m.body for m in delivered) == sorted([m.body for m in good] + [b"after-the-bomb"])
    dead = java.consume(cfg.dead_letter_topic, len(poison) + 1, group=f"poison_dlq_{uuid.uuid4().hex[:6]}",
                        timeout_s=60)
    by_id = {m.props.get("TW_ORIGINAL_MSG_ID", "").split(":")[0]: m for m in dead}
    for case, msg, reason in poison:
        mid = ids[msg.body + repr(sorted(msg.props.items())).encode()]
        assert mid in by_id, f"{case}: not dead-lettered"
        assert reason in by_id[mid].props["TW_DEAD_LETTER_REASON"], (case, by_id[mid].props)
    assert by_id[bomb["msgId"]].tags == "TW_RAW"
    # nothing reached a system topic
    assert {topic: stored(topic) for topic in SYSTEM_TARGETS} == system_before
    assert wait_for(lambda: rocketmq.consumer_lag(cfg.consumer_group, cfg.delay_topic) == 0, timeout=30)
    assert wait_for(lambda: service.stats()["retrying"] == 0, timeout=30)
