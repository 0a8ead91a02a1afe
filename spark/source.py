"""`spark.read.format("timewheel").load(DATA_DIR)`: one row per stored record; and the backfill writer.

Reading: one partition per part file; rows come as Arrow batches decoded in bulk (see
`spark._codec`), with what the segment's dispatch log says of each record (counts per outcome,
first delivery). Give `.schema(...)` a subset of `spark.schema.RECORDS` to decode only those
columns (the audit reads no bodies). Options:

    since_ms, until_ms   only records due in [since_ms, until_ms) (parts of other segments are not
                         even opened; records are picked from the index before any is decoded)
    verify               "false" skips the CRC32C check (header checks still apply)

Writing (`df.write.format("timewheel").mode("append").save(DATA_DIR)`): rows of
`spark.schema.BACKFILL_INPUT`, already validated and deduplicated (see `spark.backfill`). Each task
stages its rows through `storage.PartStager` under `<data_dir>/_staging/<job>/`, named by the task attempt
(a failed attempt removes its own);
`commit()` in the driver publishes them with `SegmentLayout.publish_part`, `abort()` removes them.
Options: `job` (names the staging directory), `enqueue_ms`, `report` (a JSON file `commit()`
writes: the parts published).
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceReader, InputPartition, \
    WriterCommitMessage
from pyspark.sql.types import StructType

from spark._util import int_option, require_readable
from spark.schema import BACKFILL_INPUT, BACKFILL_PLAN, RECORDS, require_subset

STAGING_DIR = "_staging"


class PartPartition(InputPartition):
    """One part file of one segment."""

    def __init__(self, segment_ms: int, segment: str, part: int, log: str, index: str, dispatch: str) -> None:
        """One part: its segment, number, files and the segment's dispatch log."""
        super().__init__((segment_ms, part))
        self.segment_ms = segment_ms
        self.segment = segment
        self.part = part
        self.log = log
        self.index = index
        self.dispatch = dispatch


class RecordReader(DataSourceReader):
    """Lists the parts of the wanted segments; decodes one part per partition."""

    def __init__(self, path: str, schema: StructType, options: dict) -> None:
        """A reader of `schema`'s columns of the data directory `path`."""
        self.path = path
        self.schema = schema
        self.columns = require_subset(schema, RECORDS, "the timewheel source")
        self.since_ms = int_option(options, "since_ms")
        self.until_ms = int_option(options, "until_ms")
        self.verify = str(options.get("verify", "true")).lower() != "false"

    def partitions(self) -> list[InputPartition]:
        """One partition per part of every segment overlapping [since_ms, until_ms); a file of them
        that cannot be read is refused here, in words naming it, before any task reads."""
        from storage import SegmentLayout, segment_name

        layout = SegmentLayout.open_existing(self.path)
        from spark._codec import OUTCOME_COLUMNS

        # the dispatch logs are read for the outcome columns only (`read_part`)
        outcomes = any(c in OUTCOME_COLUMNS or c == "first_delivered_ms" for c in self.columns)
        require_readable(layout, self.since_ms, self.until_ms, dispatch=outcomes)
        out: list[InputPartition] = []
        for seg in layout.list_segments(self.since_ms, self.until_ms):
            name = segment_name(seg)
            for part in layout.list_parts(seg):
                out.append(PartPartition(seg, name, part, str(layout.part_log(seg, part)),
                                         str(layout.part_index(seg, part)), str(layout.dispatch_log(seg))))
        return out

    def read(self, partition: InputPartition) -> Iterator:
        """Arrow batches of one part's records."""
        if not isinstance(partition, PartPartition):
            return iter(())  # an empty data directory: Spark asks for one partition anyway
        from pyspark.sql.pandas.types import to_arrow_schema

        from spark._codec import PartFiles, arrow_batch, read_part

        pa_schema = to_arrow_schema(self.schema, timezone="UTC")
        pf = PartFiles(partition.segment_ms, partition.segment, partition.part, partition.log, partition.index,
                       partition.dispatch)
        return (arrow_batch(cols, pa_schema)
                for cols in read_part(pf, self.columns, since_ms=self.since_ms, until_ms=self.until_ms,
                                      verify=self.verify))


@dataclass
class StagedParts(WriterCommitMessage):
    """What one task staged: (segment_ms, log path, index path, records) per part, and its counts."""

    parts: list[tuple[int, str, str, int]]
    counts: dict[str, int]


class BackfillWriter(DataSourceArrowWriter):
    """Stages sealed parts per task attempt; publishes them all in `commit()`."""

    def __init__(self, path: str, job: str, enqueue_ms: int, report: str | None, max_part_bytes: int) -> None:
        """A writer of job `job` into the data directory `path`."""
        from storage import SegmentLayout

        self.path = path
        self.segment_ms = SegmentLayout.open_existing(path).segment_ms
        self.job = job
        self.enqueue_ms = enqueue_ms
        self.report = report
        self.max_part_bytes = max_part_bytes

    @property
    def staging(self) -> Path:
        """This job's staging directory, inside the data directory (same filesystem: links work)."""
        return Path(self.path) / STAGING_DIR / self.job

    def write(self, iterator: Iterator) -> StagedParts:
        """Encode this task's rows into staged parts named after the task attempt."""
        from pyspark import TaskContext

        from spark._codec import stage_batch
        from storage import PartStager

        ctx = TaskContext.get()
        attempt = f"t{ctx.partitionId()}-a{ctx.attemptNumber()}-{ctx.taskAttemptId()}" if ctx else uuid.uuid4().hex
        self.staging.mkdir(parents=True, exist_ok=True)
        stager = PartStager(self.staging, attempt, self.segment_ms, self.enqueue_ms, self.max_part_bytes)
        counts = {"written": 0, "existing": 0, "duplicates": 0}
        try:
            for batch in iterator:
                stage_batch(stager, batch, counts)
            parts = [(p.segment_ms, str(p.log), str(p.index), p.records) for p in stager.finish() if p.records]
        except BaseException:
            stager.abort()  # a retried attempt stages under its own names; this one's are never published
            raise
        return StagedParts(parts, counts)

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        """Publish every staged part into its segment, oldest segment first, then report them."""
        from storage import SegmentLayout, segment_name

        layout = SegmentLayout.open_existing(self.path)
        done = [m for m in messages if isinstance(m, StagedParts)]
        staged = sorted(p for m in done for p in m.parts)
        counts = {k: sum(m.counts.get(k, 0) for m in done) for k in ("written", "existing", "duplicates")}
        published = []
        for seg, log, idx, records in staged:
            part = layout.publish_part(seg, Path(log), Path(idx))
            published.append({"segment_ms": seg, "segment": segment_name(seg), "part": part, "records": records})
        shutil.rmtree(self.staging, ignore_errors=True)
        _remove_if_empty(self.staging.parent)
        if self.report:
            tmp = Path(self.report + ".tmp")
            tmp.write_text(json.dumps({"job": self.job, "counts": counts, "parts": published}))
            os.replace(tmp, self.report)

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        """Remove everything this job staged; nothing was published."""
        shutil.rmtree(self.staging, ignore_errors=True)
        _remove_if_empty(self.staging.parent)


def _remove_if_empty(path: Path) -> None:
    """Remove a directory if nothing is left in it."""
    try:
        path.rmdir()
    except OSError:
        pass


class TimewheelDataSource(DataSource):
    """The records of a timewheel data directory (read), and backfill into it (write, append only)."""

    @classmethod
    def name(cls) -> str:
        """Format name."""
        return "timewheel"

    def _path(self) -> str:
        """The data directory given to load() or save()."""
        path = self.options.get("path")
        if not path:
            raise ValueError("give the data directory: .load(DATA_DIR) or .save(DATA_DIR)")
        return path

    def schema(self) -> StructType:
        """Every column of `spark.schema.RECORDS`."""
        return RECORDS

    def reader(self, schema: StructType) -> RecordReader:
        """A reader of the columns in `schema` (a subset of RECORDS)."""
        return RecordReader(self._path(), schema, dict(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> BackfillWriter:
        """A backfill writer; refuses overwrite (scheduled messages are never replaced)."""
        if overwrite:
            raise ValueError("the timewheel source only appends: use mode('append')")
        require_subset(schema, BACKFILL_PLAN, "a backfill")
        missing = {f.name for f in BACKFILL_INPUT.fields} - set(schema.fieldNames())
        if missing:
            raise ValueError(f"a backfill needs columns {sorted(missing)}")
        enqueue = int_option(dict(self.options), "enqueue_ms")
        if enqueue is None:
            import time

            enqueue = time.time_ns() // 1_000_000
        max_part = int_option(dict(self.options), "max_part_bytes") or (1 << 30)
        return BackfillWriter(self._path(), self.options.get("job") or uuid.uuid4().hex, enqueue,
                              self.options.get("report"), max_part)
