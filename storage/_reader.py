"""The read side of the store: a segment's index over its parts, and records by location."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from storage.errors import CorruptRecordError
from storage.index import INDEX_DTYPE, read_index
from storage.layout import SegmentLayout
from storage.part import PartReader, trusted_index
from storage.record import HEADER_SIZE, Record, check_record, decode, record_length
from storage.record_reader import HEADER_DTYPE, gather_good
from storage.record_bytes import RecordBytes, gather_records


@dataclass(frozen=True, slots=True)
class SegmentIndex:
    """A segment's index over all its parts, concatenated in (part, offset) order."""

    segment_ms: int
    due_ms: np.ndarray
    part: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    part_ranges: list[tuple[int, int, int]]  # (part, start, end) rows of each part, in order

    def __len__(self) -> int:
        return len(self.due_ms)

    def keys(self) -> np.ndarray:
        """part << 32 | offset: sorted ascending, unique per record."""
        return (self.part.astype(np.uint64) << np.uint64(32)) | self.offset.astype(np.uint64)


def segment_index(layout: SegmentLayout, segment_ms: int, parts: Sequence[int] | None = None) -> SegmentIndex:
    """The index of a segment (or of some of its parts), as far as it agrees with the logs
    (`trusted_index`)."""
    chunks, part_ids, bounds = [], [], []
    n = 0
    for part in (layout.list_parts(segment_ms) if parts is None else parts):
        idx_path = layout.part_index(segment_ms, part)
        if not idx_path.exists():
            continue  # a part being published, or one recovery has not indexed yet
        idx = trusted_index(layout.part_log(segment_ms, part), read_index(idx_path))
        chunks.append(idx)
        part_ids.append(np.full(len(idx), part, np.uint16))
        bounds.append((part, n, n + len(idx)))
        n += len(idx)
    if not chunks:
        e = np.empty(0, INDEX_DTYPE)
        return SegmentIndex(segment_ms, e["due_ms"], np.empty(0, np.uint16), e["offset"], e["length"], [])
    idx = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    part_arr = part_ids[0] if len(part_ids) == 1 else np.concatenate(part_ids)
    return SegmentIndex(segment_ms, idx["due_ms"], part_arr, idx["offset"], idx["length"], bounds)


class RecordReader:
    """Decodes records by (segment, part, offset) through one read-only map per part."""

    def __init__(self, layout: SegmentLayout) -> None:
        self.layout = layout
        self._readers: dict[tuple[int, int], PartReader] = {}
        self._lock = threading.Lock()
        self.corrupt_found = 0

    def read(self, segment_ms: Sequence[int], parts: Sequence[int], offsets: Sequence[int],
             due_ms: Sequence[int] | None = None) -> list[Record | CorruptRecordError]:
        """Decode many records; a corrupt one yields its error in its place (and is counted).

        With `due_ms` (what the index said), a record whose own CRC-checked due time differs is
        corrupt too: an index entry is never trusted to serve a record at another time.
        """
        out: list[Record | CorruptRecordError] = []
        dues: Sequence[int | None] = [None] * len(offsets) if due_ms is None else due_ms
        with self._lock:
            reader = None
            last_key = None
            for seg, part, off, due in zip(segment_ms, parts, offsets, dues, strict=True):
                key = (seg, part)
                try:
                    if key != last_key:
                        reader = self._reader_locked(seg, part)
                        last_key = key
                    assert reader is not None
                    view = reader.view(off + HEADER_SIZE)
                    length = record_length(view, off)  # type: ignore[arg-type]  # an mmap is a buffer
                    if off + length > len(view):
                        view = reader.view(off + length)
                    out.append(decode(view, off, due_ms=due)[0])  # type: ignore[arg-type]
                except (CorruptRecordError, OSError) as e:
                    self.corrupt_found += 1
                    reason = e.reason if isinstance(e, CorruptRecordError) else f"cannot read: {e}"
                    err = CorruptRecordError(reason, offset=off, path=str(self.layout.part_log(seg, part)),
                                             record_due_ms=e.record_due_ms if isinstance(e, CorruptRecordError) else None)
                    err.__cause__ = e
                    out.append(err)
            self._trim_locked()
        return out

    def _reader_locked(self, seg: int, part: int) -> PartReader:
        """The part's reader, opened if it is not (under the lock)."""
        reader = self._readers.get((seg, part))
        if reader is None:
            reader = self._readers[(seg, part)] = PartReader(self.layout.part_log(seg, part))
        return reader

    def _trim_locked(self) -> None:
        """Past `_MAX_READERS`, close the readers opened first (under the lock, no view of them held)."""
        while len(self._readers) > _MAX_READERS:
            self._readers.pop(next(iter(self._readers))).close()

    def read_bytes(self, segment_ms: np.ndarray, parts: np.ndarray, offsets: np.ndarray,
                   due_ms: np.ndarray | None = None) -> RecordBytes:
        """Many records as checked bytes (`RecordBytes`), rows aligned with the arguments; corrupt
        rows are counted and carry their error, as in `read`."""
        n = len(offsets)
        combined = np.asarray(segment_ms, np.int64) * 65536 + np.asarray(parts, np.int64)
        offsets = np.asarray(offsets)
        if n:
            # the compiled read first, however few the rows: one call beats a row's Python checks
            good = self._read_good(combined, offsets, due_ms)
            if good is not None:
                return good
            if n <= _FEW_ROWS:  # without it (not built, or the part not mapped yet), a few row by row
                few = self._read_few(segment_ms, parts, offsets, due_ms)
                if few is not None:
                    return few
        unreadable: dict[int, CorruptRecordError] = {}
        with self._lock:
            buffers = []
            for pair, rows in _by_part(combined):
                seg, part = divmod(pair, 65536)
                offs = offsets[rows]
                try:
                    reader = self._reader_locked(seg, part)
                    # records past its end are found corrupt row by row; the others still serve
                    buffers.append((memoryview(reader.covering(offs)), rows, offs))
                except (CorruptRecordError, OSError) as e:
                    reason = e.reason if isinstance(e, CorruptRecordError) else f"cannot read: {e}"
                    for r, o in zip(rows.tolist(), offs.tolist()):
                        err = CorruptRecordError(reason, offset=o, path=str(self.layout.part_log(seg, part)))
                        err.__cause__ = e
                        unreadable[r] = err
            try:
                got = gather_records(buffers, n, None if due_ms is None else np.asarray(due_ms, np.int64))
            finally:
                for mv, _, _ in buffers:
                    mv.release()
                buffers.clear()
                self._trim_locked()
            for r, found in list(got.errors.items()):  # name the part, as `read` does
                seg, part = divmod(int(combined[r]), 65536)
                got.errors[r] = CorruptRecordError(found.reason, offset=found.offset,
                                                   path=str(self.layout.part_log(seg, part)),
                                                   record_due_ms=found.record_due_ms)
            got.errors.update(unreadable)
            self.corrupt_found += len(got.errors)
        return got

    def _read_good(self, combined: np.ndarray, offsets: np.ndarray, due_ms: np.ndarray | None) -> RecordBytes | None:
        """`read_bytes` of good records of one part already mapped far enough, in one compiled call
        (`gather_good`: the usual send batch); None when the general path must decide."""
        first = int(combined[0])
        if not _one_value(combined, first):
            return None
        with self._lock:
            reader = self._readers.get(divmod(first, 65536))
            m = reader.current() if reader is not None else None
            if m is None:
                return None
            with memoryview(m) as mv:  # released before the map may be remapped
                got = gather_good(mv, offsets, due_ms)
        if got is None:
            return None
        data, starts, header = got
        return RecordBytes(data, starts, header, np.ones(len(starts), bool), {})

    def _read_few(self, segment_ms: np.ndarray, parts: np.ndarray, offsets: np.ndarray,
                  due_ms: np.ndarray | None) -> RecordBytes | None:
        """`read_bytes` of a few good records of one part already opened, row by row (`check_record`
        on each: the numpy calls of the column path would cost more than the rows), where the
        compiled read (`_read_good`) did not take them; None when the column path must decide
        (several parts, a part not opened yet, a record past the part's end or not good: it then
        finds and names what is wrong)."""
        segs, ps, offs = np.asarray(segment_ms).tolist(), np.asarray(parts).tolist(), np.asarray(offsets).tolist()
        key = (segs[0], ps[0])
        if segs.count(key[0]) != len(segs) or ps.count(key[1]) != len(ps):
            return None
        dues: list[int | None] = [None] * len(offs) if due_ms is None else np.asarray(due_ms).tolist()
        with self._lock:
            reader = self._readers.get(key)
            if reader is None:
                return None
            try:
                m = reader.covering_few(offs)
                heads = [check_record(m, o, due_ms=d) for o, d in zip(offs, dues)]  # type: ignore[arg-type]
            except (CorruptRecordError, OSError):
                return None
            data = b"".join([m[o:o + h[_LENGTH_FIELD]] for o, h in zip(offs, heads)])
        starts, at = [], 0
        for h in heads:
            starts.append(at)
            at += h[_LENGTH_FIELD]
        return RecordBytes(data, np.array(starts, np.int64), np.array(heads, HEADER_DTYPE),
                           np.ones(len(heads), bool), {})

    def release(self, segment_ms: int) -> None:
        """Drop the read maps of a segment."""
        with self._lock:
            for key in [k for k in self._readers if k[0] == segment_ms]:
                self._readers.pop(key).close()

    def close(self) -> None:
        """Unmap everything."""
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()


#: up to this many rows, of one part, are read one by one (`RecordReader._read_few`)
_FEW_ROWS = 4
#: parts mapped for reading at most; past it the first opened is closed (and opened again if read
#: again). A segment's maps go when it leaves memory: these bound the rest, parts read without
#: their segment being loaded (a cancel's look-up of a message already delivered, a catch-up)
_MAX_READERS = 256
#: up to this many rows a check of every one is a Python list's, not an array's (no array work)
_SCALAR_ROWS = 16
#: where the record's length is in `check_record`'s header fields
_LENGTH_FIELD = list(HEADER_DTYPE.fields or ()).index("length")


def _by_part(combined: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The distinct values of `combined` (segment << 16 | part), each with the rows holding it."""
    first = int(combined[0]) if len(combined) else 0
    if not len(combined) or _one_value(combined, first):  # one part: the usual send batch
        return [(first, np.arange(len(combined)))] if len(combined) else []
    pairs, inverse = np.unique(combined, return_inverse=True)
    return [(pair, np.flatnonzero(inverse == k)) for k, pair in enumerate(pairs.tolist())]


def _one_value(values: np.ndarray, first: int) -> bool:
    """Whether every element of a 1-d array is `first` (a few: no array work)."""
    if len(values) <= _SCALAR_ROWS:
        return values.tolist().count(first) == len(values)
    return bool((values == first).all())
