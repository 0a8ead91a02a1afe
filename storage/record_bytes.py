"""Records read as their stored bytes, for senders that re-encode them without a Python object each.

`RecordBytes` holds many records, CRC-checked, one after another in one `bytes` buffer, and
numpy columns with each record's header fields and where each field starts in the buffer (the
layout of `storage.record`: id, topic, tags, keys, properties, body, in that order). A record
found corrupt (bad magic, version, flags, length, CRC, field lengths, or a due time other than
the index's) is absent from the buffer: `ok` is False in its row and `errors` says why.

Decoding one record back into a `Record` (`record(i)`) is for the rare paths (dead letters,
records with properties); the hot path slices the buffer by the columns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from storage.errors import CorruptRecordError
from storage.record import HEADER_SIZE, MAGIC, MAX_BODY, MAX_PROPERTIES, MAX_RECORD, VERSION, Record, decode, crc32c

__all__ = ["HEADER_DTYPE", "RecordBytes", "gather_records"]

#: the record header (`storage.record.HEADER`) as a numpy structured type
HEADER_DTYPE = np.dtype([("magic", "u1"), ("version", "u1"), ("flags", "<u2"), ("length", "<u4"), ("crc", "<u4"),
                         ("due_ms", "<i8"), ("enqueue_ms", "<i8"), ("id_len", "<u2"), ("topic_len", "<u2"),
                         ("tags_len", "<u2"), ("keys_len", "<u2"), ("props_len", "<u4"), ("body_len", "<u4")])
assert HEADER_DTYPE.itemsize == HEADER_SIZE
_CRC_FROM = 12
_HEADER_COLUMNS = np.arange(HEADER_SIZE, dtype=np.int64)


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
        h = self.header
        ids = self.start + HEADER_SIZE
        topics = ids + h["id_len"]
        tags = topics + h["topic_len"]
        keys = tags + h["tags_len"]
        props = keys + h["keys_len"]
        body = props + h["props_len"]
        return ids, topics, tags, keys, props, body

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
    """Check and copy out records: per part, its mapped bytes, the rows it serves and their offsets.

    Header fields are read for all rows at once; only the CRC is one call per record.
    """
    header = np.zeros(n, HEADER_DTYPE)
    ok = np.zeros(n, bool)
    errors: dict[int, CorruptRecordError] = {}
    slices: list[memoryview] = []
    rows_in_order: list[np.ndarray] = []
    for mv, rows, offsets in buffers:
        size = len(mv)
        offs = offsets.astype(np.int64)
        fits = offs + HEADER_SIZE <= size
        for r, o in zip(rows[~fits].tolist(), offs[~fits].tolist()):
            errors[r] = CorruptRecordError(f"{max(0, size - o)} bytes left, a header needs {HEADER_SIZE}", offset=o)
        rows, offs = rows[fits], offs[fits]
        raw = np.frombuffer(mv, np.uint8)
        h = raw[offs[:, None] + _HEADER_COLUMNS].view(HEADER_DTYPE).reshape(len(offs))
        # where each record's keys start, and whether they are one key (its uint16 length first): the
        # usual case, checked here like the text fields; several keys or properties go to the decoder
        keys_at = offs + HEADER_SIZE + h["id_len"] + h["topic_len"] + h["tags_len"]
        keys_len = h["keys_len"].astype(np.int64)
        first = np.minimum(keys_at, max(0, size - 2))
        one_key = (keys_len >= 2) & ((raw[first].astype(np.int64) | raw[first + 1].astype(np.int64) << 8)
                                     == keys_len - 2)
        del raw, first
        length = h["length"].astype(np.int64)
        fields = (HEADER_SIZE + h["id_len"].astype(np.int64) + h["topic_len"] + h["tags_len"] + h["keys_len"]
                  + h["props_len"] + h["body_len"])
        good = ((h["magic"] == MAGIC) & (h["version"] == VERSION) & (h["flags"] == 0) & (length >= HEADER_SIZE)
                & (length <= MAX_RECORD) & (offs + length <= size) & (fields == length)
                & (h["props_len"] <= MAX_PROPERTIES) & (h["body_len"] <= MAX_BODY))
        if due_ms is not None:
            good &= h["due_ms"] == due_ms[rows]
        for r, o in zip(rows[~good].tolist(), offs[~good].tolist()):
            errors[r] = _why(mv, o, None if due_ms is None else int(due_ms[r]))
        rows, offs, h, length = rows[good], offs[good], h[good], length[good]
        one_key, keys_len = one_key[good], keys_len[good]
        crcs = h["crc"].tolist()
        text_end = (HEADER_SIZE + h["id_len"].astype(np.int64) + h["topic_len"] + h["tags_len"]).tolist()
        nested = (((keys_len > 0) & ~one_key) | (h["props_len"] > 0)).tolist()
        key_end = [t + k if k else 0 for t, k in zip(text_end, keys_len.tolist())]
        keep = np.ones(len(rows), bool)
        texts: list[memoryview] = []
        for k, (o, ln) in enumerate(zip(offs.tolist(), length.tolist())):
            s = mv[o:o + ln]
            if crc32c(s[_CRC_FROM:]) != crcs[k]:
                keep[k] = False
                errors[int(rows[k])] = CorruptRecordError(
                    f"CRC32C 0x{crc32c(s[_CRC_FROM:]):08x}, header says 0x{crcs[k]:08x}", offset=o)
                continue
            if nested[k]:  # keys and properties hold lengths too: the decoder checks those and their UTF-8
                try:
                    decode(s)
                except CorruptRecordError as e:
                    keep[k] = False
                    errors[int(rows[k])] = CorruptRecordError(e.reason, offset=o)
                    continue
            texts.append(s[HEADER_SIZE:text_end[k]])
            if key_end[k] and not nested[k]:
                texts.append(s[text_end[k] + 2:key_end[k]])
        # the text fields (id, topic, tags) are UTF-8, as the decoder would insist: one check for all
        # (NUL between them, so that no sequence cut at a field's end is completed by the next field)
        if texts and not _utf8(b"\x00".join(texts)):
            for k, (o, ln) in enumerate(zip(offs.tolist(), length.tolist())):
                if keep[k] and not (_utf8(mv[o + HEADER_SIZE:o + text_end[k]])
                                    and (nested[k] or not key_end[k] or _utf8(mv[o + text_end[k] + 2:o + key_end[k]]))):
                    keep[k] = False
                    errors[int(rows[k])] = CorruptRecordError("a text field is not UTF-8", offset=o)
        texts.clear()
        for k, (o, ln) in enumerate(zip(offs.tolist(), length.tolist())):
            if keep[k]:
                slices.append(mv[o:o + ln])
        header[rows[keep]] = h[keep]
        ok[rows[keep]] = True
        rows_in_order.append(rows[keep])
    data = b"".join(slices)
    slices.clear()
    start = np.full(n, -1, np.int64)
    if rows_in_order:
        order = np.concatenate(rows_in_order)
        lengths = header["length"][order].astype(np.int64)
        start[order] = np.cumsum(lengths) - lengths
    return RecordBytes(data, start, header, ok, errors)


def _utf8(b: bytes | memoryview) -> bool:
    """Whether the bytes are UTF-8."""
    try:
        str(b, "utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _why(mv: memoryview, offset: int, due: int | None) -> CorruptRecordError:
    """The error of a record the vectorised header check refused (the per-record decoder says why)."""
    try:
        rec = decode(mv, offset)[0]
    except CorruptRecordError as e:
        # a fresh error: the caught one's traceback holds views of the map, which must close later
        return CorruptRecordError(e.reason, offset=offset)
    misdated = due is not None and rec.due_ms != due
    return CorruptRecordError(f"due {rec.due_ms}, index says {due}", offset=offset,
                              record_due_ms=rec.due_ms if misdated else None)
