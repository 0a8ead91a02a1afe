"""`spark.read.format("timewheel_audit").options(...).load(DATA_DIR)`: the audit's cells
(`spark.schema.AUDIT_CELLS`), computed inside each partition by `spark._cells`.

One partition per part file, as the `timewheel` source; the first partition of each segment also
reports the dispatch entries naming no record (a segment with a dispatch log and no parts gets a
partition for that alone). A part of a segment that ended before `now_ms - grace_ms` also reports
the records it cannot give back (`spark._damage`). Options: `now_ms` (required), `grace_ms`
(default 300000), `bucket_ms` (default 60000), `verify` ("false" skips the CRC32C check).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from spark._util import int_option, require_readable
from spark.schema import AUDIT_CELLS

if TYPE_CHECKING:
    from storage import SegmentLayout


class AuditPartition(InputPartition):
    """One part of a segment (or none); the segment's first partition checks its dispatch entries."""

    def __init__(self, segment_ms: int, segment: str, part: tuple[int, str, str] | None, dispatch: str,
                 checks_entries: bool, settled: bool) -> None:
        """`part` is (number, log, index); `checks_entries` is set for the partition that checks the
        segment's dispatch entries for ones naming no record; `settled` when the segment ended
        before the audit's grace window (`spark._damage.settled`)."""
        super().__init__((segment_ms, part[0] if part else -1))
        self.segment_ms = segment_ms
        self.segment = segment
        self.part = part
        self.dispatch = dispatch
        self.checks_entries = checks_entries
        self.settled = settled


class AuditReader(DataSourceReader):
    """Reduces each part to its cells."""

    def __init__(self, path: str, options: dict) -> None:
        """A reader of the data directory `path`."""
        self.path = path
        now = int_option(options, "now_ms")
        if now is None:
            raise ValueError("the timewheel_audit source needs option now_ms (audit as of when)")
        self.now_ms = now
        grace = int_option(options, "grace_ms")
        self.grace_ms = 300_000 if grace is None else grace
        self.bucket_ms = int_option(options, "bucket_ms") or 60_000
        if self.bucket_ms <= 0:
            raise ValueError(f"bucket_ms must be positive, not {self.bucket_ms}")
        self.verify = str(options.get("verify", "true")).lower() != "false"

    def partitions(self) -> list[InputPartition]:
        """One partition per part; a segment with only a dispatch log gets one too. A file of them
        that cannot be read is refused here, in words naming it, before any task reads."""
        from spark._damage import settled
        from storage import SegmentLayout, segment_name

        layout = SegmentLayout.open_existing(self.path)
        require_readable(layout)
        out: list[InputPartition] = []
        for seg in layout.list_segments():
            name, dispatch = segment_name(seg), str(layout.dispatch_log(seg))
            done = settled(seg, layout.segment_ms, self.now_ms, self.grace_ms)
            parts = _parts(layout, seg)
            if not parts:
                if layout.dispatch_log(seg).exists():
                    out.append(AuditPartition(seg, name, None, dispatch, True, done))
                continue
            for i, part in enumerate(parts):
                out.append(AuditPartition(seg, name, part, dispatch, i == 0, done))
        return out

    def read(self, partition: InputPartition) -> Iterator:
        """One Arrow batch: the cells of one part (and the segment's unknown dispatch entries)."""
        if not isinstance(partition, AuditPartition):
            return iter(())  # an empty data directory: Spark asks for one partition anyway
        import numpy as np
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        from spark._cells import damage_cells, part_cells, unknown_entry_cells
        from spark._codec import PartFiles, arrow_batch
        from spark._damage import part_damage
        from storage import SegmentLayout

        pa_schema = to_arrow_schema(AUDIT_CELLS, timezone="UTC")
        pieces = []
        if partition.part is not None:
            part, log, index = partition.part
            pf = PartFiles(partition.segment_ms, partition.segment, part, log, index, partition.dispatch)
            pieces.append(part_cells(pf, bucket_ms=self.bucket_ms, now_ms=self.now_ms, grace_ms=self.grace_ms,
                                     verify=self.verify))
            damage = part_damage(partition.segment_ms, part, log, index) if partition.settled else None
            if damage is not None:
                pieces.append(damage_cells(damage))
        if partition.checks_entries:
            layout = SegmentLayout.open_existing(self.path)
            pieces.append(unknown_entry_cells(partition.dispatch, lambda: _parts(layout, partition.segment_ms)))
        out = []
        for cols in pieces:
            if not cols:
                continue
            n = len(cols["topic"])
            cols = {"segment_ms": pa.array(np.full(n, partition.segment_ms, np.int64)),
                    "segment": pa.repeat(pa.scalar(partition.segment, pa.string()), n), **cols}
            out.append(arrow_batch(cols, pa_schema))
        return iter(out)


class TimewheelAuditDataSource(DataSource):
    """The audit's cells of a timewheel data directory."""

    @classmethod
    def name(cls) -> str:
        """Format name."""
        return "timewheel_audit"

    def schema(self) -> StructType:
        """`spark.schema.AUDIT_CELLS`."""
        return AUDIT_CELLS

    def reader(self, schema: StructType) -> AuditReader:
        """A reader of every column of AUDIT_CELLS."""
        path = self.options.get("path")
        if not path:
            raise ValueError("give the data directory: .load(DATA_DIR)")
        return AuditReader(path, dict(self.options))


def _parts(layout: SegmentLayout, seg: int) -> list[tuple[int, str, str]]:
    """The parts of a segment as they are now: (number, log, index)."""
    return [(p, str(layout.part_log(seg, p)), str(layout.part_index(seg, p))) for p in layout.list_parts(seg)]
