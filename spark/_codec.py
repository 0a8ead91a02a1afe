"""Part files to Arrow and back, in bulk: the Spark sources' numpy/pyarrow side, without Spark.

Reading a part: its index sidecar gives every record's offset, length and due time, and
`storage.check_records` (the one reader of the record layout, the engine's and `check()`'s) checks
the records a batch of entries points to in a read-only map of the .log, as columns: the same
verdict as everywhere (magic, version, flags, length and due time against the index, field
lengths, CRC32C unless `verify` is off, keys and properties well formed, text UTF-8). Variable
fields are cut out by the starts and lengths it gives: small text fields by gathering byte
positions, the body by masking the byte range it covers. Keys and properties, whose encoding is
nested, go through storage's own decoders for the records that have any. A record that fails any
check yields a row with `crc_ok = false` and null fields, never an exception.

Writing: rows go through `storage.PartStager` (records and index sidecars in the engine's own byte
layout and fsync order) into staged parts, which the driver later moves into place with
`SegmentLayout.publish_part`.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from storage import (DISPATCH_DTYPE, RECORD_FIELDS, PartStager, Record, check_records, decode_keys, decode_properties,
                     read_dispatch_log, read_index, record_keys, trusted_index)
from storage.audit import NO_TIME, OUTCOME_COUNTS, outcomes_of

#: every column the record source can produce, with its Arrow type
RECORD_COLUMNS: dict[str, pa.DataType] = {
    "segment_ms": pa.int64(), "segment": pa.string(), "part": pa.int32(), "offset": pa.int64(),
    "length": pa.int32(), "msg_id": pa.string(), "topic": pa.string(), "tags": pa.string(),
    "keys": pa.list_(pa.string()), "properties": pa.map_(pa.string(), pa.string()), "body": pa.binary(),
    "due_ms": pa.int64(), "enqueue_ms": pa.int64(), "crc_ok": pa.bool_(),
    "delivered": pa.int32(), "dead_lettered": pa.int32(), "cancelled": pa.int32(), "marked_corrupt": pa.int32(),
    "replayed": pa.int32(), "first_delivered_ms": pa.int64(),
}
#: outcome columns: how many dispatch entries of that outcome name the record
OUTCOME_COLUMNS = OUTCOME_COUNTS
_NO_TIME = NO_TIME
_TEXT_FIELD = {"msg_id": "id_len", "topic": "topic_len", "tags": "tags_len"}


@dataclass(frozen=True, slots=True)
class PartFiles:
    """Where one part lives: its segment, number and two files."""

    segment_ms: int
    segment: str
    part: int
    log: str
    index: str
    dispatch: str | None = None  # the segment's dispatch log, for the outcome columns


def _gather(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Arrow offsets (int32) and the bytes of ranges [start, start + length), concatenated."""
    lens = lengths.astype(np.int64)
    offs = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    total = int(offs[-1])
    if total == 0:
        return offs.astype(np.int32), np.empty(0, np.uint8)
    if total * 4 > int(starts[-1] + lens[-1] - starts[0]) and bool(np.all(starts[1:] >= starts[:-1] + lens[:-1])):
        # large, ordered ranges (bodies): mark the covered bytes and compress, ~2 ns a byte
        lo, hi = int(starts[0]), int(starts[-1] + lens[-1])
        mark = np.zeros(hi - lo + 1, np.int8)
        mark[starts - lo] += 1
        np.subtract.at(mark, starts + lens - lo, 1)
        data = buf[lo:hi][np.cumsum(mark[:-1], dtype=np.int8).view(bool)]
    else:  # short fields: gather their byte positions
        data = buf[np.repeat(starts - offs[:-1], lens) + np.arange(total)]
    return offs.astype(np.int32), data


def _binary_array(typ: pa.DataType, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  valid: np.ndarray, null_if_empty: bool = False) -> pa.Array:
    """A string or binary Arrow array of byte ranges; invalid (or, optionally, empty) ones null."""
    n = len(starts)
    lens = np.where(valid, lengths, 0)
    offs, data = _gather(buf, starts, lens)
    mask = ~valid | (lens == 0) if null_if_empty else ~valid
    validity = None if not mask.any() else pa.py_buffer(np.packbits(~mask, bitorder="little"))
    return pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(offs), pa.py_buffer(data)],
                                 null_count=int(mask.sum()))


def _nested(buf: np.ndarray, idx: np.ndarray, hdr: np.ndarray, starts: dict[str, np.ndarray], ok: np.ndarray,
            want_keys: bool, want_props: bool) -> tuple[pa.Array | None, pa.Array | None]:
    """Keys (list<string>) and properties (map<string,string>) arrays, decoded by storage's own
    field decoders for the good records (`ok`) that have any."""
    n = len(idx)
    key_counts = np.zeros(n, np.int32)
    prop_counts = np.zeros(n, np.int32)
    flat_keys: list[str] = []
    prop_names: list[str] = []
    prop_values: list[str] = []
    sel = np.zeros(n, bool)
    if want_keys:
        sel |= hdr["keys_len"] > 0
    if want_props:
        sel |= hdr["props_len"] > 0
    rows = np.flatnonzero(sel & ok)
    ks, kl = starts["keys_len"][rows].tolist(), hdr["keys_len"][rows].tolist()
    ps, pl = starts["props_len"][rows].tolist(), hdr["props_len"][rows].tolist()
    mv = memoryview(buf)  # type: ignore[arg-type]  # a uint8 array exports the buffer protocol
    for i, k0, kn, p0, pn in zip(rows.tolist(), ks, kl, ps, pl):
        keys = decode_keys(mv[k0:k0 + kn], k0) if want_keys and kn else ()
        props = decode_properties(mv[p0:p0 + pn], p0) if want_props and pn else {}
        if keys:
            key_counts[i] = len(keys)
            flat_keys.extend(keys)
        if props:
            prop_counts[i] = len(props)
            prop_names.extend(props)
            prop_values.extend(props.values())
    mv.release()
    keys_arr = props_arr = None
    if want_keys:
        key_counts[~ok] = 0
        offs = np.zeros(n + 1, np.int32)
        np.cumsum(key_counts, out=offs[1:])
        keys_arr = pa.ListArray.from_arrays(pa.array(offs), pa.array(flat_keys, pa.string()),
                                            type=RECORD_COLUMNS["keys"], mask=pa.array(~ok))
    if want_props:
        prop_counts[~ok] = 0
        offs = np.zeros(n + 1, np.int32)
        np.cumsum(prop_counts, out=offs[1:])
        props_arr = pa.MapArray.from_arrays(pa.array(offs), pa.array(prop_names, pa.string()),
                                            pa.array(prop_values, pa.string()), type=RECORD_COLUMNS["properties"],
                                            mask=pa.array(~ok))
    return keys_arr, props_arr


def record_outcomes(dispatch_log: str | None, part: int, offsets: np.ndarray,
                    columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Per record (offsets of one part, ascending): counts of each outcome among the segment's
    dispatch entries, and the first delivery's dispatch time (int64 max when none); those of
    `columns` only. Counted by `storage.outcomes_of`, as `timewheel inspect` counts them."""
    entries = read_dispatch_log(dispatch_log).entries if dispatch_log else np.empty(0, DISPATCH_DTYPE)
    found = outcomes_of(record_keys(np.full(len(offsets), part), offsets), entries)
    out = {col: found.counts[col] for col in OUTCOME_COLUMNS if col in columns}
    if "first_delivered_ms" in columns:
        out["first_delivered_ms"] = found.first_delivered_ms
    return out


def decode_batch(buf: np.ndarray, mv: memoryview, idx: np.ndarray, pf: PartFiles, columns: Sequence[str],
                 verify: bool = True, outcomes: Mapping[str, np.ndarray] | None = None) -> dict[str, pa.Array]:
    """Arrow columns (those named) of the records an index slice points to; outcome columns come
    from `outcomes` (aligned with the slice)."""
    n = len(idx)
    offsets = idx["offset"].astype(np.int64)
    found = check_records(mv, offsets, due_ms=idx["due_ms"], lengths=idx["length"], verify_crc=verify)
    hdr, ok = found.header, found.ok
    starts = {f + "_len": s for f, s in zip(RECORD_FIELDS, found.field_starts())}
    want = set(columns)
    text = {col: _binary_array(pa.string(), buf, starts[lf], hdr[lf], ok, null_if_empty=col == "tags")
            for col, lf in _TEXT_FIELD.items() if col in want}
    keys = props = None
    if want & {"keys", "properties"}:
        keys, props = _nested(buf, idx, hdr, starts, ok, "keys" in want, "properties" in want)
    out: dict[str, pa.Array] = {}
    bad = ~ok
    for col in columns:
        if col == "segment_ms":
            out[col] = pa.array(np.full(n, pf.segment_ms, np.int64))
        elif col == "segment":
            out[col] = pa.repeat(pa.scalar(pf.segment, pa.string()), n)
        elif col == "part":
            out[col] = pa.array(np.full(n, pf.part, np.int32))
        elif col == "offset":
            out[col] = pa.array(offsets)
        elif col == "length":
            out[col] = pa.array(idx["length"].astype(np.int32))
        elif col == "due_ms":
            out[col] = pa.array(idx["due_ms"].astype(np.int64))
        elif col == "enqueue_ms":
            out[col] = pa.array(hdr["enqueue_ms"].astype(np.int64), mask=bad)
        elif col == "crc_ok":
            out[col] = pa.array(ok)
        elif col in text:
            out[col] = text[col]
        elif col == "body":
            out[col] = _binary_array(pa.binary(), buf, starts["body_len"], hdr["body_len"], ok)
        elif col == "keys":
            assert keys is not None
            out[col] = keys
        elif col == "properties":
            assert props is not None
            out[col] = props
        elif col == "first_delivered_ms":
            assert outcomes is not None
            t = outcomes[col]
            out[col] = pa.array(t, mask=t == _NO_TIME)
        elif col in OUTCOME_COLUMNS:
            assert outcomes is not None
            out[col] = pa.array(outcomes[col])
        else:
            raise KeyError(f"unknown record column {col!r}")
    return out


def segment_identity(path: str) -> tuple[int, int] | None:
    """The identity (device, inode) of the segment directory holding `path`; None when it is gone.

    A job beside a running engine reads a segment's part and its dispatch log one after the other;
    retention may move the segment away in between (it is done). Reads that must agree compare this
    before and after: a changed identity means the segment was retired meanwhile, not that its
    records are pending or its dispatch entries name nothing.
    """
    try:
        st = os.stat(os.path.dirname(path))
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def read_part(pf: PartFiles, columns: Sequence[str], *, since_ms: int | None = None, until_ms: int | None = None,
              verify: bool = True, batch_bytes: int = 32 << 20,
              max_rows: int = 1 << 16) -> Iterator[dict[str, pa.Array]]:
    """Arrow columns of a part's records due in [since_ms, until_ms), in batches.

    The index is taken as far as it agrees with the log (`storage.trusted_index`), as the engine
    takes it: entries past the end of the log (a torn write not yet repaired) are skipped, and
    where entries stop tiling the log the records are found by a scan. A segment retired while it
    is read (`segment_identity`) yields nothing: its records were done.
    """
    segment = segment_identity(pf.log)
    try:
        f = open(pf.log, "rb")
    except FileNotFoundError:
        return
    idx = trusted_index(Path(pf.log), read_index(pf.index))
    if not len(idx):
        f.close()
        return
    with f:
        size = os.fstat(f.fileno()).st_size
        idx = idx[idx["offset"].astype(np.int64) + idx["length"] <= size]
        if since_ms is not None:
            idx = idx[idx["due_ms"] >= since_ms]
        if until_ms is not None:
            idx = idx[idx["due_ms"] < until_ms]
        if not len(idx) or size == 0:
            return
        wanted = [c for c in columns if c in OUTCOME_COLUMNS or c == "first_delivered_ms"]
        outcomes = record_outcomes(pf.dispatch, pf.part, idx["offset"].astype(np.int64), wanted) if wanted else {}
        if wanted and (segment is None or segment_identity(pf.log) != segment):
            return  # retired meanwhile: its dispatch log may have gone before it was read
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        try:
            buf = np.frombuffer(mm, np.uint8)
            mv = memoryview(mm)
            try:
                avg = max(1, int(idx["length"].mean()))
                rows = int(max(1024, min(max_rows, batch_bytes // avg)))
                for start in range(0, len(idx), rows):
                    stop = start + rows
                    yield decode_batch(buf, mv, idx[start:stop], pf, columns, verify,
                                       {k: v[start:stop] for k, v in outcomes.items()})
            finally:
                mv.release()
                del buf
        finally:
            mm.close()


# ---- writing --------------------------------------------------------------------------------------


def stage_batch(stager: PartStager, batch: pa.RecordBatch, counts: dict[str, int]) -> None:
    """Stage the rows of an Arrow batch (columns of `spark.schema.BACKFILL_PLAN`) through storage's
    `PartStager`; rows whose status is "existing" are only counted. `counts` gains "written",
    "existing" and "duplicates" (input rows beyond the first with the same id)."""
    names = set(batch.schema.names)
    cols = {name: batch.column(name).to_pylist() for name in
            ("msg_id", "topic", "body", "due_ms", "tags", "keys", "properties")}
    n = batch.num_rows
    status = batch.column("status").to_pylist() if "status" in names else [None] * n
    copies = batch.column("copies").to_pylist() if "copies" in names else [1] * n
    for mid, topic, body, due, tags, keys, props, st, cp in zip(
            cols["msg_id"], cols["topic"], cols["body"], cols["due_ms"], cols["tags"], cols["keys"],
            cols["properties"], status, copies):
        if st == "existing":
            counts["existing"] = counts.get("existing", 0) + (cp or 1)
            continue
        counts["duplicates"] = counts.get("duplicates", 0) + (cp or 1) - 1
        stager.add(Record(mid, topic, body, due, 0, tags or "", tuple(keys or ()), dict(props or ())))
        counts["written"] = counts.get("written", 0) + 1


def arrow_batch(columns: Mapping[str, pa.Array], schema: pa.Schema) -> pa.RecordBatch:
    """A record batch in exactly `schema` (Spark checks types, names and nullability)."""
    arrays = []
    for f in schema:
        a = columns[f.name]
        arrays.append(a if a.type == f.type else a.cast(f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
