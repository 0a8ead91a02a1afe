"""Sealed parts: a part written whole by a writer other than the engine (Spark backfill), then
published into its segment.

Parts are staged on the data directory's filesystem under names unique to the writer (a task
attempt, say), in the engine's byte layout: records by `storage.record.encode`, index entries by
`storage.index.index_entries`, the records written before the entries that point at them.
`finish()` fsyncs the log, then the index; `SegmentLayout.publish_part` then links the index,
then the log, into the segment and fsyncs the segment directory before the staged names go, so a
crash at any point leaves either no part or a whole one. Until published, a staged part is the
writer's to remove (`PartStager.abort`).
"""
from __future__ import annotations

import os
from pathlib import Path

from storage._files import fsync_path, write_all
from storage.index import MAX_PART_BYTES, index_entries
from storage.record import Record, encode


class SealedPartWriter:
    """One staged part: records are buffered, then appended to its .log and .idx by `flush`."""

    def __init__(self, segment_ms: int, log: Path, index: Path) -> None:
        """Create both files (refused if either exists: staged names are unique to their writer)."""
        self.segment_ms = segment_ms
        self.log = log
        self.index = index
        self.records = 0
        self.size = 0
        self._blobs: list[bytes] = []
        self._dues: list[int] = []
        self._offsets: list[int] = []
        for path in (log, index):
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

    def add(self, blob: bytes, due_ms: int) -> None:
        """Append one encoded record (buffered until `flush`)."""
        if self.size + len(blob) > MAX_PART_BYTES:
            raise ValueError(f"a part holds at most {MAX_PART_BYTES} bytes (offsets are uint32): start another")
        self._blobs.append(blob)
        self._dues.append(due_ms)
        self._offsets.append(self.size)
        self.size += len(blob)
        self.records += 1

    def flush(self) -> None:
        """Write what is buffered: the records, then their index entries."""
        if not self._blobs:
            return
        entries = index_entries(self._dues, self._offsets, [len(b) for b in self._blobs])
        for path, data in ((self.log, b"".join(self._blobs)), (self.index, entries.tobytes())):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        self._blobs, self._dues, self._offsets = [], [], []

    def finish(self) -> None:
        """Flush, then fsync the log and the index: the part is ready to publish."""
        self.flush()
        fsync_path(self.log)
        fsync_path(self.index)

    def remove(self) -> None:
        """Delete the staged files (an aborted write)."""
        self.log.unlink(missing_ok=True)
        self.index.unlink(missing_ok=True)


class PartStager:
    """Encodes records into sealed parts, one open part per segment, rolled at `max_part_bytes`;
    memory stays under `buffer_bytes` however many segments are open."""

    def __init__(self, staging_dir: Path, prefix: str, segment_ms: int, enqueue_ms: int,
                 max_part_bytes: int = 1 << 30, buffer_bytes: int = 64 << 20) -> None:
        """Stage into `staging_dir`, file names starting with `prefix` (unique to the writer);
        `segment_ms` is the segment length, `enqueue_ms` the acceptance time every record gets."""
        if not 0 < max_part_bytes <= MAX_PART_BYTES:
            raise ValueError(f"max_part_bytes must be in (0, {MAX_PART_BYTES}]")
        self.dir = staging_dir
        self.prefix = prefix
        self.segment_len = segment_ms
        self.enqueue_ms = enqueue_ms
        self.max_part_bytes = max_part_bytes
        self.buffer_bytes = buffer_bytes
        self.open: dict[int, SealedPartWriter] = {}
        self.done: list[SealedPartWriter] = []
        self._n = 0
        self._buffered = 0

    def _new(self, seg: int) -> SealedPartWriter:
        """Open a new staged part for a segment."""
        self._n += 1
        stem = self.dir / f"{self.prefix}-{seg}-{self._n:05d}"
        part = self.open[seg] = SealedPartWriter(seg, stem.with_suffix(".log"), stem.with_suffix(".idx"))
        return part

    def add(self, rec: Record) -> None:
        """Encode and stage one record in its segment's part (raises InvalidRecordError)."""
        blob = encode(rec, self.enqueue_ms)
        seg = rec.due_ms - rec.due_ms % self.segment_len
        part = self.open.get(seg)
        if part is None:
            part = self._new(seg)
        elif part.size + len(blob) > self.max_part_bytes:
            part.finish()
            self.done.append(self.open.pop(seg))
            part = self._new(seg)
        part.add(blob, rec.due_ms)
        self._buffered += len(blob)
        if self._buffered >= self.buffer_bytes:
            for p in self.open.values():
                p.flush()
            self._buffered = 0

    def finish(self) -> list[SealedPartWriter]:
        """Finish every part; returns all staged parts, ready for `SegmentLayout.publish_part`."""
        for part in self.open.values():
            part.finish()
            self.done.append(part)
        self.open = {}
        return self.done

    def abort(self) -> None:
        """Remove every part staged so far."""
        for part in [*self.done, *self.open.values()]:
            part.remove()
        self.open, self.done = {}, []
