"""RocketMQ's own Java client, compiled against the broker's jars, round-trips through the real broker.

It is the independent producer and consumer of the conformance tests: this checks the harness
itself (every codec, a batch, unicode tags, keys and properties) without timewheel in the path.
"""
from __future__ import annotations

import pytest

from forwarder.java_client import JavaClient, JavaMessage
from forwarder.local_rocketmq import LocalRocketMQ

pytestmark = pytest.mark.rocketmq


def test_java_producer_and_consumer_round_trip_every_codec_and_a_batch(rocketmq: LocalRocketMQ) -> None:
    rocketmq.create_topics(["JAVA_ROUND_TRIP"])
    java = JavaClient(rocketmq.namesrv_addr)
    sent: list[JavaMessage] = []
    for codec in ("zlib", "lz4", "zstd", "none"):
        batch = [JavaMessage("JAVA_ROUND_TRIP", f"{codec}-{i}-".encode() * 1000, f"tag-ü-{codec}", f"k{i} κλειδί",
                             {"codec": codec, "emoji": "⏰"}) for i in range(3)]
        results = java.produce(batch, compress=codec)
        assert [r["ok"] for r in results] == [True] * 3, results
        sent += batch
    small = [JavaMessage("JAVA_ROUND_TRIP", f"batch-{i}".encode(), "b", None, {"n": str(i)}) for i in range(5)]
    [result] = java.produce(small, batch=True)
    assert result["ok"] and result["count"] == 5, result
    sent += small

    got = java.consume("JAVA_ROUND_TRIP", len(sent), group="java-round-trip", timeout_s=60)
    assert sorted(m.body for m in got) == sorted(m.body for m in sent)
    by_body = {m.body: m for m in got}
    for m in sent:
        r = by_body[m.body]
        assert (r.tags, r.keys) == (m.tags, m.keys)
        assert {k: r.props[k] for k in m.props} == dict(m.props)
