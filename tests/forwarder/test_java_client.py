"""RocketMQ's own Java client, compiled against the broker's jars, round-trips through the real broker.

It is the independent producer and consumer of the conformance tests: this checks the harness
itself (every codec, a batch, unicode tags, keys and properties) without timewheel in the path,
and that its source compiles against the jars of each RocketMQ version the conformance suite runs.
"""
from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from forwarder._local_distribution import LEGACY_ROCKETMQ_VERSION, ROCKETMQ_VERSION
from forwarder.java_client import JavaClient, JavaMessage, _compile
from forwarder.local_rocketmq import LocalRocketMQ, ensure_distribution
from forwarder.rocketmq.acl import Credentials, sign

pytestmark = pytest.mark.rocketmq


# 4.9 as the conformance suite has it: in the slow suite, which is the one that fetches its jars
@pytest.mark.parametrize("version", [
    pytest.param(ROCKETMQ_VERSION, id=ROCKETMQ_VERSION),
    pytest.param(LEGACY_ROCKETMQ_VERSION, id=LEGACY_ROCKETMQ_VERSION, marks=pytest.mark.slow)])
def test_harness_compiles_against_the_jars_of_each_broker_version(version: str, tmp_path: Path) -> None:
    # a fresh cache root, so that javac runs on the source instead of a cached compile being reused
    classes = _compile(ensure_distribution(version=version), tmp_path, version)
    assert (classes / "JavaClient.class").is_file()


@pytest.mark.parametrize("version", [
    pytest.param(ROCKETMQ_VERSION, id=ROCKETMQ_VERSION),
    pytest.param(LEGACY_ROCKETMQ_VERSION, id=LEGACY_ROCKETMQ_VERSION, marks=pytest.mark.slow)])
def test_harness_runs_quietly_on_each_version_and_signs_as_the_engine_does(version: str) -> None:
    """Each version's client signs a request as RocketMQ's ACL hook does, and as the engine's own wire
    client does, with nothing on stderr (each major version's logback is told its own quiet listener)."""
    java = JavaClient("127.0.0.1:1", version=version)  # `sign` never reaches the NameServer
    request = json.dumps({"fields": {"topic": "T", "queueId": "3"}, "body": base64.b64encode(b"body").decode(),
                          "ak": "access", "sk": "secret"})
    proc = subprocess.run(java._command(["sign"]), input=request + "\n", capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    [signed] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # the signature the engine's own wire client computes (`forwarder.rocketmq.acl`), whichever version signed
    assert signed == sign({"topic": "T", "queueId": "3"}, b"body", Credentials("access", "secret"))
    assert signed["AccessKey"] == "access" and signed["Signature"]


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


def test_lateness_consumer_counts_each_wanted_message_once_and_reports_numpy_quantiles(
        rocketmq: LocalRocketMQ) -> None:
    rocketmq.create_topics(["JAVA_LATENESS"])
    java = JavaClient(rocketmq.namesrv_addr)
    ids = range(100, 120)
    step = 1_000_000.0  # far wider than any hop: the k-th latest message is the k-th due
    t0 = time.time_ns() / 1e6
    wanted = [JavaMessage("JAVA_LATENESS", b"x", None, None,
                          {"BENCH_ID": str(i), "BENCH_DUE_MS": f"{t0 - (i - 100) * step:.3f}"}) for i in ids]
    stray = [JavaMessage("JAVA_LATENESS", b"outside", None, None, {"BENCH_ID": "5", "BENCH_DUE_MS": f"{t0:.3f}"}),
             JavaMessage("JAVA_LATENESS", b"no properties"), wanted[0]]
    with java.lateness("JAVA_LATENESS", (100, 120), group="java-lateness", wait_s=60) as consumer:
        assert consumer.ready["queues"] >= 1
        [result] = java.produce([*wanted, *stray], batch=True)
        assert result["ok"], result
        consumer.expect(len(wanted))
        got = consumer.result(120)
    elapsed = time.time_ns() / 1e6 - t0
    assert (got["received"], got["expected"], got["complete"]) == (20, 20, True)
    assert (got["duplicates"], got["other"]) == (1, 2)
    q = np.asarray(got["quantiles_ms"])
    # each lateness is (i - 100) * step plus its hop, which lies in [0, elapsed]: numpy's interpolation of
    # the steps alone must sit below each quantile by no more than the hop
    off = q - np.percentile(np.arange(20) * step, np.linspace(0, 100, 1001))
    assert len(q) == 1001 and np.all(np.diff(q) >= 0)
    assert off.min() >= -0.01 and off.max() <= elapsed + 0.01
    assert sum(row[0] for row in got["by_second"]) == 20


def test_noop_consumer_reads_a_backlog_from_the_first_offset(rocketmq: LocalRocketMQ) -> None:
    rocketmq.create_topics(["JAVA_NOOP"])
    java = JavaClient(rocketmq.namesrv_addr)
    [result] = java.produce([JavaMessage("JAVA_NOOP", f"m{i}".encode()) for i in range(200)], batch=True)
    assert result["ok"], result
    got = java.noop("JAVA_NOOP", 200, group="java-noop", timeout_s=60)
    assert got["received"] == 200 and got["rate"] >= 0 and got["wall_seconds"] >= got["seconds"]


def test_paced_stream_after_its_warm_up_is_what_the_lateness_consumer_measures(rocketmq: LocalRocketMQ) -> None:
    rocketmq.create_topics(["JAVA_PACED"])
    java = JavaClient(rocketmq.namesrv_addr)
    with java.lateness("JAVA_PACED", (1200, 1400), group="java-paced", wait_s=60) as consumer:
        sent = java.pace("JAVA_PACED", rate=200, seconds=1, id_start=1000, warm_up_s=1)
        assert (sent["sent"], sent["warm_up_sent"], sent["failed"]) == (200, 200, 0)
        consumer.expect(int(sent["sent"]))
        got = consumer.result(120)
    assert (got["received"], got["complete"], got["duplicates"], got["other"]) == (200, True, 0, 200)
    assert 0 < got["quantiles_ms"][500] < 60_000  # a plain hop: receive time after send time
