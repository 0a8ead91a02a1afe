"""RocketMQ's message trace through the real local RocketMQ: a Java producer with its own trace on
sends a delay message, the engine (with `[rocketmq] trace = true`) stores and delivers it, and
`mqadmin queryMsgTraceById` on the producer's message id shows the three hops in line: the
producer's Pub, the engine's Sub (its consumer group) and the engine's Pub (its producer group)."""
from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from forwarder.config import RocketMQConfig
from forwarder.java_client import JavaClient, JavaMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.trace import CONTENT, FIELD, consume_record, produce_record
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

TOKEN = "s3cret"


def test_records_split_as_rocketmqs_decoder_splits_them() -> None:
    sub = consume_record("tw-ingest", "AC11000100002A9F", "k1 k2", 1_700_000_000_000, 3, "req")
    before, after, tail = sub.split(FIELD)
    assert tail == ""
    assert before.split(CONTENT) == ["SubBefore", "1700000000000", "DefaultRegion", "tw-ingest", "req",
                                     "AC11000100002A9F", "0", "k1 k2"]
    # TraceDataEncoder reads the time stamp and the group of a SubAfter from fields 7 and 8
    assert after.split(CONTENT) == ["SubAfter", "req", "AC11000100002A9F", "3", "true", "k1 k2", "0",
                                    "1700000000000", "tw-ingest"]
    pub = produce_record("tw-delivery", "ORDERS", "AC11000100002A9F", "t", "k1", "127.0.0.1:10911", 12,
                         1_700_000_000_001, 4, "7F00000100002A9F0000000000000E00")
    # 14 fields: the decoder then reads the offset message id (12) and the status (13)
    assert pub.rstrip(FIELD).split(CONTENT) == ["Pub", "1700000000001", "DefaultRegion", "tw-delivery", "ORDERS",
                                                "AC11000100002A9F", "t", "k1", "127.0.0.1:10911", "12", "4", "0",
                                                "7F00000100002A9F0000000000000E00", "true"]


@pytest.fixture(scope="module")
def traced(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}", dead_letter_topic=f"TW_DLQ_{run}",
                         consumer_group=f"tw_ingest_{run}", producer_group=f"tw_delivery_{run}", trace=True,
                         trace_topic=f"TW_TRACE_{run}")
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, cfg.trace_topic, f"ORDERS_{run}"])
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("trace"), max_delay_ms=3_600_000), rocketmq=cfg,
                        admin=AdminConfig(listen="127.0.0.1:0", token=TOKEN))
    service = Service(settings).start()
    yield service, run
    service.stop()


@pytest.mark.rocketmq
def test_query_msg_trace_by_id_shows_the_producers_and_the_engines_hops(rocketmq: LocalRocketMQ,
                                                                         traced: tuple[Service, str]) -> None:
    service, run = traced
    rmq = service.settings.rocketmq
    java = JavaClient(rocketmq.namesrv_addr)
    [sent] = java.produce([JavaMessage(rmq.delay_topic, b"traced", "t", f"order-{run}",
                                       {"TW_TARGET_TOPIC": f"ORDERS_{run}", "TW_DELAY_MS": "500"})],
                          group=f"java_producer_{run}", trace_topic=rmq.trace_topic)
    assert sent["ok"], sent
    assert service.admin is not None

    def state() -> str:
        req = urllib.request.Request(f"http://{service.admin.address}/messages?id={sent['msgId']}",  # type: ignore[union-attr]
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        found = json.loads(urllib.request.urlopen(req, timeout=10).read())["messages"]
        return found[0]["state"] if found else "not stored"

    assert wait_for(lambda: state() == "delivered", 60), state()
    outputs: list[str] = []

    def three_hops() -> bool:
        out = rocketmq.mqadmin("queryMsgTraceById", "-i", sent["msgId"], "-t", rmq.trace_topic)
        outputs.append(out)
        pubs = [line.split() for line in out.splitlines() if line.startswith("Pub ")]
        subs = [line.split() for line in out.splitlines() if line.startswith("Sub ")]
        return ({p[1] for p in pubs} == {f"java_producer_{run}", rmq.producer_group}
                and [s[1] for s in subs] == [rmq.consumer_group] and all(p[-1] == "success" for p in pubs + subs))

    assert wait_for(three_hops, 120, interval=2.0), outputs[-1] if outputs else "no output"
    print(outputs[-1])  # the three hops, for whoever runs this with -s
    assert service.trace is not None and service.trace.counter_values()["failed"] == 0
    assert service.stats()["trace"]["sent"] >= 2  # type: ignore[index]  # its consume and produce records
