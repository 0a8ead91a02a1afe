"""The numpy/pyarrow side of the sources, without Spark: bulk decode against storage.decode,
corrupt and torn records, outcome columns."""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spark._cells as cells_module
import spark._codec as codec_module
from spark._codec import RECORD_COLUMNS, PartFiles, read_part
from storage import (DELIVERED, REPLAYED, Record, ScheduleStore, SegmentLayout, decode, dispatch_entries, encode,
                     read_index, segment_name)
from storage import check, check_records
from storage.record import HEADER, crc32c
from tests.spark.conftest import T0, MakeStore, deliver, records


def _part(store: ScheduleStore, seg: int, part: int = 0) -> PartFiles:
    lay = store.layout
    return PartFiles(seg, segment_name(seg), part, str(lay.part_log(seg, part)), str(lay.part_index(seg, part)),
                     str(lay.dispatch_log(seg)))


def _rows(pf: PartFiles, columns: list[str] | None = None, **kw: object) -> list[dict]:
    cols = list(RECORD_COLUMNS) if columns is None else columns
    out: list[dict] = []
    for batch in read_part(pf, cols, **kw):  # type: ignore[arg-type]
        n = len(next(iter(batch.values())))
        lists = {k: v.to_pylist() for k, v in batch.items()}
        out.extend({k: lists[k][i] for k in cols} for i in range(n))
    return out


text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(text.filter(bool), text.filter(bool), st.binary(max_size=300), text,
                          st.lists(text, max_size=3), st.dictionaries(text, text, max_size=3),
                          st.integers(0, 3_599_999)), min_size=1, max_size=40))
def test_bulk_decode_matches_storage_decode(tmp_path_factory: pytest.TempPathFactory, rows: list) -> None:
    d = tmp_path_factory.mktemp("codec")
    with ScheduleStore(d / "data") as s:
        recs = [Record(f"{i}-{mid}", topic, body, T0 + due, 0, tags, tuple(keys), props)
                for i, (mid, topic, body, tags, keys, props, due) in enumerate(rows)]
        s.append(recs, T0)
        pf = _part(s, T0)
        got = _rows(pf, batch_bytes=512, max_rows=7)  # several batches
        raw = Path(pf.log).read_bytes()
    assert len(got) == len(recs)
    for row in got:
        want, _ = decode(raw, row["offset"])
        assert row["crc_ok"] is True
        assert (row["msg_id"], row["topic"], row["body"], row["due_ms"]) == (want.msg_id, want.topic, want.body,
                                                                             want.due_ms)
        assert (row["tags"] or "") == want.tags and tuple(row["keys"]) == want.keys
        assert dict(row["properties"]) == dict(want.properties)
        assert row["enqueue_ms"] == T0 and row["segment"] == segment_name(T0) and row["part"] == 0


def test_corrupt_record_is_a_row_with_crc_ok_false(make_store: MakeStore) -> None:
    s = make_store()
    s.append(records(5, keys=("k",), properties={"a": "b"}), T0)
    pf = _part(s, T0)
    idx = read_index(pf.index)
    with open(pf.log, "r+b") as f:  # flip a body byte of record 2, then the magic of record 4
        f.seek(int(idx["offset"][2]) + int(idx["length"][2]) - 1)
        f.write(b"\xff")
        f.seek(int(idx["offset"][4]))
        f.write(b"\x00")
    rows = _rows(pf)
    assert [r["crc_ok"] for r in rows] == [True, True, False, True, False]
    for r in (rows[2], rows[4]):
        assert r["msg_id"] is None and r["topic"] is None and r["body"] is None and r["keys"] is None
        assert r["properties"] is None and r["due_ms"] == int(idx["due_ms"][rows.index(r)])
    assert rows[3]["msg_id"] == "m3" and rows[3]["keys"] == ["k"]


def test_invalid_utf8_behind_a_valid_crc_is_corrupt(tmp_path: Path) -> None:
    rec = Record("id", "T", b"b", T0)
    blob = bytearray(encode(rec))
    blob[HEADER.size + 2] = 0xFF  # the topic byte; then fix the CRC so only UTF-8 is wrong
    from storage.record import crc32c
    blob[8:12] = struct.pack("<I", crc32c(bytes(blob[12:])))
    seg_dir = tmp_path / "schedule" / segment_name(T0)
    seg_dir.mkdir(parents=True)
    (seg_dir / "00000.log").write_bytes(bytes(blob) + encode(Record("ok", "T", b"x", T0 + 1)))
    idx = np.array([(T0, 0, len(blob)), (T0 + 1, len(blob), len(encode(Record("ok", "T", b"x", T0 + 1))))],
                   dtype=read_index(seg_dir / "missing.idx").dtype)
    idx.tofile(seg_dir / "00000.idx")
    pf = PartFiles(T0, segment_name(T0), 0, str(seg_dir / "00000.log"), str(seg_dir / "00000.idx"))
    rows = _rows(pf, ["msg_id", "topic", "crc_ok"])
    assert rows == [{"msg_id": None, "topic": None, "crc_ok": False}, {"msg_id": "ok", "topic": "T", "crc_ok": True}]


def test_index_entries_past_the_log_are_skipped_and_time_range_filters(make_store: MakeStore) -> None:
    s = make_store()
    s.append(records(10), T0)
    pf = _part(s, T0)
    idx = read_index(pf.index)
    with open(pf.log, "r+b") as f:
        f.truncate(int(idx["offset"][8]) + 3)  # records 8 and 9 torn off
    rows = _rows(pf, ["msg_id", "due_ms"])
    assert [r["msg_id"] for r in rows] == [f"m{i}" for i in range(8)]
    rows = _rows(pf, ["msg_id"], since_ms=T0 + 2000, until_ms=T0 + 5000)
    assert [r["msg_id"] for r in rows] == ["m2", "m3", "m4"]


def test_an_index_that_stops_tiling_the_log_hides_no_record(make_store: MakeStore) -> None:
    s = make_store()
    s.append(records(10), T0)
    pf = _part(s, T0)
    idx = read_index(pf.index)
    idx["offset"][4] = 0x7FFF0000  # past the end of the part: the record it named is intact
    idx.tofile(pf.index)
    rows = _rows(pf, ["msg_id", "crc_ok"])
    assert [(r["msg_id"], r["crc_ok"]) for r in rows] == [(f"m{i}", True) for i in range(10)]


def test_outcome_columns_count_entries_per_record(make_store: MakeStore) -> None:
    s = make_store()
    s.append(records(4), T0)
    deliver(s, T0, slice(0, 2), DELIVERED, T0 + 7)
    deliver(s, T0, slice(1, 2), DELIVERED, T0 + 3)  # m1 delivered twice, first at T0 + 3
    deliver(s, T0, slice(0, 1), REPLAYED, T0 + 9)
    ix = s.segment_index(T0)
    stray = dispatch_entries(np.array([0]), np.array([12345]), np.array([T0]), T0, DELIVERED)
    s.record_dispatch(T0, stray, T0)  # names no record: ignored here
    rows = _rows(_part(s, T0), ["msg_id", "delivered", "replayed", "cancelled", "first_delivered_ms"])
    assert rows == [
        {"msg_id": "m0", "delivered": 1, "replayed": 1, "cancelled": 0, "first_delivered_ms": T0 + 7},
        {"msg_id": "m1", "delivered": 2, "replayed": 0, "cancelled": 0, "first_delivered_ms": T0 + 3},
        {"msg_id": "m2", "delivered": 0, "replayed": 0, "cancelled": 0, "first_delivered_ms": None},
        {"msg_id": "m3", "delivered": 0, "replayed": 0, "cancelled": 0, "first_delivered_ms": None},
    ]
    assert len(ix) == 4


def test_spark_the_engine_and_check_give_one_verdict(make_store: MakeStore) -> None:
    """One reader of the record layout: the rows Spark finds bad are those the engine refuses to
    serve and those `check()` reports, whichever columns are asked for."""
    s = make_store()
    s.append(records(6, keys=("k",), properties={"a": "b"}), T0)
    pf = _part(s, T0)
    idx = read_index(pf.index)
    blob = bytearray(Path(pf.log).read_bytes())
    keys_at = check_records(bytes(blob), idx["offset"]).field_starts()[3]
    o = int(idx["offset"][1])
    blob[int(keys_at[1]) + 2] = 0xFF  # record 1: its key not UTF-8, behind a CRC that matches
    blob[o + 8:o + 12] = struct.pack("<I", crc32c(bytes(blob[o + 12:o + int(idx["length"][1])])))
    blob[int(idx["offset"][3]) + int(idx["length"][3]) - 1] ^= 1  # record 3: a body byte flipped
    Path(pf.log).write_bytes(bytes(blob))
    want = [True, False, True, False, True, True]
    assert [r["crc_ok"] for r in _rows(pf, ["crc_ok"])] == want
    assert [r["crc_ok"] for r in _rows(pf, ["body", "crc_ok"])] == want
    got = s.read_record_bytes(np.full(6, T0), np.zeros(6, np.uint16), idx["offset"], idx["due_ms"])
    assert got.ok.tolist() == want
    found = [f.detail for f in check(s.layout).findings if f.kind == "corrupt_record"]
    assert found == [f"offset {int(idx['offset'][1])}: {got.errors[1].reason}",
                     f"offset {int(idx['offset'][3])}: {got.errors[3].reason}"]


def _retire_meanwhile(store: ScheduleStore, seg: int, then: Any) -> Any:
    """`then`, after moving the segment away as retention does (one rename to retiring/)."""
    def moved(*args: Any, **kw: Any) -> Any:
        store.layout.retiring_dir.mkdir(exist_ok=True)
        seg_dir = store.layout.segment_dir(seg)
        if seg_dir.exists():
            os.replace(seg_dir, store.layout.retiring_dir / seg_dir.name)
        return then(*args, **kw)
    return moved


def test_a_segment_retired_while_its_part_is_read_yields_no_pending_record(
        make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job beside the engine: retention moved the segment away after its part was opened and
    before its dispatch log was read, and every delivered record read as pending (the audit's
    "lost"). A segment retired meanwhile yields nothing now: its records were done."""
    s = make_store()
    s.append(records(4), T0)
    seg = s.layout.segment_start(T0)
    deliver(s, seg, slice(None), DELIVERED, T0 + 10)
    pf = _part(s, seg)
    assert [r["delivered"] for r in _rows(pf, ["msg_id", "delivered"])] == [1] * 4
    monkeypatch.setattr(codec_module, "record_outcomes", _retire_meanwhile(s, seg, codec_module.record_outcomes))
    assert _rows(pf, ["msg_id", "delivered"]) == []  # the old code: four rows, delivered 0


def test_a_segment_retired_while_its_dispatch_log_is_read_names_no_unknown_entry(
        make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit reads a segment's dispatch log, then its parts' indexes: retired in between, every
    entry once named no record ("unknown dispatch entries")."""
    s = make_store()
    s.append(records(4), T0)
    seg = s.layout.segment_start(T0)
    deliver(s, seg, slice(None), DELIVERED, T0 + 10)
    lay = s.layout
    parts = [(p, str(lay.part_log(seg, p)), str(lay.part_index(seg, p))) for p in lay.list_parts(seg)]
    assert cells_module.unknown_entry_cells(str(lay.dispatch_log(seg)), lambda: parts) == {}
    monkeypatch.setattr(cells_module, "known_keys", _retire_meanwhile(s, seg, cells_module.known_keys))
    # the old code: 4 cells
    assert cells_module.unknown_entry_cells(str(lay.dispatch_log(seg)), lambda: parts) == {}


def test_a_segment_retired_while_the_dispatch_source_reads_it_yields_no_row(
        make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """`record_exists` read after the dispatch log: retired in between, every entry once said False."""
    import spark.dispatch_source as dispatch_source_module
    from spark.schema import DISPATCH

    s = make_store()
    s.append(records(3), T0)
    seg = s.layout.segment_start(T0)
    deliver(s, seg, slice(None), DELIVERED, T0 + 10)
    reader = dispatch_source_module.DispatchReader(str(s.layout.root), DISPATCH, {})
    (partition,) = reader.partitions()
    assert [b.num_rows for b in reader.read(partition)] == [3]
    monkeypatch.setattr(dispatch_source_module, "_record_exists",
                        _retire_meanwhile(s, seg, dispatch_source_module._record_exists))
    assert list(reader.read(partition)) == []  # the old code: 3 rows, record_exists False
