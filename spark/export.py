"""Export: segments to Parquet for analysts.

`<out>/records/segment=YYYYMMDDHHMM/*.parquet`: one row per record, every column of the
`timewheel` source plus the audit's `status` and `lateness_ms`; `<out>/dispatch/...`: one row per
dispatch-log entry. Both can be limited to the records due in [since_ms, until_ms), and the records
to one topic.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark._util import require_readable
from spark.audit import with_status
from storage import SegmentLayout


def export_records(records: DataFrame, *, topic: str | None = None) -> DataFrame:
    """Records (all source columns) as exported: with status and lateness, one topic when given."""
    out = with_status(records)
    return out.where(F.col("topic") == topic) if topic is not None else out


@dataclass
class ExportResult:
    """Where an export went and how much it wrote."""

    records_path: str
    records: int
    dispatch_path: str | None = None
    dispatch_entries: int = 0

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def export(spark: SparkSession, data_dir: str | Path, out_dir: str | Path, *, since_ms: int | None = None,
           until_ms: int | None = None, topic: str | None = None, dispatch: bool = True) -> ExportResult:
    """Write records (and dispatch entries) of a data directory as Parquet under `out_dir`,
    partitioned by segment; replaces what an earlier export left there. A file it would read that
    cannot be read is refused before anything is written (`UnreadableDataError`)."""
    data_dir = str(data_dir)
    require_readable(SegmentLayout.open_existing(data_dir), since_ms, until_ms)  # records' outcomes included
    out = Path(out_dir)
    opts = {k: str(v) for k, v in (("since_ms", since_ms), ("until_ms", until_ms)) if v is not None}
    records = spark.read.format("timewheel").options(**opts).load(data_dir)
    rec_path = str(out / "records")
    export_records(records, topic=topic).write.mode("overwrite").partitionBy("segment").parquet(rec_path)
    result = ExportResult(rec_path, _rows(spark, rec_path))
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
