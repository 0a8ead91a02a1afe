"""A backfilled data set is delivered by a running engine, through its real RocketMQ delivery sink
and the real local RocketMQ, to a consumer of the target topics: every row arrives once, with
body, tags, keys and properties intact, never before it is due."""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, RemotingProducer
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import LocalRocketMQ
from spark.backfill import backfill, read_input
from tests.forwarder.test_end_to_end import Inbox
from tests.polling import wait_for
from timewheel import Engine
from forwarder.config import RocketMQConfig
from timewheel.config import EngineConfig

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.rocketmq]
ROWS = 300


def test_backfilled_rows_arrive_once_through_rocketmq(spark: SparkSession, rocketmq: LocalRocketMQ,
                                                      tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, dead_letter_topic=f"TW_DLQ_{run}",
                         producer_group=f"tw_delivery_{run}", send_timeout_ms=3000)
    targets = (f"BACKFILL_A_{run}", f"BACKFILL_B_{run}")
    rocketmq.create_topics([cfg.dead_letter_topic, *targets])
    inbox = Inbox()
    consumer = NativePushConsumer(f"tw_backfill_consumer_{run}", rocketmq.namesrv_addr, inbox)
    for t in targets:
        consumer.subscribe(t)
    consumer.start()
    producer = NativeProducer(f"tw_backfill_probe_{run}", rocketmq.namesrv_addr)
    producer.start()
    data = tmp_path / "data"
    dead_letters = RemotingProducer(cfg.namesrv, cfg.producer_group)
    sink = RocketMQSink(cfg, dead_letters)
    # the engine is all that runs: backfilled parts reach it through its rescan of the data directory
    engine = Engine(EngineConfig(data, rescan_seconds=0.5), sink).start()
    try:
        for t in targets:  # the consumer is rebalanced onto both topics once a probe on each arrives
            producer.send(OutgoingMessage(t, b"probe", None, None, {}))
        assert wait_for(lambda: all(any(m.body == b"probe" for m, _ in inbox.on(t)) for t in targets), 90), \
            "consumer never came up"

        now = time.time_ns() // 1_000_000
        rows = [{"msg_id": f"bf-{run}-{i}", "topic": targets[i % 2], "body": b"\x00\xffbin-" + str(i).encode(),
                 "deliver_at_ms": now + 5_000 + i * 10, "tags": f"tag{i % 3}", "keys": [f"k{i}", f"order-{i}"],
                 "properties": [("customer", "Zoë"), ("n", str(i))]} for i in range(ROWS)]
        src = tmp_path / "input.parquet"
        pq.write_table(pa.Table.from_pylist(rows, pa.schema([
            ("msg_id", pa.string()), ("topic", pa.string()), ("body", pa.binary()), ("deliver_at_ms", pa.int64()),
            ("tags", pa.string()), ("keys", pa.list_(pa.string())), ("properties", pa.map_(pa.string(), pa.string())),
        ])), src)
        res = backfill(spark, data, read_input(spark, [str(src)]), now_ms=now)
        assert (res.scheduled, res.rejected) == (ROWS, 0)

        def arrived() -> list:
            return [(m, t) for m, t in inbox.on(targets[0]) + inbox.on(targets[1]) if m.body != b"probe"]

        assert wait_for(lambda: len(arrived()) >= ROWS, 120), f"{len(arrived())} of {ROWS} arrived"
        time.sleep(1.5)  # anything delivered twice would show up now
        got = arrived()
    finally:
        engine.stop()
        sink.close()
        dead_letters.close()
        producer.shutdown()
        consumer.shutdown()
    by_id = {m.properties["TW_ORIGINAL_MSG_ID"]: (m, at) for m, at in got}
    assert len(got) == len(by_id) == ROWS, "each row exactly once"
    for i, row in enumerate(rows):
        m, received_ms = by_id[row["msg_id"]]
        assert (m.topic, m.body, m.tags, m.keys) == (row["topic"], row["body"], f"tag{i % 3}", f"k{i} order-{i}")
        assert (m.properties["customer"], m.properties["n"]) == ("Zoë", str(i))
        assert int(m.properties["TW_DUE_MS"]) == row["deliver_at_ms"] <= received_ms, "never delivered early"
