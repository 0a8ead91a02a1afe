"""The one reader of the record layout for many records at once: header columns and verdicts.

`check_records` takes one buffer (a part's mapped log, or any bytes) and the offsets of records in
it, with what an index says of them where known (due times, lengths), and returns per row the
record's header fields as numpy columns (`HEADER_DTYPE`), where each variable field starts and how
long it is, whether the record is good, and for a bad one the `CorruptRecordError` saying why.

A good record is what `storage.record.check_record` accepts (the one definition: magic, version,
flags, lengths, bounds, CRC32C, keys and properties well formed, text UTF-8, due time equal to the
index's), and a bad row's error is the one `check_record` raises, so every reader (the engine's
send batches, `read_record_bytes`, Spark, `check()`) gives the same verdict with the same words.
Up to `SMALL` rows are walked one by one with `check_record` itself (a fixed cost of microseconds,
where numpy's is tens); more are checked as columns: the header checks by numpy at once, the CRC32C
one C call per record, the text fields by one ASCII test over all records (`check_record`'s own
`check_fields` decides the rest: non-ASCII text, several keys, properties).
Where the compiled scan (`storage/_record_scan.pyx`, built by `pip install`) is present, it takes
every row instead: one C loop doing the header checks, the CRC32C call and an ASCII walk of every
string, keys and properties included, with `check_fields` deciding only rows with other text.
tests/storage/test_record_reader.py holds the three paths to the same columns, verdicts and errors.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from storage.errors import CorruptRecordError
from storage.record import (HEADER, HEADER_SIZE, MAGIC, MAX_BODY, MAX_PROPERTIES, MAX_RECORD, VERSION, check_fields,
                            check_record)
from storage.record import crc32c

_scan: Callable[..., None] | None
_gather: Callable[..., bytes | None] | None
try:
    from storage._record_scan import gather as _compiled_gather, scan as _compiled_scan
    _scan, _gather = _compiled_scan, _compiled_gather
except ImportError:  # installed without a C compiler: the numpy and scalar paths
    _scan = _gather = None

__all__ = ["COMPILED", "FIELDS", "HEADER_DTYPE", "SMALL", "CheckedRecords", "check_records", "field_starts",
           "gather_good"]

#: whether the compiled scan checks the records (else numpy and Python do, to the same verdicts)
COMPILED = _scan is not None

_HEADER_NAMES = ("magic", "version", "flags", "length", "crc", "due_ms", "enqueue_ms",
                 "id_len", "topic_len", "tags_len", "keys_len", "props_len", "body_len")
#: the record header (`storage.record.HEADER`) as a numpy structured type: same codes, same order
HEADER_DTYPE = np.dtype([(name, "<" + code) for name, code in zip(_HEADER_NAMES, HEADER.format[1:], strict=True)])
assert HEADER.format[0] == "<" and HEADER_DTYPE.itemsize == HEADER_SIZE
#: the variable fields, in the order they follow the header; their lengths are `<name>_len`
FIELDS = ("id", "topic", "tags", "keys", "props", "body")
#: at most this many rows are checked one by one, more as columns
SMALL = 16  # where the walk costs what the columns do (~2 µs a row against ~35 µs + 0.4 µs a row)
_CRC_FROM = HEADER_DTYPE.fields["crc"][1] + 4  # type: ignore[index]  # the CRC covers what follows it
_ZERO = (0,) * len(_HEADER_NAMES)
_CHUNK = 1 << 16
_ASCII_WIDTH = 256  # longer text (id, topic, tags, one key) is checked record by record
#: what the compiled scan needs of the layout, taken from HEADER_DTYPE (defined once, in storage.record)
_LAYOUT = (MAGIC, VERSION, HEADER_SIZE, MAX_RECORD, MAX_PROPERTIES, MAX_BODY, _CRC_FROM,
           *(HEADER_DTYPE.fields[f][1] for f in ("flags", "length", "crc", "due_ms", "id_len", "topic_len",  # type: ignore[index]
                                                  "tags_len", "keys_len", "props_len", "body_len")))
_NOT_KNOWN = np.zeros(0, np.int64)
_GOOD, _FIELDS = 1, 2  # the compiled scan's verdicts besides 0, bad


@dataclass(frozen=True, slots=True)
class CheckedRecords:
    """Records checked at their offsets: per row, its header (zeros for a bad row) and verdict."""

    offset: np.ndarray  # int64, where each record starts in the buffer
    header: np.ndarray  # HEADER_DTYPE
    ok: np.ndarray  # bool
    errors: dict[int, CorruptRecordError] = field(default_factory=dict)  # by row, for each bad one

    def __len__(self) -> int:
        return len(self.offset)

    def field_starts(self) -> tuple[np.ndarray, ...]:
        """Where each row's id, topic, tags, keys, properties and body start in the buffer (int64)."""
        return field_starts(self.offset, self.header)

    def field_lengths(self) -> tuple[np.ndarray, ...]:
        """Each row's id, topic, tags, keys, properties and body lengths (int64; 0 for a bad row)."""
        return tuple(self.header[f + "_len"].astype(np.int64) for f in FIELDS)


def field_starts(start: np.ndarray, header: np.ndarray) -> tuple[np.ndarray, ...]:
    """Starts of the id, topic, tags, keys, properties and body of records starting at `start`."""
    pos = np.asarray(start, np.int64) + HEADER_SIZE
    out = [pos]
    for f in FIELDS[:-1]:
        pos = pos + header[f + "_len"]
        out.append(pos)
    return tuple(out)


def check_records(buf: bytes | memoryview, offsets: np.ndarray, *, due_ms: np.ndarray | None = None,
                  lengths: np.ndarray | None = None, verify_crc: bool = True) -> CheckedRecords:
    """Check the records at `offsets` of `buf` (with the index's due times and lengths when given;
    CRC32C unless `verify_crc` is False), as `storage.record.check_record` checks one."""
    mv = memoryview(buf)
    try:
        if _scan is not None:
            return _scan_all(mv, offsets, due_ms, lengths, verify_crc)
        if len(offsets) <= SMALL:
            return _check_each(mv, offsets, due_ms, lengths, verify_crc)
        offsets = np.asarray(offsets, np.int64)
        if len(offsets) <= _CHUNK:
            return _check_all(mv, offsets, due_ms, lengths, verify_crc)
        # in chunks: the column path holds a few columns, lists and text windows per row
        parts = [_check_all(mv, offsets[a:a + _CHUNK], None if due_ms is None else due_ms[a:a + _CHUNK],
                            None if lengths is None else lengths[a:a + _CHUNK], verify_crc)
                 for a in range(0, len(offsets), _CHUNK)]
        return CheckedRecords(offsets, np.concatenate([p.header for p in parts]), np.concatenate([p.ok for p in parts]),
                              {k * _CHUNK + r: e for k, p in enumerate(parts) for r, e in p.errors.items()})
    finally:
        mv.release()


def gather_good(mv: memoryview, offsets: np.ndarray, due_ms: np.ndarray | None
                ) -> tuple[bytes, np.ndarray, np.ndarray] | None:
    """The records at `offsets` of `mv` copied out one after another with their headers
    (`HEADER_DTYPE`) and where each starts in the copy, in one compiled call, when every one is
    good without a second look (`check_records` would find each good, its text ASCII); None when
    one is not, or where the compiled scan was not built: `check_records` then decides."""
    if _gather is None:
        return None
    offs = np.ascontiguousarray(offsets, np.int64)
    n = len(offs)
    heads = np.empty((n, HEADER_SIZE), np.uint8)
    starts = np.empty(n, np.int64)
    data = _gather(mv, mv, offs, _NOT_KNOWN if due_ms is None else np.ascontiguousarray(due_ms, np.int64), crc32c,
                   _LAYOUT, heads, starts)
    if data is None:
        return None
    return data, starts, heads.view(HEADER_DTYPE).reshape(n)


def _error(mv: memoryview, offset: int, due: int | None, length: int | None, verify: bool) -> CorruptRecordError:
    """check_record's error for a record found bad (a fresh one: the raised one's traceback holds
    views of the buffer, which may be a map that must close)."""
    try:
        check_record(mv, offset, due_ms=due, length=length, verify_crc=verify)
    except CorruptRecordError as e:
        return CorruptRecordError(e.reason, offset=offset, record_due_ms=e.record_due_ms)
    raise AssertionError(f"the record at offset {offset} was refused by the column checks and accepted by "
                         "check_record")


def _check_each(mv: memoryview, offsets: np.ndarray, due_ms: np.ndarray | None, lengths: np.ndarray | None,
                verify: bool) -> CheckedRecords:
    """The scalar path: `check_record` on each row."""
    offs: list[int] = np.asarray(offsets, np.int64).tolist()
    dues: list[int | None] = [None] * len(offs) if due_ms is None else np.asarray(due_ms, np.int64).tolist()
    lens: list[int | None] = [None] * len(offs) if lengths is None else np.asarray(lengths, np.int64).tolist()
    heads = []
    errors: dict[int, CorruptRecordError] = {}
    for i, o in enumerate(offs):
        try:
            heads.append(check_record(mv, o, due_ms=dues[i], length=lens[i], verify_crc=verify))
        except CorruptRecordError as e:
            errors[i] = CorruptRecordError(e.reason, offset=o, record_due_ms=e.record_due_ms)
            heads.append(_ZERO)
    ok = np.ones(len(offs), bool)
    if errors:
        ok[list(errors)] = False
    return CheckedRecords(np.array(offs, np.int64), np.array(heads, HEADER_DTYPE), ok, errors)


def _scan_all(mv: memoryview, offsets: np.ndarray, due_ms: np.ndarray | None, lengths: np.ndarray | None,
              verify: bool) -> CheckedRecords:
    """The compiled path: the same verdicts as `_check_each`, one C loop over the rows."""
    assert _scan is not None
    offs = np.ascontiguousarray(offsets, np.int64)
    n = len(offs)
    heads = np.zeros((n, HEADER_SIZE), np.uint8)
    verdicts = np.zeros(n, np.uint8)
    if n:
        _scan(mv, np.frombuffer(mv, np.uint8), offs,
              _NOT_KNOWN if due_ms is None else np.ascontiguousarray(due_ms, np.int64),
              _NOT_KNOWN if lengths is None else np.ascontiguousarray(lengths, np.int64),
              verify, crc32c, _LAYOUT, heads, verdicts)
    header = heads.view(HEADER_DTYPE).reshape(n)
    ok = verdicts != 0
    for k in np.flatnonzero(verdicts == _FIELDS).tolist():  # text other than ASCII: check_fields decides
        h = header[k]
        try:
            check_fields(mv, int(offs[k]), int(h["id_len"]), int(h["topic_len"]), int(h["tags_len"]),
                         int(h["keys_len"]), int(h["props_len"]))
        except CorruptRecordError:
            ok[k] = False
            heads[k] = 0
    errors = {}
    if not ok.all():
        due_l = None if due_ms is None else np.asarray(due_ms, np.int64)
        len_l = None if lengths is None else np.asarray(lengths, np.int64)
        errors = {r: _error(mv, int(offs[r]), None if due_l is None else int(due_l[r]),
                            None if len_l is None else int(len_l[r]), verify) for r in np.flatnonzero(~ok).tolist()}
    return CheckedRecords(offs, header, ok, errors)


def _check_all(mv: memoryview, offs: np.ndarray, due_ms: np.ndarray | None, lengths: np.ndarray | None,
               verify: bool) -> CheckedRecords:
    """The column path: the same verdicts as `_check_each`, numpy over the headers."""
    n, size = len(offs), len(mv)
    header = np.zeros(n, HEADER_DTYPE)
    ok = np.zeros(n, bool)
    rows = np.flatnonzero(offs + HEADER_SIZE <= size)
    o = offs[rows]
    # each row's 44 bytes taken from a window view of the buffer (no index array of 44 positions a row)
    windows = np.lib.stride_tricks.sliding_window_view(np.frombuffer(mv, np.uint8), HEADER_SIZE) if len(o) else None
    h = windows[o].view(HEADER_DTYPE).reshape(len(o)) if windows is not None else np.zeros(0, HEADER_DTYPE)
    del windows
    length = h["length"].astype(np.int64)
    fields = HEADER_SIZE + h["id_len"].astype(np.int64) + h["topic_len"] + h["tags_len"] + h["keys_len"]
    good = ((h["magic"] == MAGIC) & (h["version"] == VERSION) & (h["flags"] == 0) & (length >= HEADER_SIZE)
            & (length <= MAX_RECORD) & (o + length <= size) & (fields + h["props_len"] + h["body_len"] == length)
            & (h["props_len"] <= MAX_PROPERTIES) & (h["body_len"] <= MAX_BODY))
    if lengths is not None:
        good &= length == np.asarray(lengths, np.int64)[rows]
    if due_ms is not None:
        good &= h["due_ms"] == np.asarray(due_ms, np.int64)[rows]
    rows, o, h, length, fields = rows[good], o[good], h[good], length[good], fields[good]
    # text from the id to the end of the keys: all ASCII means valid UTF-8 (a single key's uint16
    # length is ASCII too when under 128); several keys, properties or other text: check_fields decides
    keys_len = h["keys_len"].astype(np.int64)
    raw = np.frombuffer(mv, np.uint8)
    one_key = np.zeros(len(o), bool)
    has_keys = np.flatnonzero(keys_len >= 2)
    if len(has_keys):
        at = (o + fields - keys_len)[has_keys]
        one_key[has_keys] = (raw[at].astype(np.int64) | raw[at + 1].astype(np.int64) << 8) == keys_len[has_keys] - 2
    simple = ((keys_len == 0) | one_key) & (h["props_len"] == 0)
    keep = np.ones(len(o), bool)
    if verify:
        bad_crc = [k for k, (s, e, c) in enumerate(zip(o.tolist(), (o + length).tolist(), h["crc"].tolist()))
                   if crc32c(mv[s + _CRC_FROM:e]) != c]
        keep[bad_crc] = False
    ascii_text = _ascii(raw, o + HEADER_SIZE, fields - HEADER_SIZE, simple)
    del raw
    decide = np.flatnonzero(keep & ~ascii_text).tolist()  # rows check_fields decides
    if decide:
        lens = [h[f"{f}_len"][decide].tolist() for f in FIELDS[:-1]]
        for k, *ln in zip(decide, *lens):
            try:
                check_fields(mv, int(o[k]), *ln)
            except CorruptRecordError:
                keep[k] = False
    header[rows[keep]] = h[keep]
    ok[rows[keep]] = True
    due_l = None if due_ms is None else np.asarray(due_ms, np.int64)
    len_l = None if lengths is None else np.asarray(lengths, np.int64)
    errors = {r: _error(mv, int(offs[r]), None if due_l is None else int(due_l[r]),
                        None if len_l is None else int(len_l[r]), verify) for r in np.flatnonzero(~ok).tolist()}
    return CheckedRecords(offs, header, ok, errors)


def _ascii(raw: np.ndarray, start: np.ndarray, length: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Per row, whether it is a candidate whose `length` bytes from `start` are all ASCII (False
    also where that is not cheaply known: text longer than `_ASCII_WIDTH`, or near the buffer's end)."""
    out = np.zeros(len(start), bool)
    width = min(int(length[candidates].max(initial=0)), _ASCII_WIDTH)
    rows = np.flatnonzero(candidates & (length <= width) & (start + width <= len(raw)))
    if not len(rows):
        return out
    if width == 0:
        out[rows] = True
        return out
    # each row's text as a window of `width` bytes (a copy of those only), bytes past its length masked
    text = np.lib.stride_tricks.sliding_window_view(raw, width)[start[rows]]
    out[rows] = ~((text >= 0x80) & (np.arange(width) < length[rows, None])).any(axis=1)
    return out
