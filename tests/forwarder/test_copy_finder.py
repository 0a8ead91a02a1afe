"""The copy finder against the real local RocketMQ: what the engine's sink stored is found, with
where it is; what it did not send is missing; the brokers' index settings are read and shown."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from forwarder.config import RocketMQConfig
from forwarder.copy_finder import BrokerCopyFinder
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import RemotingProducer
from storage import RecordBytes, ScheduleStore
from timewheel.message import Message, SendResults

pytestmark = pytest.mark.rocketmq


def _now() -> int:
    return int(time.time() * 1000)


def _stored(tmp_path: Path, topic: str, n: int) -> RecordBytes:
    """`n` records for `topic`, due now, as the dispatcher reads them from the store."""
    due = _now()
    store = ScheduleStore(tmp_path / "d")
    try:
        msgs = [Message(topic, f"m{i}".encode(), due + i, keys=(f"k{i}",)) for i in range(n)]
        res = store.append([m.to_record(uuid.uuid4().hex) for m in msgs], _now())
        loc = res.locations
        return store.read_record_bytes(loc["segment_ms"].astype(np.int64), loc["part"].astype(np.int64),
                                       loc["offset"].astype(np.int64), loc["due_ms"].astype(np.int64))
    finally:
        store.close()


def test_what_the_sink_stored_is_found_where_it_is_and_the_rest_is_missing(rocketmq: LocalRocketMQ,
                                                                           tmp_path: Path) -> None:
    topic = f"TW_FINDER_{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic])
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, send_threads=1)
    records = _stored(tmp_path, topic, 40)
    sent_from = _now()
    dead_letters = RemotingProducer(cfg.namesrv, cfg.producer_group)
    sink = RocketMQSink(cfg, dead_letters)
    finder = BrokerCopyFinder(cfg, _now)
    try:
        half = records.select(np.arange(0, 40, 2))
        results = sink.send_records(half)
        assert isinstance(results, SendResults) and all(results) and results.answers is not None
        check = finder.find_copies(records, sent_from, _now())
        assert check.found.tolist() == [i % 2 == 0 for i in range(40)]
        assert not check.unknown.any()
        assert check.answers is not None
        got = check.answers[check.found]
        assert got["queue_offset"].tolist() == results.answers["queue_offset"].tolist()
        assert got["queue_id"].tolist() == results.answers["queue_id"].tolist()
        assert got["commit_offset"].tolist() == results.answers["commit_offset"].tolist()
        assert finder.counters["barriers"] == 1  # one sentinel proved the broker's index
        again = finder.find_copies(records, sent_from, sent_from)  # proven already: no second sentinel
        assert again.found.tolist() == check.found.tolist() and finder.counters["barriers"] == 1
        status = finder.status()
        assert status["warnings"] == []
        brokers = status["brokers"]
        assert isinstance(brokers, dict)
        assert all(s == {"messageIndexEnable": "true", "messageIndexSafe": "true"} for s in brokers.values()), status
    finally:
        finder.close()
        sink.close()
        dead_letters.close()


def test_a_topic_without_a_route_leaves_its_records_unknown_not_missing(rocketmq: LocalRocketMQ,
                                                                         tmp_path: Path) -> None:
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr)
    records = _stored(tmp_path, f"TW_NOWHERE_{uuid.uuid4().hex[:8]}", 3)
    finder = BrokerCopyFinder(cfg, _now)
    try:
        check = finder.find_copies(records, _now() - 1000, _now())
        assert check.unknown.all() and not check.found.any()
        assert check.errors is not None and all("route" in (e or "") for e in check.errors)
    finally:
        finder.close()
