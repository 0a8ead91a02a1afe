"""Records read as their stored bytes, for senders that re-encode them without a Python object each.

`RecordBytes` holds many records, CRC-checked, one after another in one `bytes` buffer, and
numpy columns with each record's header fields and where each field starts in the buffer (the
layout of `storage.record`: id, topic, tags, keys, properties, body, in that order). The records
are checked by `storage.record_reader.check_records` (the one reader of the layout); a record found
corrupt is absent from the buffer: `ok` is False in its row and `errors` says why.

Decoding one record back into a `Record` (`record(i)`) is for the rare paths (dead letters,
records with properties); the hot path slices the buffer by the columns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from storage.errors import CorruptRecordError
from storage.record import Record, decode, decode_keys
from storage.record_reader import HEADER_DTYPE, check_records, field_starts

__all__ = ["HEADER_DTYPE", "RecordBytes", "gather_records"]


@dataclass(frozen=True, slots=True)
class RecordBytes:
    """Records as stored, one after another in `data`; per row, its header and where it starts."""

    data: bytes
    start: np.ndarray  # int64: where each good record starts in `data` (-1 for a corrupt row)
    header: np.ndarray  # HEADER_DTYPE per row (zeros for a corrupt row)
    ok: np.ndarray  # bool per row
    errors: dict[int, CorruptRecordError] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.start)

    def field_starts(self) -> tuple[np.ndarray, ...]:
        """Starts in `data` of each row's id, topic, tags, keys, properties and body (int64 arrays)."""
        return field_starts(self.start, self.header)

    def topics(self) -> list[str]:
        """Each good row's target topic (a handful of distinct topics: each decoded once)."""
        _, at, *_ = self.field_starts()
        mv = memoryview(self.data)
        known: dict[bytes, str] = {}
        out: list[str] = []
        for a, n in zip(at.tolist(), self.header["topic_len"].tolist()):
            b = mv[a:a + n].tobytes()
            t = known.get(b)
            if t is None:
                t = known[b] = b.decode("utf-8", "replace")
            out.append(t)
        return out

    def ids_and_keys(self) -> tuple[list[str], list[tuple[str, ...]]]:
        """Each row's id and business keys (good rows only), without decoding the rest of it."""
        ids_at, _, _, keys_at, *_ = self.field_starts()
        mv = memoryview(self.data)
        ids = [str(mv[a:a + n], "utf-8") for a, n in zip(ids_at.tolist(), self.header["id_len"].tolist())]
        keys = [decode_keys(mv[a:a + n], a) if n else () for a, n in
                zip(keys_at.tolist(), self.header["keys_len"].tolist())]
        return ids, keys

    def record(self, i: int) -> Record:
        """Row `i` decoded (a good row only)."""
        s = int(self.start[i])
        return decode(memoryview(self.data)[s:s + int(self.header["length"][i])])[0]

    @staticmethod
    def concat(parts: list["RecordBytes"]) -> "RecordBytes":
        """The rows of several, in order, in one compact buffer (only the rows' own bytes are copied)."""
        slices: list[memoryview] = []
        starts: list[np.ndarray] = []
        errors: dict[int, CorruptRecordError] = {}
        base = rows_before = 0
        for rb in parts:
            mv = memoryview(rb.data)
            lengths = rb.header["length"].astype(np.int64)
            new_start = np.full(len(rb), -1, np.int64)
            good = np.flatnonzero(rb.ok)
            new_start[good] = base + np.cumsum(lengths[good]) - lengths[good]
            for s, ln in zip(rb.start[good].tolist(), lengths[good].tolist()):
                slices.append(mv[s:s + ln])
            base += int(lengths[good].sum())
            errors.update({k + rows_before: e for k, e in rb.errors.items()})
            rows_before += len(rb)
            starts.append(new_start)
        return RecordBytes(b"".join(slices), np.concatenate(starts), np.concatenate([p.header for p in parts]),
                           np.concatenate([p.ok for p in parts]), errors)

    def select(self, idx: np.ndarray) -> "RecordBytes":
        """The rows at `idx` (the buffer is shared, not copied)."""
        errors = {} if not self.errors else {
            j: e for j, e in ((j, self.errors.get(i)) for j, i in enumerate(idx.tolist())) if e is not None}
        return RecordBytes(self.data, self.start[idx], self.header[idx], self.ok[idx], errors)


def gather_records(buffers: list[tuple[memoryview, np.ndarray, np.ndarray]], n: int,
                   due_ms: np.ndarray | None) -> RecordBytes:
    """Check and copy out records: per part, its mapped bytes, the rows it serves and their offsets;
    `due_ms` (per row) is what the index says."""
    if len(buffers) == 1 and len(buffers[0][1]) == n:  # one part serves every row (rows 0..n-1)
        return _one_part(buffers[0][0], buffers[0][2], due_ms)
    header = np.zeros(n, HEADER_DTYPE)
    ok = np.zeros(n, bool)
    errors: dict[int, CorruptRecordError] = {}
    slices: list[memoryview] = []
    rows_in_order: list[np.ndarray] = []
    for mv, rows, offsets in buffers:
        c = check_records(mv, offsets, due_ms=None if due_ms is None else due_ms[rows])
        header[rows] = c.header
        ok[rows] = c.ok
        if c.errors:
            rows_l = rows.tolist()
            errors.update({rows_l[k]: e for k, e in c.errors.items()})
        for o, ln in zip(c.offset[c.ok].tolist(), c.header["length"][c.ok].tolist()):
            slices.append(mv[o:o + ln])
        rows_in_order.append(rows[c.ok])
    data = b"".join(slices)
    slices.clear()
    start = np.full(n, -1, np.int64)
    if rows_in_order:
        order = np.concatenate(rows_in_order)
        lengths = header["length"][order].astype(np.int64)
        start[order] = np.cumsum(lengths) - lengths
    return RecordBytes(data, start, header, ok, errors)


def _one_part(mv: memoryview, offsets: np.ndarray, due_ms: np.ndarray | None) -> RecordBytes:
    """`gather_records` of rows all in one part (the usual send batch): fewer numpy calls."""
    c = check_records(mv, offsets, due_ms=due_ms)
    header, ok, errors = c.header, c.ok, c.errors
    good = c.offset.tolist() if not errors else c.offset[ok].tolist()
    lens = header["length"].tolist() if not errors else header["length"][ok].tolist()
    data = b"".join([mv[o:o + ln] for o, ln in zip(good, lens)])
    start = np.cumsum(header["length"], dtype=np.int64)
    start -= header["length"]
    if errors:
        start[~ok] = -1
    return RecordBytes(data, start, header, ok, errors)
