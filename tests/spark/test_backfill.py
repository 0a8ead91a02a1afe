"""Backfill: idempotent reruns, contract violations reported with their reason, the commit protocol."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest

from spark.backfill import backfill, read_input
from spark.schema import BACKFILL_PLAN
from spark.source import STAGING_DIR, BackfillWriter, StagedParts
from storage import Record, SegmentLayout, decode, read_index, summarize
from tests.spark.conftest import HOUR, T0

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _stored(data_dir: Path) -> dict[str, Record]:
    """msg_id -> Record of every record in a data directory, read with storage itself."""
    layout = SegmentLayout.open_existing(data_dir)
    out: dict[str, Record] = {}
    for seg in layout.list_segments():
        for part in layout.list_parts(seg):
            raw = layout.part_log(seg, part).read_bytes()
            for e in read_index(layout.part_index(seg, part)):
                rec, _ = decode(raw, int(e["offset"]))
                assert layout.segment_start(rec.due_ms) == seg
                assert rec.msg_id not in out, f"{rec.msg_id} stored twice"
                out[rec.msg_id] = rec
    return out


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.spark
def test_backfill_twice_schedules_nothing_twice(spark: SparkSession, tmp_path: Path) -> None:
    data = tmp_path / "data"
    SegmentLayout(data)
    rows = [{"topic": "ORDERS", "body": f"b{i}", "deliver_at_ms": T0 + i * 20 * 60_000, "keys": [f"k{i}"],
             "tags": "t" if i % 2 else None, "properties": {"p": str(i)}} for i in range(12)]
    rows += [{"msg_id": "given-1", "topic": "PAYMENTS", "body": "x", "deliver_at": "2027-01-15T09:30:00Z"},
             {"msg_id": "given-1", "topic": "PAYMENTS", "body": "x", "deliver_at": "2027-01-15T09:30:00Z"},
             dict(rows[0])]  # an exact copy of a row without id: the same derived id
    src = _jsonl(tmp_path / "in.jsonl", rows)
    first = backfill(spark, data, read_input(spark, [str(src)]), now_ms=T0)
    assert (first.scheduled, first.duplicates, first.already_scheduled, first.rejected) == (13, 2, 0, 0)
    stored = _stored(data)
    assert len(stored) == 13 and stored["given-1"].due_ms == T0 + 90 * 60_000
    r0 = next(r for r in stored.values() if r.body == b"b0")
    assert r0.keys == ("k0",) and r0.properties == {"p": "0"} and r0.tags == "" and r0.enqueue_ms == T0
    assert len(r0.msg_id) == 32
    again = backfill(spark, data, read_input(spark, [str(src)]), now_ms=T0 + 1000)
    assert (again.scheduled, again.already_scheduled, again.duplicates) == (0, 15, 0)
    assert _stored(data).keys() == stored.keys()
    totals = summarize(SegmentLayout.open_existing(data))["totals"]
    assert isinstance(totals, dict) and totals["records"] == 13
    assert not (data / STAGING_DIR).exists()


@pytest.mark.spark
def test_rows_breaking_the_contract_are_reported_with_their_reason(spark: SparkSession, tmp_path: Path) -> None:
    data = tmp_path / "data"
    SegmentLayout(data)
    csv = tmp_path / "in.csv"
    csv.write_text("msg_id,topic,body,deliver_at_ms,keys,properties\n"
                   f"ok-1,ORDERS,hello,{T0 + 5000},a b,\"{{\"\"p\"\":\"\"v\"\"}}\"\n"
                   f"no-topic,,hello,{T0 + 5000},,\n"
                   "bad-time,ORDERS,hello,tomorrow,,\n"
                   f"too-late,ORDERS,hello,{T0 + 3 * HOUR},,\n"
                   f"too-big,ORDERS,{'x' * 64},{T0 + 5000},,\n"
                   f"past,ORDERS,hello,{T0 - HOUR},,\n"
                   f"bad-props,ORDERS,hello,{T0 + 5000},,not json\n"
                   f"no-time,ORDERS,hello,,,\n")
    rejects = tmp_path / "rejects"
    res = backfill(spark, data, read_input(spark, [str(csv)]), now_ms=T0, rejects_path=rejects,
                   max_delay_ms=2 * HOUR, max_body_bytes=32)
    assert res.scheduled == 1 and res.rejected == 7
    assert res.rejected_by_reason == {"no_topic": 1, "bad_time": 1, "too_late": 1, "body_too_large": 1,
                                      "past_segment": 1, "bad_properties": 1, "no_time": 1}
    back = {r["msg_id"]: r["reason"] for r in spark.read.parquet(str(rejects)).collect()}
    assert back == {"no-topic": "no_topic", "bad-time": "bad_time", "too-late": "too_late",
                    "too-big": "body_too_large", "past": "past_segment", "bad-props": "bad_properties",
                    "no-time": "no_time"}
    ok = _stored(data)["ok-1"]
    assert ok.keys == ("a", "b") and ok.properties == {"p": "v"} and ok.body == b"hello"
    # scheduling past-due rows for now instead of rejecting them
    res = backfill(spark, data, read_input(spark, [str(csv)]), now_ms=T0 + 10, past_due="now",
                   max_delay_ms=2 * HOUR, max_body_bytes=32)
    assert res.scheduled == 1 and "past_segment" not in res.rejected_by_reason
    assert _stored(data)["past"].due_ms == T0 + 10


def test_writer_commit_publishes_and_abort_removes(tmp_path: Path) -> None:
    """The commit protocol without Spark: tasks stage, the driver publishes or removes."""
    data = tmp_path / "data"
    SegmentLayout(data)
    fields = [f.name for f in BACKFILL_PLAN.fields]
    mtype = pa.map_(pa.string(), pa.string())

    def batch(ids: list[str], due: int, status: str = "new") -> pa.RecordBatch:
        n = len(ids)
        return pa.RecordBatch.from_pydict({
            "msg_id": ids, "topic": ["T"] * n, "body": [b"x"] * n, "due_ms": [due + i for i in range(n)],
            "tags": [None] * n, "keys": [[]] * n, "properties": pa.array([[]] * n, mtype), "status": [status] * n,
            "copies": [1] * n}).select(fields)

    w = BackfillWriter(str(data), "job-a", T0, str(tmp_path / "report.json"), 1 << 30)
    m1 = w.write(iter([batch(["a", "b"], T0), batch(["c"], T0 + HOUR)]))
    m2 = w.write(iter([batch(["d"], T0 + HOUR), batch(["old"], T0, "existing")]))
    assert isinstance(m1, StagedParts) and len(m1.parts) == 2 and m2.counts["existing"] == 1
    assert not SegmentLayout.open_existing(data).list_segments()  # nothing visible before commit
    w.commit([m1, m2])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counts"] == {"written": 4, "existing": 1, "duplicates": 0}
    assert sorted(_stored(data)) == ["a", "b", "c", "d"]
    assert not (data / STAGING_DIR).exists()
    w2 = BackfillWriter(str(data), "job-b", T0, None, 1 << 30)
    m3 = w2.write(iter([batch(["e"], T0)]))
    w2.abort([m3, None])
    assert sorted(_stored(data)) == ["a", "b", "c", "d"] and not (data / STAGING_DIR).exists()


@pytest.mark.spark
def test_backfill_and_export_commands(spark: SparkSession, tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from timewheel.app.cli_spark import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    data = tmp_path / "data"
    SegmentLayout(data)
    src = _jsonl(tmp_path / "in.json", [{"topic": "T", "body": "x", "deliver_at_ms": 4_102_444_800_000 + i}
                                         for i in range(3)] + [{"body": "no topic", "deliver_at_ms": 1}])
    res = CliRunner().invoke(app, ["backfill", str(src), "--data-dir", str(data), "--json",
                                   "--rejects", str(tmp_path / "rejects.json"), "--max-delay-ms", str(10**15)])
    assert res.exit_code == 1, res.output  # a row was rejected; the others are scheduled
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (out["scheduled"], out["rejected"], out["rejected_by_reason"]) == (3, 1, {"no_topic": 1})
    res = CliRunner().invoke(app, ["export", "--data-dir", str(data), "--out", str(tmp_path / "x"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["records"] == 3


@pytest.mark.spark
def test_system_and_engine_topics_are_refused_with_the_ingest_check(spark: SparkSession, tmp_path: Path) -> None:
    data = tmp_path / "data"
    SegmentLayout(data)
    csv = tmp_path / "in.csv"
    bad = ["%DLQ%orders", "%RETRY%group", "SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC", "TW_DELAY", "TW_DLQ",
           "bad topic!"]
    csv.write_text("msg_id,topic,body,deliver_at_ms\n" + f"ok-1,ORDERS,hello,{T0 + 5000}\n"
                   + "".join(f"b{i},{t},hello,{T0 + 5000}\n" for i, t in enumerate(bad)))
    res = backfill(spark, data, read_input(spark, [str(csv)]), now_ms=T0, max_delay_ms=2 * HOUR,
                   reserved_topics=frozenset({"TW_DELAY", "TW_DLQ"}))
    assert res.scheduled == 1 and res.rejected_by_reason == {"bad_topic": len(bad)}
    # the check is the one ingest applies to every target
    from forwarder.contract import ContractViolation, check_target_topic
    for t in bad:
        with pytest.raises(ContractViolation):
            check_target_topic(t, frozenset({"TW_DELAY", "TW_DLQ"}))


@pytest.mark.spark
def test_a_topic_ending_in_a_line_break_is_refused_as_ingest_refuses_it(spark: SparkSession, tmp_path: Path) -> None:
    # names read line by line keep their line break; delivery would refuse every one of these messages
    data = tmp_path / "data"
    SegmentLayout(data)
    bad = ["ORDERS\n", "ORDERS\r", "ORDERS\r\n", "ORDERS\u0085", "ORDERS\u2028", "ORDERS\u2029"]
    rows = [{"msg_id": "ok-1", "topic": "ORDERS", "body": "x", "deliver_at_ms": T0 + 5000}]
    rows += [{"msg_id": f"b{i}", "topic": t, "body": "x", "deliver_at_ms": T0 + 5000} for i, t in enumerate(bad)]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    res = backfill(spark, data, read_input(spark, [str(src)]), now_ms=T0, max_delay_ms=2 * HOUR)
    assert res.rejected_by_reason == {"bad_topic": len(bad)} and res.scheduled == 1
    assert list(_stored(data)) == ["ok-1"]
    from forwarder.contract import ContractViolation, check_target_topic
    for t in bad:
        with pytest.raises(ContractViolation):
            check_target_topic(t)


@pytest.mark.spark
def test_rows_delivery_would_refuse_are_rejected_up_front_as_ingest_refuses_them(spark: SparkSession,
                                                                                 tmp_path: Path) -> None:
    from forwarder.contract import (DELIVERY_PROPERTIES_BUDGET, ContractViolation, check_deliverable,
                                    properties_size, to_outgoing)
    from timewheel.config import EngineConfig
    from timewheel.message import Message

    data = tmp_path / "data"
    SegmentLayout(data)
    due = T0 + 5000

    def delivered_size(msg_id: str, value: str) -> int:
        out = to_outgoing(Message("ORDERS", b"x", due, "t\u00e9", ("k1", "k2"), {"p\u00e9": value}, msg_id))
        return properties_size(out.properties, out.tags, out.keys)

    # properties, tags and keys exactly at the budget as RocketMQ serialises them (UTF-8 bytes), and one byte over
    fill = "\u00e9" + "x" * (DELIVERY_PROPERTIES_BUDGET - delivered_size("at-budget", "\u00e9"))
    assert delivered_size("at-budget", fill) == DELIVERY_PROPERTIES_BUDGET
    check_deliverable(Message("ORDERS", b"x", due, "t\u00e9", ("k1", "k2"), {"p\u00e9": fill}, "at-budget"))
    with pytest.raises(ContractViolation):
        check_deliverable(Message("ORDERS", b"x", due, "t\u00e9", ("k1", "k2"), {"p\u00e9": fill}, "over-budget"))

    def row(msg_id: str, **kw: Any) -> dict[str, Any]:
        return {"msg_id": msg_id, "topic": "ORDERS", "body": "x", "deliver_at_ms": due, **kw}

    big = {"tags": "t\u00e9", "keys": ["k1", "k2"]}
    rows = [row("ok-1", properties={"p": "v"}),
            row("at-budget", properties={"p\u00e9": fill}, **big),
            row("over-budget", properties={"p\u00e9": fill + "x"}, **big),
            row("sep-value", properties={"p": "a\x01b"}), row("sep-name", properties={"p\x02": "v"}),
            row("sep-tags", tags="t\x00"), row("sep-key", keys=["k\x01"]), row("sep\x02id"),
            row("target", properties={"TW_TARGET_TOPIC": "OTHER"}), row("delay", properties={"TW_DELAY_MS": "5"}),
            row("uniq", properties={"UNIQ_KEY": "0" * 32}), row("broker-delay", properties={"DELAY": "3"}),
            row("transient", properties={"__RMQ.TRANSIENT.X": "1"}),
            row("large-body", body="x" * (EngineConfig.max_body_bytes + 1))]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    rejects = tmp_path / "rejects"
    # the Python default of max_body_bytes is the engine's
    res = backfill(spark, data, read_input(spark, [str(src)]), now_ms=T0, rejects_path=rejects)
    assert res.rejected_by_reason == {"properties_too_large": 1, "separator": 5, "reserved_property": 5,
                                      "body_too_large": 1}
    assert sorted(_stored(data)) == ["at-budget", "ok-1"] and res.scheduled == 2
    back = {r["msg_id"]: r["reason"] for r in spark.read.parquet(str(rejects)).collect()}
    assert back["over-budget"] == "properties_too_large" and back["sep\x02id"] == "separator"
    assert back["target"] == "reserved_property" and back["large-body"] == "body_too_large"
