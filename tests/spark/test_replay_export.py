"""Replay (dry and real, with a recording sender) and export round trips."""
from __future__ import annotations

import base64
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import typer
from pyspark import cloudpickle
from typer.testing import CliRunner

from spark.audit import run_audit
from spark.backfill import backfill
from spark.export import export
from spark.replay import ORIGINAL_ID_PROPERTY, REPLAY_PROPERTY, replay
from storage import DELIVERED, REPLAYED, Record, SegmentLayout, read_dispatch_log
from forwarder.local_rocketmq import LocalRocketMQ
from tests.spark.conftest import HOUR, T0, MakeStore, deliver, records
from tests.spark.test_audit import _corrupt
from tests.spark.test_backfill import _stored

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors need RecordingSender by value


class RecordingSender:
    """Writes each message it is given to a JSON-lines file instead of a broker."""

    def __init__(self, out_dir: str) -> None:
        self.path = Path(out_dir) / f"sent-{os.getpid()}-{id(self)}.jsonl"
        self.f = open(self.path, "a")

    def send(self, topic: str, body: bytes, tags: str | None, keys: Sequence[str],
             properties: Mapping[str, str]) -> None:  # the Sender protocol
        self.f.write(json.dumps({"topic": topic, "body": base64.b64encode(body).decode(), "tags": tags,
                                 "keys": list(keys), "properties": dict(properties)}) + "\n")

    def close(self) -> None:
        self.f.close()


def _store(make_store: MakeStore) -> Path:
    s = make_store()
    s.append(records(6, prefix="a", step=10 * 60_000, tags="t", keys=("k1", "k2"), properties={"p": "v"})
             + records(3, prefix="b", start=T0 + 5_000, step=10 * 60_000, topic="PAYMENTS")
             + [Record("bin", "ORDERS", b"\x00\x01nul\x00", T0 + HOUR + 1, 0, "", (), {})], T0 - 1000)
    deliver(s, T0, slice(0, 9), DELIVERED, T0 + HOUR)
    s.checkpoint()
    return s.layout.root


def test_dry_run_sends_nothing(spark: SparkSession, make_store: MakeStore, tmp_path: Path) -> None:
    from timewheel.app.cli_spark import register

    data = _store(make_store)
    before = {p: p.read_bytes() for p in (data / "schedule").rglob("*")if p.is_file()}
    broker = socket.socket()
    broker.bind(("127.0.0.1", 0))
    broker.listen(8)
    broker.setblocking(False)
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    res = CliRunner().invoke(app, ["replay", "--data-dir", str(data), "--since", "2027-01-15T08:00:00Z",
                                   "--until", str(T0 + 30 * 60_000), "--topic", "ORDERS", "--dry-run",
                                   "--namesrv", f"127.0.0.1:{broker.getsockname()[1]}"])
    assert res.exit_code == 0, res.output
    assert "would send 3 messages" in res.output and "a0" in res.output and "b0" not in res.output
    with pytest.raises(BlockingIOError):
        broker.accept()  # nobody connected
    broker.close()
    after = {p: p.read_bytes() for p in (data / "schedule").rglob("*") if p.is_file()}
    assert after == before
    dry = replay(spark, data, since_ms=T0, until_ms=T0 + 2 * HOUR, dry_run=True)
    assert dry.matched == 10 and dry.by_topic == {"ORDERS": 7, "PAYMENTS": 3} and dry.sent == 0


def test_replay_sends_what_delivery_carries_and_is_not_a_duplicate(spark: SparkSession, make_store: MakeStore,
                                                                   tmp_path: Path) -> None:
    data = _store(make_store)
    out = tmp_path / "sent"
    out.mkdir()
    res = replay(spark, data, since_ms=T0, until_ms=T0 + 2 * HOUR, topic="ORDERS",
                 sender_factory=lambda: RecordingSender(str(out)), rate=0)
    assert (res.sent, res.failed, res.skipped_corrupt) == (7, 0, 0)
    sent = [json.loads(line) for f in out.iterdir() for line in f.read_text().splitlines()]
    by_id = {m["properties"][ORIGINAL_ID_PROPERTY]: m for m in sent}
    assert sorted(by_id) == ["a0", "a1", "a2", "a3", "a4", "a5", "bin"]
    a1 = by_id["a1"]
    assert (a1["topic"], a1["tags"], a1["keys"], base64.b64decode(a1["body"])) == ("ORDERS", "t", ["k1", "k2"],
                                                                                  b"body-a1")
    assert a1["properties"] == {"p": "v", ORIGINAL_ID_PROPERTY: "a1", REPLAY_PROPERTY: "1"}
    assert base64.b64decode(by_id["bin"]["body"]) == b"\x00\x01nul\x00"
    layout = SegmentLayout.open_existing(data)
    replayed = [e for seg in layout.list_segments() for e in read_dispatch_log(layout.dispatch_log(seg)).entries
                if e["outcome"] == REPLAYED]
    assert len(replayed) == 7
    rep = run_audit(spark, data, now_ms=T0 + 3 * HOUR)
    assert rep.replayed == 7 and rep.duplicates == 0 and rep.lost == 1  # "bin" was never delivered


def test_export_round_trips(spark: SparkSession, make_store: MakeStore, tmp_path: Path) -> None:
    data = _store(make_store)
    res = export(spark, data, tmp_path / "export")
    assert (res.records, res.dispatch_entries) == (10, 9)
    exported = spark.read.parquet(res.records_path)
    rows = {r["msg_id"]: r for r in exported.collect()}
    stored = _stored(data)
    assert rows.keys() == stored.keys()
    for mid, rec in stored.items():
        r = rows[mid]
        assert (r["topic"], bytes(r["body"]), r["due_ms"], r["tags"] or "", tuple(r["keys"]), dict(r["properties"])) \
            == (rec.topic, rec.body, rec.due_ms, rec.tags, rec.keys, dict(rec.properties))
        assert r["status"] == ("dispatched" if mid != "bin" else "pending")
        # the partition directory (segment=YYYYMMDDHHMM) reads back as a number
        assert str(r["segment"]) == SegmentLayout.open_existing(data).segment_dir(r["segment_ms"]).name
    fresh = tmp_path / "fresh"
    SegmentLayout(fresh)
    again = backfill(spark, fresh, spark.read.parquet(res.records_path), now_ms=T0 - 1000)
    assert again.scheduled == 10 and again.rejected == 0
    copy = _stored(fresh)
    assert {k: (v.topic, v.body, v.due_ms, v.tags, v.keys, dict(v.properties)) for k, v in copy.items()} == \
        {k: (v.topic, v.body, v.due_ms, v.tags, v.keys, dict(v.properties)) for k, v in stored.items()}
    only = export(spark, data, tmp_path / "orders", since_ms=T0, until_ms=T0 + HOUR, topic="ORDERS", dispatch=False)
    assert only.records == 6 and only.dispatch_path is None


def test_export_of_one_topic_keeps_the_corrupt_records_as_an_export_of_all_does(spark: SparkSession,
                                                                              make_store: MakeStore,
                                                                              tmp_path: Path) -> None:
    """A record whose bytes fail their checks has no topic to filter on: an export of one topic
    writes and counts it with status corrupt, as an export of every topic does (and a replay counts it)."""
    s = make_store()
    s.append(records(3) + records(2, prefix="p", start=T0 + 500, topic="PAYMENTS"), T0 - 1000)
    s.checkpoint()
    _corrupt(s, T0, 1)  # m1, an ORDERS record

    def corrupt_rows(records_path: str) -> list[tuple]:
        rows = spark.read.parquet(records_path).where("status = 'corrupt'").collect()
        return sorted((r["segment_ms"], r["part"], r["offset"], r["topic"], r["msg_id"]) for r in rows)

    every = export(spark, s.layout.root, tmp_path / "all", dispatch=False)
    assert every.records == 5 and len(corrupt_rows(every.records_path)) == 1
    for topic, readable in (("ORDERS", 2), ("PAYMENTS", 2), ("NOT_A_TOPIC", 0)):
        only = export(spark, s.layout.root, tmp_path / topic, topic=topic, dispatch=False)
        assert only.records == readable + 1, topic
        assert corrupt_rows(only.records_path) == corrupt_rows(every.records_path), topic
    dry = replay(spark, s.layout.root, since_ms=T0, until_ms=T0 + HOUR, topic="PAYMENTS", dry_run=True)
    assert (dry.matched, dry.skipped_corrupt) == (3, 1)


@pytest.mark.rocketmq
def test_replay_through_a_real_rocketmq(spark: SparkSession, rocketmq: LocalRocketMQ, make_store: MakeStore) -> None:
    import threading
    import uuid

    from forwarder._rmq_native import NativePushConsumer
    from forwarder.rocketmq import ReceivedMessage
    from forwarder.replay_sender import replay_sender

    topic = f"tw_replay_{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic])
    s = make_store()
    s.append([Record(f"r{i}", topic, b"\x00bin" + bytes([i]), T0 + i, 0, "tg", ("k1", "k2"), {"p": "v"})
              for i in range(5)], T0 - 1000)
    s.checkpoint()
    got: list[ReceivedMessage] = []
    done = threading.Event()

    def on_message(m: ReceivedMessage) -> bool:
        got.append(m)
        if len(got) >= 5:
            done.set()
        return True

    consumer = NativePushConsumer(f"tw_replay_consumer_{uuid.uuid4().hex[:8]}", rocketmq.namesrv_addr, on_message)
    consumer.subscribe(topic)
    consumer.start()
    try:
        res = replay(spark, s.layout.root, since_ms=T0, until_ms=T0 + 100,
                     sender_factory=replay_sender(rocketmq.namesrv_addr, f"tw_replay_{uuid.uuid4().hex[:8]}"),
                     rate=0)
        assert (res.sent, res.failed) == (5, 0)
        assert done.wait(60)
    finally:
        consumer.shutdown()
    by_id = {m.properties[ORIGINAL_ID_PROPERTY]: m for m in got}
    assert sorted(by_id) == [f"r{i}" for i in range(5)]
    m = by_id["r3"]
    assert (m.topic, m.body, m.tags, m.keys) == (topic, b"\x00bin\x03", "tg", "k1 k2")
    assert m.properties["p"] == "v" and m.properties[REPLAY_PROPERTY] == "1"


@pytest.mark.parametrize("dry_run", [False, True], ids=["sent", "dry-run"])
def test_a_replay_that_skips_corrupt_records_sends_the_rest_and_exits_1(spark: SparkSession, make_store: MakeStore,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        dry_run: bool) -> None:
    """A record whose bytes fail their checks cannot be sent: the rest is sent (or, dry, listed), one
    line on stderr says how many were skipped and that `inspect --verify` names them, and the
    replay exits 1, as it does on records it cannot read."""
    from functools import partial

    import forwarder.replay_sender
    from timewheel.app.cli import app

    s = make_store()
    s.append(records(3), T0 - 1000)
    s.checkpoint()
    _corrupt(s, T0, 1)  # m1
    data = s.layout.root
    sent = tmp_path / "sent"
    sent.mkdir()
    monkeypatch.setattr(forwarder.replay_sender, "replay_sender_for",
                        lambda cfg, group: partial(RecordingSender, str(sent)))
    args = ["replay", "--data-dir", str(data), "--since", str(T0), "--until", str(T0 + HOUR),
            "--namesrv", "127.0.0.1:1", "--rate", "0", *(["--dry-run"] if dry_run else [])]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), str(res.exception)[:2000]
    assert res.exit_code == 1, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert (result["matched"], result["skipped_corrupt"], result["sent"]) == (3, 1, 0 if dry_run else 2)
    ids = sorted(json.loads(line)["properties"][ORIGINAL_ID_PROPERTY]
                 for f in sent.iterdir() for line in f.read_text().splitlines())
    assert ids == ([] if dry_run else ["m0", "m2"])
    line = (f"timewheel: {'would skip' if dry_run else 'skipped'} 1 corrupt record(s) due in the range "
            "(their bytes fail their checks, so they cannot be sent)")
    assert line in res.stderr and f"timewheel inspect --data-dir {data} --verify" in res.stderr, res.stderr
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 1 and line in text.stderr, text.output
    assert "skipped 1 corrupt records" in text.stdout, text.stdout  # the summary on stdout is as before
    # the command the line names does name the record
    verify = CliRunner().invoke(app, ["inspect", "--data-dir", str(data), "--verify", "--json"])
    findings = json.loads(verify.stdout)["findings"]
    assert [(f["kind"], f["path"]) for f in findings] == [("corrupt_record", str(s.layout.part_log(T0, 0)))]
