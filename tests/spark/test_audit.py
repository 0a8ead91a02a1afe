"""The audit: a store with injected faults reports exactly those; the pure functions on their own."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from spark import audit as A
from spark._cells import lateness_bins
from spark.schema import AUDIT_CELLS
from storage import (CANCELLED, DEAD_LETTERED, DELIVERED, REPLAYED, ScheduleStore, SegmentIndex, encode_frame,
                     read_dispatch_log, read_index)
from storage.audit import STATUSES, record_status
from tests.spark.conftest import HOUR, T0, MakeStore, deliver, records

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark
NOW = T0 + 3 * HOUR
GRACE = 300_000


def _remove_entry(store: ScheduleStore, seg: int, part: int, offset: int) -> None:
    """Rewrite a segment's dispatch log without the entries of one record."""
    path = store.layout.dispatch_log(seg)
    store.release_segment(seg)
    entries = read_dispatch_log(path).entries
    keep = entries[~((entries["part"] == part) & (entries["offset"] == offset))]
    assert len(keep) == len(entries) - 1
    path.write_bytes(encode_frame(keep, T0))


def _corrupt(store: ScheduleStore, seg: int, i: int) -> None:
    idx = read_index(store.layout.part_index(seg, 0))
    with open(store.layout.part_log(seg, 0), "r+b") as f:
        f.seek(int(idx["offset"][i]) + int(idx["length"][i]) - 2)
        f.write(b"\x00\xff")


@pytest.fixture
def faulty(make_store: MakeStore) -> tuple[Path, dict[str, Any]]:
    """Three segments; faults: one dispatch entry removed, one record delivered twice, one record
    corrupted; plus a replay (not a fault), a cancel, a dead letter, and future records."""
    s = make_store()
    seg_a, seg_b, seg_c = T0, T0 + HOUR, T0 + 5 * HOUR
    s.append(records(20, prefix="a", step=60_000) + records(10, prefix="p", start=T0 + 30, step=60_000,
                                                            topic="PAYMENTS"), T0 - 1000)
    s.append(records(10, prefix="b", start=seg_b, step=60_000), T0 - 1000)
    s.append(records(5, prefix="c", start=seg_c, step=60_000), T0 - 1000)
    ix_a = s.segment_index(seg_a)
    ids_a = [f"a{i}" for i in range(20)] + [f"p{i}" for i in range(10)]  # append order
    lateness = {}
    for i in range(30):
        if ids_a[i] in ("a3", "p0"):
            continue
        late = (i * 7) % 23
        lateness[ids_a[i]] = late
        s.record_dispatch(seg_a, A_entries(ix_a, i, DELIVERED, int(ix_a.due_ms[i]) + late), T0)
    deliver(s, seg_a, slice(3, 4), CANCELLED, T0 - 500)
    deliver(s, seg_a, slice(20, 21), DEAD_LETTERED, T0 + 100_000, 16)
    deliver(s, seg_a, slice(1, 2), REPLAYED, T0 + 2 * HOUR)
    ix_b = s.segment_index(seg_b)
    for i in range(10):
        lateness[f"b{i}"] = 2
        s.record_dispatch(seg_b, A_entries(ix_b, i, DELIVERED, int(ix_b.due_ms[i]) + 2), T0)
    deliver(s, seg_b, slice(2, 3), DELIVERED, int(ix_b.due_ms[2]) + 50)  # fault 2: delivered twice
    _remove_entry(s, seg_a, 0, int(ix_a.offset[5]))  # fault 1: a5's DELIVERED entry removed
    del lateness["a5"]
    _corrupt(s, seg_b, 6)  # fault 3: b6's bytes (after its delivery, which still counts for lateness)
    s.checkpoint()
    return s.layout.root, {"lateness": lateness, "seg_a": seg_a, "seg_b": seg_b}


def A_entries(ix: SegmentIndex, i: int, outcome: int,  # noqa: N802 - reads as "entries of segment A"
              dispatch_ms: int) -> np.ndarray:
    from storage import dispatch_entries

    return dispatch_entries(ix.part[i:i + 1], ix.offset[i:i + 1], ix.due_ms[i:i + 1], dispatch_ms, outcome, 1)


def test_audit_reports_exactly_the_injected_faults(spark: SparkSession, faulty: tuple[Path, dict[str, Any]],
                                                   tmp_path: Path) -> None:
    data_dir, info = faulty
    rep = A.run_audit(spark, data_dir, now_ms=NOW, grace_ms=GRACE, out_dir=tmp_path / "out")
    found = sorted((f["kind"], f["msg_id"] or f"{f['segment']}/{f['part']}/{f['offset']}")
                   for f in rep.sample_findings)
    b6 = next(f for f in rep.sample_findings if f["kind"] == "corrupt")
    assert found == sorted([("lost", "a5"), ("duplicate", "b2"), ("corrupt", f"{b6['segment']}/0/{b6['offset']}")])
    assert b6["segment_ms"] == info["seg_b"] and b6["msg_id"] is None
    assert (rep.lost, rep.duplicates, rep.corrupt, rep.unknown_dispatch_entries) == (1, 1, 1, 0)
    assert (rep.scheduled, rep.dispatched, rep.cancelled, rep.dead_lettered, rep.pending, rep.replayed) == \
        (45, 36, 1, 1, 6, 1)
    assert rep.failed
    by = {(s["segment_ms"], s["topic"]): s for s in rep.segments}
    assert all(s["balanced"] for s in rep.segments)
    assert {k: by[(T0, "ORDERS")][k] for k in ("scheduled", "dispatched", "cancelled", "pending")} == \
        {"scheduled": 20, "dispatched": 18, "cancelled": 1, "pending": 1}
    assert by[(T0 + HOUR, None)]["corrupt"] == 1 and by[(T0 + HOUR, "ORDERS")]["duplicates"] == 1
    late = np.array(sorted(info["lateness"].values()))
    assert rep.lateness_ms["max_ms"] == late.max() and rep.lateness_ms["delivered"] == len(late)
    assert rep.lateness_ms["p50_ms"] == late[int(np.ceil(0.5 * len(late))) - 1]
    assert rep.lateness_ms["p99_ms"] == late[int(np.ceil(0.99 * len(late))) - 1]
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["lost"] == 1 and written["ok"] is False
    assert spark.read.parquet(str(tmp_path / "out" / "findings")).count() == 3
    if A.write_chart([], tmp_path / "probe.png") is not None or rep.chart_path:
        assert rep.chart_path is not None and Path(rep.chart_path).read_bytes()[:4] == b"\x89PNG"


def test_outcomes_from_the_source_equal_a_join_of_the_dispatch_logs(spark: SparkSession, faulty: tuple[Path, dict[str,
                                                                    Any]]) -> None:
    data_dir, _ = faulty
    cols = "segment_ms long, part int, offset long, msg_id string, topic string, due_ms long, crc_ok boolean"
    base = spark.read.format("timewheel").schema(cols).load(str(data_dir))
    dispatch = spark.read.format("timewheel_dispatch").load(str(data_dir))
    joined = A.attach_outcomes(base, dispatch)
    direct = spark.read.format("timewheel").schema(A.RECORD_COLUMNS).load(str(data_dir))
    assert joined.select(*direct.columns).exceptAll(direct).count() == 0
    assert direct.exceptAll(joined.select(*direct.columns)).count() == 0


def test_audit_cli_json_and_exit_code(spark: SparkSession, faulty: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from timewheel.app.cli_spark import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    data_dir, _ = faulty
    res = CliRunner().invoke(app, ["audit", "--data-dir", str(data_dir), "--now", str(NOW), "--json",
                                   "--out", str(tmp_path / "cli-out")])
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("scheduled", "dispatched", "cancelled", "pending", "dead_lettered", "lost", "duplicates", "corrupt",
                "lateness_ms"):
        assert key in report
    assert (report["lost"], report["duplicates"], report["corrupt"]) == (1, 1, 1)


def test_a_clean_store_passes(spark: SparkSession, make_store: MakeStore, tmp_path: Path) -> None:
    s = make_store()
    s.append(records(6, step=60_000), T0 - 1000)
    deliver(s, T0, slice(0, 6), DELIVERED, T0 + HOUR)
    s.checkpoint()
    rep = A.run_audit(spark, s.layout.root, now_ms=NOW, grace_ms=GRACE)
    assert not rep.failed and rep.dispatched == 6 and rep.sample_findings == []


def test_status_precedence_is_storages_and_findings_without_io(spark: SparkSession) -> None:
    cols = ("segment_ms long, part int, offset long, msg_id string, topic string, due_ms long, crc_ok boolean, "
            "delivered int, dead_lettered int, cancelled int, marked_corrupt int, replayed int, "
            "first_delivered_ms long")
    rows = [  # msg_id tells what is expected
        (T0, 0, 0, "dispatched", "T", T0, True, 1, 0, 0, 0, 0, T0 + 5),
        (T0, 0, 1, "cancelled-wins", "T", T0, True, 1, 0, 1, 0, 0, T0 + 5),
        (T0, 0, 2, "dead", "T", T0, True, 0, 1, 0, 0, 0, None),
        (T0, 0, 3, "marked", "T", T0, True, 0, 0, 0, 1, 0, None),
        (T0, 0, 4, None, None, T0, False, 1, 0, 0, 0, 0, T0 + 1),
        (T0, 0, 5, "lost", "T", T0, True, 0, 0, 0, 0, 2, None),
        (T0, 0, 6, "not-yet-lost", "T", NOW - GRACE + 1, True, 0, 0, 0, 0, 0, None),
        (T0, 0, 7, "dup", "T", T0, True, 3, 0, 0, 0, 0, T0 + 2000),
    ]
    want = {0: "dispatched", 1: "cancelled", 2: "dead_lettered", 3: "corrupt", 4: "corrupt", 5: "pending",
            6: "pending", 7: "dispatched"}
    status = A.with_status(spark.createDataFrame(rows, cols))
    assert {r["offset"]: r["status"] for r in status.collect()} == want
    # the numpy rule the audit source and `timewheel inspect` use says the same
    counts = {k: np.array([r[7 + i] for r in rows]) for i, k in enumerate(A.OUTCOME_COUNTS)}
    codes = record_status(counts, bad=np.array([not r[6] for r in rows]))
    assert {i: STATUSES[c] for i, c in enumerate(codes.tolist())} == want

    # the Spark side of the audit over hand-made cells: two plain cells, three findings, a stray entry
    def finding(offset: int, kinds: list[str], delivered: int | None = 0, crc_ok: bool | None = True,
                outcome: int | None = None) -> dict:
        return {"part": 0, "offset": offset, "msg_id": None, "due_ms": T0, "delivered": delivered,
                "first_delivered_ms": None, "crc_ok": crc_ok, "outcome": outcome, "kinds": kinds}

    zero = dict.fromkeys(("scheduled", *STATUSES, "replayed", "lost", "duplicates", "deliveries", "unknown_entries"), 0)

    def cell(topic: str | None, late: int | None, f: dict | None = None, **counts: int) -> dict:
        return {"segment_ms": T0, "segment": "202701150800", "topic": topic, "bucket_ms": T0, "lateness_bin": late,
                "finding": f, **zero, **counts, "max_ms": late}

    table = spark.createDataFrame([
        cell("T", 5, scheduled=2, dispatched=2, deliveries=2),
        cell("T", None, scheduled=2, dead_lettered=1, cancelled=1),
        cell("T", None, finding(3, ["corrupt"]), scheduled=1, corrupt=1),
        cell(None, 1, finding(4, ["corrupt"], 1, False), scheduled=1, corrupt=1, deliveries=1),
        cell("T", None, finding(5, ["lost"]), scheduled=1, pending=1, replayed=1, lost=1),
        cell("T", 2000, finding(7, ["duplicate"], 3), scheduled=1, dispatched=1, duplicates=1, deliveries=1),
        {**cell(None, None, finding(99, ["unknown_dispatch_entry"], None, None, 1), unknown_entries=1),
         "bucket_ms": None},
    ], AUDIT_CELLS)
    found = {(r["kind"], r["offset"]): r["detail"] for r in A.findings(table).collect()}
    assert found == {("corrupt", 3): "marked corrupt by the engine",
                     ("corrupt", 4): "bytes fail their checks (CRC32C or header)", ("duplicate", 7): "delivered 3 times",
                     ("lost", 5): "no terminal outcome", ("unknown_dispatch_entry", 99): "outcome 1 names no record"}
    hist = A.histogram(table).toArrow()
    rec = A.reconcile(hist)  # the stray entry's cell (no topic, nothing scheduled) is no segment row
    assert [(r["topic"], r["scheduled"], r["lost"], r["balanced"]) for r in sorted(rec, key=lambda r: r["topic"] or "")] \
        == [(None, 1, 0, True), ("T", 7, 1, True)]
    (total,) = A.lateness(hist, [])
    assert (total["p50_ms"], total["p99_ms"], total["max_ms"], total["delivered"]) == (5, 2000, 2000, 4)


def test_lateness_bins_are_within_one_percent() -> None:
    cases = [(0, 0), (7, 7), (1023, 1023), (1024, 1024), (1031, 1024), (1032, 1032), (100_000, 99_840), (-5, -5),
             (-2000, -2000), (3_600_000, 3_588_096)]
    got = lateness_bins(np.array([ms for ms, _ in cases], np.int64)).tolist()
    assert got == [b for _, b in cases]
    assert all(abs(b - ms) <= abs(ms) / 100 for ms, b in cases)
    ms = np.random.default_rng(1).integers(-10**9, 10**9, 100_000)
    b = lateness_bins(ms)
    assert np.all(np.abs(b) <= np.abs(ms)) and np.all(np.abs(ms - b) <= np.abs(ms) / 100)


def test_cells_agree_with_the_per_record_statuses(spark: SparkSession, faulty: tuple[Path, dict[str, Any]]) -> None:
    """The audit source's numpy cells and the per-record path (the timewheel source, with_status)
    count the same statuses per segment and topic."""
    from pyspark.sql import functions as F

    data_dir, _ = faulty
    table = A.cells(spark, data_dir, bucket_ms=60_000, now_ms=NOW, grace_ms=GRACE)
    from_cells = {(r["segment_ms"], r["topic"]): {k: r[k] for k in ("scheduled", *STATUSES)}
                  for r in A.reconcile(A.histogram(table).toArrow())}
    records = A.with_status(spark.read.format("timewheel").schema(A.RECORD_COLUMNS).load(str(data_dir)))
    per_record = records.groupBy("segment_ms", "topic").agg(
        F.count(F.lit(1)).alias("scheduled"), *(F.sum(F.when(F.col("status") == st, 1).otherwise(0)).alias(st)
                                                 for st in STATUSES)).collect()
    assert from_cells == {(r["segment_ms"], r["topic"]): {k: r[k] for k in ("scheduled", *STATUSES)}
                          for r in per_record}
