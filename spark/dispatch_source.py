"""`spark.read.format("timewheel_dispatch").load(DATA_DIR)`: one row per dispatch-log entry.

One partition per segment's dispatch log, read by `storage.read_dispatch_log` (frames whose CRC
fails, and a torn tail, are skipped as the engine skips them). Columns: `spark.schema.DISPATCH`, or a
subset given with `.schema(...)`. Options `since_ms`, `until_ms` keep the segments overlapping
[since_ms, until_ms) and the entries due in it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from spark.schema import DISPATCH, require_subset
from spark._util import int_option, require_readable

if TYPE_CHECKING:
    import numpy as np


class DispatchLogPartition(InputPartition):
    """The dispatch log of one segment."""

    def __init__(self, segment_ms: int, segment: str, path: str, parts: list[tuple[int, str, str]]) -> None:
        """One segment's dispatch log, and its parts."""
        super().__init__(segment_ms)
        self.segment_ms = segment_ms
        self.segment = segment
        self.path = path
        self.parts = parts  # (part, log, index) of the segment, for record_exists


class DispatchReader(DataSourceReader):
    """Reads each segment's dispatch log into Arrow batches."""

    def __init__(self, path: str, schema: StructType, options: dict) -> None:
        """A reader of `schema`'s columns of the data directory `path`."""
        self.path = path
        self.schema = schema
        self.columns = require_subset(schema, DISPATCH, "the timewheel_dispatch source")
        self.since_ms = int_option(options, "since_ms")
        self.until_ms = int_option(options, "until_ms")

    def partitions(self) -> list[InputPartition]:
        """One partition per segment that has a dispatch log; a file of them that cannot be read is
        refused here, in words naming it, before any task reads."""
        from storage import SegmentLayout, segment_name

        layout = SegmentLayout.open_existing(self.path)
        require_readable(layout, self.since_ms, self.until_ms, logs=False)  # entries checked against the indexes
        out: list[InputPartition] = []
        for seg in layout.list_segments(self.since_ms, self.until_ms):
            path = layout.dispatch_log(seg)
            if path.exists():
                parts = [(p, str(layout.part_log(seg, p)), str(layout.part_index(seg, p)))
                         for p in layout.list_parts(seg)]
                out.append(DispatchLogPartition(seg, segment_name(seg), str(path), parts))
        return out

    def read(self, partition: InputPartition) -> Iterator:
        """Arrow batches of one dispatch log."""
        if not isinstance(partition, DispatchLogPartition):
            return iter(())
        import numpy as np
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        from spark._codec import arrow_batch, segment_identity
        from storage import OUTCOME_NAMES, read_dispatch_log

        segment = segment_identity(partition.path)
        entries = read_dispatch_log(partition.path).entries
        if self.since_ms is not None:
            entries = entries[entries["due_ms"] >= self.since_ms]
        if self.until_ms is not None:
            entries = entries[entries["due_ms"] < self.until_ms]
        pa_schema = to_arrow_schema(self.schema, timezone="UTC")
        names = pa.array([OUTCOME_NAMES.get(i, f"unknown_{i}") for i in range(256)], pa.string())
        exists = _record_exists(partition.parts, entries) if "record_exists" in self.columns else None
        if exists is not None and (segment is None or segment_identity(partition.path) != segment):
            return iter(())  # retired meanwhile: its parts may have gone after its dispatch log was read

        def batches() -> Iterator[pa.RecordBatch]:
            """The entries in batches of a million rows."""
            step = 1 << 20
            for start in range(0, len(entries), step):
                e = entries[start:start + step]
                n = len(e)
                cols = {
                    "segment_ms": pa.array(np.full(n, partition.segment_ms, np.int64)),
                    "segment": pa.repeat(pa.scalar(partition.segment, pa.string()), n),
                    "part": pa.array(e["part"].astype(np.int32)),
                    "offset": pa.array(e["offset"].astype(np.int64)),
                    "due_ms": pa.array(e["due_ms"].astype(np.int64)),
                    "dispatch_ms": pa.array(e["dispatch_ms"].astype(np.int64)),
                    "attempts": pa.array(e["attempts"].astype(np.int32)),
                    "outcome": pa.array(e["outcome"].astype(np.int32)),
                }
                if "outcome_name" in self.columns:
                    cols["outcome_name"] = names.take(pa.array(e["outcome"].astype(np.int32)))
                if exists is not None:
                    cols["record_exists"] = pa.array(exists[start:start + step])
                yield arrow_batch({c: cols[c] for c in self.columns}, pa_schema)

        return batches()


def _record_exists(parts: list[tuple[int, str, str]], entries: np.ndarray) -> np.ndarray:
    """Whether each entry's (part, offset) is a record in the segment's indexes (entries past the
    end of a part's log excluded, as readers exclude them)."""
    from storage.audit import known_keys, outcomes_of

    return outcomes_of(known_keys(parts), entries).entry_hit


class TimewheelDispatchDataSource(DataSource):
    """The dispatch logs of a timewheel data directory."""

    @classmethod
    def name(cls) -> str:
        """Format name."""
        return "timewheel_dispatch"

    def schema(self) -> StructType:
        """Every column of `spark.schema.DISPATCH`."""
        return DISPATCH

    def reader(self, schema: StructType) -> DispatchReader:
        """A reader of the columns in `schema` (a subset of DISPATCH)."""
        path = self.options.get("path")
        if not path:
            raise ValueError("give the data directory: .load(DATA_DIR)")
        return DispatchReader(path, schema, dict(self.options))
