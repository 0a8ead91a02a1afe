"""Parts that nothing appends to any more (their segment ended before the audit's grace window) whose
records cannot be read: a log cut short of what its index names, a log without its index sidecar.
The audit fails on them naming the part and how many records; an export writes what it can, a replay
sends what it can (or, dry, lists it), and both say how many they could not and exit 1. Beside a
running engine, a part still being written is not damage: index entries past the log of the current
segment, and a commit in flight into a past segment (records in the log, their index entries not
yet), are no finding."""
from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from spark.audit import run_audit
from spark.audit_source import AuditReader
from spark.export import export
from spark.replay import replay
from storage import DELIVERED, ScheduleStore, dispatch_entries
from storage.index import INDEX_ENTRY_SIZE
from tests.spark.conftest import HOUR, T0, deliver, records
from tests.spark.test_replay_export import RecordingSender

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark
NOW = T0 + 3 * HOUR  # the audit's time: NOW's own segment is the current one
PAST = 1_700_000_000_000 // HOUR * HOUR  # a segment that ended long before NOW and the wall clock (an export's now)
GRACE = 300_000
PART_BYTES = 320  # five records a part: 15 records fill parts 0, 1 and 2
Damage = Callable[[Path], Path]  # damages a segment's directory, returns the log of the damaged part


def _stored(tmp_path: Path, start: int = PAST, *, delivered: int = 15) -> tuple[Path, Path]:
    """A data directory of 15 records due from `start` in three parts of one segment, the first
    `delivered` of them delivered; and that segment's directory."""
    d = tmp_path / "data"
    with ScheduleStore(d, max_part_bytes=PART_BYTES) as s:
        s.append(records(15, start=start, step=60_000), start - 1000)
        if delivered:
            deliver(s, start, slice(0, delivered), DELIVERED, start + 3_600_000 - 1)
        s.checkpoint()
        assert s.layout.list_parts(start) == [0, 1, 2]
        return d, s.layout.segment_dir(start)


def _cut_log(seg: Path) -> Path:
    """The last 17 bytes of part 0's log removed: its last record cut mid-way."""
    log = seg / "00000.log"
    os.truncate(log, log.stat().st_size - 17)
    return log


def _no_index(seg: Path) -> Path:
    (seg / "00000.idx").unlink()
    return seg / "00000.log"


def _cli() -> typer.Typer:
    from timewheel.app.cli_spark import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return app


def _audit_cli(d: Path, out: Path) -> tuple[int, dict]:
    res = CliRunner().invoke(_cli(), ["audit", "--data-dir", str(d), "--now", str(NOW), "--json", "--out", str(out)])
    assert res.exception is None or isinstance(res.exception, SystemExit), str(res.exception)[:2000]
    return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("damage", "unreadable", "detail"), [
    (_cut_log, 1, "1 record(s) of {log} cannot be read: the index names them past the end of the log"),
    (_no_index, 5, "5 record(s) of {log} cannot be read: it has no index sidecar"),
], ids=["log-cut", "index-missing"])
def test_the_audit_fails_on_records_a_settled_part_cannot_give_back(spark: SparkSession, tmp_path: Path,
                                                                    damage: Damage, unreadable: int,
                                                                    detail: str) -> None:
    d, seg = _stored(tmp_path)
    log = damage(seg)
    code, report = _audit_cli(d, tmp_path / "out")
    assert (code, report["ok"]) == (1, False), report
    assert report["unreadable_records"] == unreadable
    assert report["scheduled"] + unreadable == 15
    found = [f for f in report["sample_findings"] if f["kind"] == "unreadable_records"]
    assert [(f["segment_ms"], f["part"]) for f in found] == [(PAST, 0)]
    assert found[0]["detail"].startswith(detail.format(log=log)), found[0]["detail"]
    # the outcomes recorded for those records name nothing the audit can read, in a settled segment
    assert report["unknown_dispatch_entries"] == report["unknown_dispatch_entries_settled"] == unreadable
    written = spark.read.parquet(str(tmp_path / "out" / "findings"))
    assert written.where("kind = 'unreadable_records'").count() == 1


def _refused_json(args: list[str], log: Path, unreadable: int) -> dict:
    """The command's JSON result, run with --json: exit 1, the damaged part in the result and named on stderr."""
    res = CliRunner().invoke(_cli(), [*args, "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), str(res.exception)[:2000]
    assert res.exit_code == 1, res.output
    result: dict = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(p["segment_ms"], p["part"], p["log"], p["records"]) for p in result["damaged_parts"]] == \
        [(PAST, 0, str(log), unreadable)]
    assert f"{unreadable} record(s) of {log} cannot be read" in res.stderr
    return result


@pytest.mark.parametrize("damage", [_cut_log, _no_index], ids=["log-cut", "index-missing"])
def test_an_export_says_how_many_records_it_could_not_read_and_exits_1(spark: SparkSession, tmp_path: Path,
                                                                         damage: Damage) -> None:
    d, seg = _stored(tmp_path)
    log = damage(seg)
    unreadable = 1 if damage is _cut_log else 5
    result = _refused_json(["export", "--data-dir", str(d), "--out", str(tmp_path / "out")], log, unreadable)
    assert (result["records"], result["unreadable_records"]) == (15 - unreadable, unreadable)
    # written all the same: what could be read is there
    assert spark.read.parquet(result["records_path"]).count() == 15 - unreadable
    text = CliRunner().invoke(_cli(), ["export", "--data-dir", str(d), "--out", str(tmp_path / "out2")])
    assert text.exit_code == 1 and f"{unreadable} record(s) of {log} cannot be read" in text.output, text.output


def test_export_counts_only_the_unreadable_records_due_in_its_range(spark: SparkSession, tmp_path: Path) -> None:
    d, seg = _stored(tmp_path)
    _cut_log(seg)  # the cut record is part 0's last, due 4 minutes into the segment
    before = export(spark, d, tmp_path / "before", until_ms=PAST + 4 * 60_000, now_ms=NOW)
    assert (before.records, before.unreadable_records, before.damaged_parts) == (4, 0, [])
    at = export(spark, d, tmp_path / "at", since_ms=PAST + 4 * 60_000, until_ms=PAST + 5 * 60_000, now_ms=NOW)
    assert (at.records, at.unreadable_records) == (0, 1)


@pytest.mark.parametrize("dry_run", [False, True], ids=["sent", "dry-run"])
@pytest.mark.parametrize("damage", [_cut_log, _no_index], ids=["log-cut", "index-missing"])
def test_a_replay_says_how_many_records_it_could_not_read_and_exits_1(spark: SparkSession, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       damage: Damage, dry_run: bool) -> None:
    """As an export: the rest is replayed (or listed), each damaged part named on stderr."""
    import forwarder.replay_sender

    d, seg = _stored(tmp_path)
    log = damage(seg)
    unreadable = 1 if damage is _cut_log else 5
    sent = tmp_path / "sent"
    sent.mkdir()
    monkeypatch.setattr(forwarder.replay_sender, "replay_sender_for",
                        lambda cfg, group: partial(RecordingSender, str(sent)))
    args = ["replay", "--data-dir", str(d), "--since", str(PAST), "--until", str(PAST + HOUR),
            "--namesrv", "127.0.0.1:1", "--rate", "0", *(["--dry-run"] if dry_run else [])]
    detail = f"{unreadable} record(s) of {log} cannot be read"
    result = _refused_json(args, log, unreadable)
    assert (result["matched"], result["unreadable_records"]) == (15 - unreadable, unreadable)
    lines = [line for f in sent.iterdir() for line in f.read_text().splitlines()]
    assert (result["sent"], len(lines)) == ((0, 0) if dry_run else (15 - unreadable, 15 - unreadable))
    text = CliRunner().invoke(_cli(), args)
    assert text.exit_code == 1 and detail in text.output, text.output
    assert f"unreadable: {unreadable:,} record(s) cannot be read" in text.output, text.output


def test_a_replay_counts_the_unreadable_records_due_in_its_range_whatever_its_topic(spark: SparkSession,
                                                                                    tmp_path: Path) -> None:
    d, seg = _stored(tmp_path)
    _cut_log(seg)  # the cut record is part 0's last, due 4 minutes into the segment
    before = replay(spark, d, since_ms=PAST, until_ms=PAST + 4 * 60_000, dry_run=True, now_ms=NOW)
    assert (before.matched, before.unreadable_records, before.damaged_parts) == (4, 0, [])
    other = replay(spark, d, since_ms=PAST, until_ms=PAST + HOUR, topic="NOT_ORDERS", dry_run=True, now_ms=NOW)
    assert (other.matched, other.unreadable_records) == (0, 1)


def test_a_part_still_being_written_is_not_damage(spark: SparkSession, tmp_path: Path) -> None:
    """The current segment's part whose index runs past its log (a write in flight) is no finding,
    and neither export nor audit fails on it."""
    d, seg = _stored(tmp_path, NOW - NOW % HOUR, delivered=0)
    _cut_log(seg)
    rep = run_audit(spark, d, now_ms=NOW, grace_ms=GRACE)
    assert not rep.failed and rep.unreadable_records == 0 and rep.sample_findings == [], rep.sample_findings
    assert rep.scheduled == 14
    res = export(spark, d, tmp_path / "out", now_ms=NOW)
    assert (res.records, res.unreadable_records, res.damaged_parts) == (14, 0, [])
    dry = replay(spark, d, since_ms=NOW - NOW % HOUR, until_ms=NOW + HOUR, dry_run=True, now_ms=NOW)
    assert (dry.matched, dry.unreadable_records, dry.damaged_parts) == (14, 0, [])


def test_a_commit_in_flight_into_a_past_segment_is_not_damage(spark: SparkSession, tmp_path: Path) -> None:
    """A late message stored in a segment already past: its record is in the log before its index
    entry (and its outcome comes after both). Read between the two, the part is not damaged."""
    d, seg = _stored(tmp_path, delivered=14)
    index = seg / "00002.idx"
    os.truncate(index, index.stat().st_size - INDEX_ENTRY_SIZE)
    rep = run_audit(spark, d, now_ms=NOW, grace_ms=GRACE)
    assert not rep.failed, rep.sample_findings
    assert (rep.scheduled, rep.dispatched, rep.unreadable_records, rep.unknown_dispatch_entries) == (14, 14, 0, 0)
    assert export(spark, d, tmp_path / "out", now_ms=NOW).unreadable_records == 0


def _stray_entry(d: Path, seg_ms: int) -> None:
    """A DELIVERED entry naming an offset no record of part 0 starts at."""
    with ScheduleStore(d) as s:
        s.record_dispatch(seg_ms, dispatch_entries(np.array([0]), np.array([7]), np.array([seg_ms]), seg_ms,
                                                   DELIVERED, 1), seg_ms)


def test_dispatch_entries_naming_no_record_fail_the_audit_once_their_segment_is_settled(
        spark: SparkSession, tmp_path: Path) -> None:
    d, _ = _stored(tmp_path)
    _stray_entry(d, PAST)
    rep = run_audit(spark, d, now_ms=NOW, grace_ms=GRACE)
    assert rep.failed and (rep.unknown_dispatch_entries, rep.unknown_dispatch_entries_settled) == (1, 1)
    assert (rep.lost, rep.duplicates, rep.corrupt, rep.unreadable_records) == (0, 0, 0, 0)


def test_dispatch_entries_naming_no_record_of_the_current_segment_are_reported_only(
        spark: SparkSession, tmp_path: Path) -> None:
    current = NOW - NOW % HOUR
    d, _ = _stored(tmp_path, current, delivered=0)
    _stray_entry(d, current)
    rep = run_audit(spark, d, now_ms=NOW, grace_ms=GRACE)
    assert not rep.failed and (rep.unknown_dispatch_entries, rep.unknown_dispatch_entries_settled) == (1, 0)
    assert [f["kind"] for f in rep.sample_findings] == ["unknown_dispatch_entry"]


def test_a_part_made_after_the_audit_listed_its_segment_names_its_records(tmp_path: Path) -> None:
    """A late message stored in a new part of a past segment, and delivered, while the audit runs:
    its outcome names a record of a part the audit's plan did not list, which is no finding."""
    import pyarrow as pa

    d, _ = _stored(tmp_path)
    reader = AuditReader(str(d), {"now_ms": str(NOW), "grace_ms": str(GRACE)})
    planned = reader.partitions()
    with ScheduleStore(d) as s:
        s.append(records(1, prefix="late", start=PAST + 30_000), NOW)
        assert s.layout.list_parts(PAST) == [0, 1, 2, 3]
        ix = s.segment_index(PAST)
        late = np.flatnonzero(ix.part == 3)
        deliver(s, PAST, late, DELIVERED, NOW)
    table = pa.Table.from_batches(list(reader.read(planned[0])))
    assert sum(table.column("unknown_entries").to_pylist()) == 0


def test_the_audit_lists_sidecar_copies_a_crash_left_without_failing_or_touching_them(spark: SparkSession,
                                                                                       tmp_path: Path) -> None:
    import shutil

    d, seg = _stored(tmp_path)
    shutil.copyfile(seg / "00000.idx", seg / "00000.idx.tmp")  # a crash between the copy and its rename
    shutil.copyfile(seg / "00001.org", seg / "00001.org.tmp")
    code, doc = _audit_cli(d, tmp_path / "out")
    assert code == 0 and doc["ok"] and doc["scheduled"] == 15 and doc["dispatched"] == 15
    copies = {Path(c["path"]).name: c["plan"] for c in doc["leftover_copies"]}
    assert copies == {"00000.idx.tmp": "a copy of 00000.idx a crash left while the sidecar was being made again: "
                                       "fix=True removes it (the index is made again from the part's records "
                                       "where it falls short)",
                      "00001.org.tmp": "a copy of 00001.org a crash left while the sidecar was being made again; "
                                       "00001.org is there: fix=True removes it"}
    assert (seg / "00000.idx.tmp").exists() and (seg / "00001.org.tmp").exists(), "an audit only reads"


def test_the_audit_screen_names_each_leftover_copy_and_what_settles_it(capsys: pytest.CaptureFixture[str]) -> None:
    from spark.audit import AuditReport
    from timewheel.app._spark_printers import print_audit

    rep = AuditReport(NOW, GRACE, leftover_copies=[{"path": "seg/00000.idx.tmp", "plan": "fix=True removes it"}])
    print_audit(rep)
    out = " ".join(capsys.readouterr().out.split())
    assert "leftover copy seg/00000.idx.tmp: fix=True removes it (`timewheel inspect --fix` settles it" in out
