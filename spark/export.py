"""Export: segments to Parquet for analysts.

`<out>/records/segment=YYYYMMDDHHMM/*.parquet`: one row per record, every column of the
`timewheel` source plus the audit's `status` and `lateness_ms`; `<out>/dispatch/...`: one row per
dispatch-log entry. Both can be limited to the records due in [since_ms, until_ms), and the records
to one topic: those that fail their checks stay, status corrupt, as in an export of every topic
(their topic cannot be read; `spark._util.of_topic`).

Records a settled part cannot give back (`spark._damage`: the index names them past the end of the
log, or the log has no index) are not in records/; the export writes the rest and its result counts
them per part (`unreadable_records`, `damaged_parts`; whatever the topic asked for, as theirs cannot
be read), so that what it wrote is known incomplete.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession

from spark._damage import GRACE_MS, damaged_parts
from spark._util import of_topic, require_readable
from spark.audit import with_status
from storage import SegmentLayout


def export_records(records: DataFrame, *, topic: str | None = None) -> DataFrame:
    """Records (all source columns) as exported: with status and lateness, one topic (and the
    corrupt records, whose topic is unknown) when given."""
    out = with_status(records)
    return of_topic(out, topic) if topic is not None else out


@dataclass
class ExportResult:
    """Where an export went and how much it wrote."""

    records_path: str
    records: int
    dispatch_path: str | None = None
    dispatch_entries: int = 0
    unreadable_records: int = 0  # records of settled parts due in the range that could not be written
    damaged_parts: list[dict] = field(default_factory=list)  # `spark._damage.PartDamage.as_dict` of each part

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def export(spark: SparkSession, data_dir: str | Path, out_dir: str | Path, *, since_ms: int | None = None,
           until_ms: int | None = None, topic: str | None = None, dispatch: bool = True, now_ms: int | None = None,
           grace_ms: int = GRACE_MS) -> ExportResult:
    """Write records (and dispatch entries) of a data directory as Parquet under `out_dir`,
    partitioned by segment; replaces what an earlier export left there. A file it would read that
    cannot be read is refused before anything is written (`UnreadableDataError`); records that
    parts of segments ended before `now_ms - grace_ms` (now: the wall clock) cannot give back are
    counted in the result."""
    data_dir = str(data_dir)
    layout = SegmentLayout.open_existing(data_dir)
    require_readable(layout, since_ms, until_ms)  # records' outcomes included
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    damaged = damaged_parts(layout, now_ms=now, grace_ms=grace_ms, since_ms=since_ms, until_ms=until_ms)
    out = Path(out_dir)
    opts = {k: str(v) for k, v in (("since_ms", since_ms), ("until_ms", until_ms)) if v is not None}
    records = spark.read.format("timewheel").options(**opts).load(data_dir)
    rec_path = str(out / "records")
    export_records(records, topic=topic).write.mode("overwrite").partitionBy("segment").parquet(rec_path)
    result = ExportResult(rec_path, _rows(spark, rec_path), unreadable_records=sum(d.records for d in damaged),
                          damaged_parts=[d.as_dict() for d in damaged])
    if dispatch:
        entries = spark.read.format("timewheel_dispatch").options(**opts).load(data_dir)
        result.dispatch_path = str(out / "dispatch")
        entries.write.mode("overwrite").partitionBy("segment").parquet(result.dispatch_path)
        result.dispatch_entries = _rows(spark, result.dispatch_path)
    return result


def _rows(spark: SparkSession, path: str) -> int:
    """Rows of a Parquet directory just written (0 when the job wrote no file)."""
    if not any(Path(path).rglob("*.parquet")):
        return 0
    return spark.read.parquet(path).count()
