"""Records read as checked bytes (`ScheduleStore.read_record_bytes`): the same records and the same
verdicts on damage as `read_records`, without an object per record."""
from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import CorruptRecordError, Record, RecordBytes, ScheduleStore, _reader
from storage.record import HEADER_SIZE, crc32c

NOW = 1_800_000_000_000
HOUR = 3_600_000


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ScheduleStore]:
    s = ScheduleStore(tmp_path / "data")
    yield s
    s.close()


def _stored(store: ScheduleStore, records: list[Record]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    r = store.append(records, NOW)
    locs = r.locations
    return (locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16), locs["offset"].astype(np.uint32),
            np.array([rec.due_ms for rec in records], np.int64))


def _records(n: int) -> list[Record]:
    out = []
    for i in range(n):
        out.append(Record(f"id-{i}", f"T{i % 3}", f"body-{i}".encode() * (i % 5 + 1), NOW + 10 + i * 700_000,
                          tags="tg" if i % 2 else "", keys=("k1", "k2")[: i % 3],
                          properties={"p": str(i)} if i % 4 == 0 else {}))
    return out


def test_the_same_records_as_decoding_each(store: ScheduleStore) -> None:
    """Across segments and out of order: every row decodes to what read_records gives."""
    recs = _records(40)
    segs, parts, offs, due = _stored(store, recs)
    order = np.random.default_rng(1).permutation(len(recs))
    got = store.read_record_bytes(segs[order], parts[order], offs[order], due[order])
    assert isinstance(got, RecordBytes) and got.ok.all() and not got.errors
    want = store.read_records(segs[order].tolist(), parts[order].tolist(), offs[order].tolist())
    assert [got.record(i) for i in range(len(got))] == want
    assert got.topics() == [r.topic for r in want]  # type: ignore[union-attr]
    assert got.ids_and_keys() == ([r.msg_id for r in want], [r.keys for r in want])  # type: ignore[union-attr]
    assert got.header["due_ms"].tolist() == due[order].tolist()
    sub = got.select(np.array([5, 1]))
    assert [sub.record(0), sub.record(1)] == [want[5], want[1]]
    both = RecordBytes.concat([got.select(np.array([3])), sub])
    assert [both.record(i) for i in range(3)] == [want[3], want[5], want[1]]
    assert len(both.data) == sum(int(x) for x in both.header["length"])  # compacted


def _patch(store: ScheduleStore, seg: int, part: int, offset: int, at: int, new: bytes, *, fix_crc: bool) -> None:
    path = store.layout.part_log(seg, part)
    data = bytearray(path.read_bytes())
    data[offset + at:offset + at + len(new)] = new
    if fix_crc:
        length = struct.unpack_from("<I", data, offset + 4)[0]
        struct.pack_into("<I", data, offset + 8, crc32c(bytes(data[offset + 12:offset + length])))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    pytest.param(dict(at=HEADER_SIZE + 1, new=b"X", fix_crc=False), "CRC32C", id="flipped-byte"),
    pytest.param(dict(at=0, new=b"\x00", fix_crc=False), "magic", id="bad-magic"),
    pytest.param(dict(at=HEADER_SIZE + 4, new=b"\xff", fix_crc=True), "UTF-8", id="topic-not-utf8-crc-ok"),
    pytest.param(dict(at=12, new=struct.pack("<q", NOW + 5), fix_crc=True), "index says", id="due-not-the-index's"),
    pytest.param(dict(at=HEADER_SIZE + 12, new=b"\xff", fix_crc=True), "UTF-8", id="key-not-utf8-crc-ok"),
])
def test_a_damaged_record_is_refused_alone(store: ScheduleStore, damage: dict, words: str) -> None:
    recs = [Record(f"id-{i}", "TOPIC", b"body", NOW + 10 + i, tags="x", keys=("kk",)) for i in range(5)]
    segs, parts, offs, due = _stored(store, recs)
    store.checkpoint()
    store.release_segment(int(segs[0]))
    _patch(store, int(segs[2]), int(parts[2]), int(offs[2]), **damage)
    before = store.corrupt_records_found
    got = store.read_record_bytes(segs, parts, offs, due)
    assert got.ok.tolist() == [True, True, False, True, True]
    assert isinstance(got.errors[2], CorruptRecordError) and words in str(got.errors[2])
    assert [got.record(i).msg_id for i in (0, 1, 3, 4)] == ["id-0", "id-1", "id-3", "id-4"]
    assert store.corrupt_records_found == before + 1
    # the per-record reader agrees
    assert isinstance(store.read_records(segs.tolist(), parts.tolist(), offs.tolist(), due.tolist())[2],
                      CorruptRecordError)


def test_a_record_past_the_end_of_its_part_is_corrupt(store: ScheduleStore) -> None:
    segs, parts, offs, due = _stored(store, [Record("a", "T", b"x", NOW + 10)])
    got = store.read_record_bytes(np.r_[segs, segs], np.r_[parts, parts], np.r_[offs, offs + 10_000],
                                  np.r_[due, due])
    assert got.ok.tolist() == [True, False] and "header needs" in str(got.errors[1])


def test_a_growing_part_is_remapped_only_when_a_record_runs_past_the_map(store: ScheduleStore) -> None:
    segs, parts, offs, due = _stored(store, [Record(f"a{i}", "T", b"x" * 100, NOW + 10) for i in range(3)])
    reader = store.reader  # the store's one record reader, which keeps a map per part
    first = store.read_record_bytes(segs, parts, offs, due)
    assert first.ok.all()
    maps = {id(r._map) for r in reader._readers.values()}
    more = _stored(store, [Record(f"b{i}", "T", b"y" * 100, NOW + 10) for i in range(3)])  # the part grew
    again = store.read_record_bytes(segs, parts, offs, due)
    assert again.ok.all() and {id(r._map) for r in reader._readers.values()} == maps, "the old records: the same map"
    grown = store.read_record_bytes(*more)
    assert grown.ok.all() and [grown.record(i).msg_id for i in range(3)] == ["b0", "b1", "b2"]
    assert {id(r._map) for r in reader._readers.values()} != maps, "the new records: mapped again"


def _same(a: RecordBytes, b: RecordBytes) -> None:
    assert a.data == b.data
    assert a.start.tolist() == b.start.tolist() and a.start.dtype == b.start.dtype
    assert a.header.tobytes() == b.header.tobytes() and a.header.dtype == b.header.dtype
    assert a.ok.tolist() == b.ok.tolist()
    assert {k: str(e) for k, e in a.errors.items()} == {k: str(e) for k, e in b.errors.items()}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=4), st.booleans())
def test_a_few_rows_read_one_by_one_are_the_column_paths_bytes(tmp_path_factory: pytest.TempPathFactory,
                                                                rows: list[int], with_due: bool) -> None:
    """Up to `_FEW_ROWS` rows the compiled read does not take (not built) are checked one by one,
    not as columns: the same buffer, starts, headers and verdicts as the column path, however the
    rows are chosen."""
    store = ScheduleStore(tmp_path_factory.mktemp("few") / "data")
    try:
        recs = _records(12)
        segs, parts, offs, due = _stored(store, recs)
        idx = np.array(rows)
        args = (segs[idx], parts[idx], offs[idx], due[idx] if with_due else None)
        store.read_record_bytes(segs, parts, offs, due)  # every part mapped, as after the first send
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_reader, "gather_good", lambda *a: None)
            few = store.read_record_bytes(*args)
            mp.setattr(_reader, "_FEW_ROWS", 0)
            columns = store.read_record_bytes(*args)
        _same(few, columns)
    finally:
        store.close()


@pytest.mark.parametrize("damage", [
    dict(at=HEADER_SIZE + 1, new=b"X", fix_crc=False),
    dict(at=HEADER_SIZE + 4, new=b"\xff", fix_crc=True),
    dict(at=12, new=struct.pack("<q", NOW + 5), fix_crc=True),
], ids=["flipped-byte", "topic-not-utf8", "due-not-the-index's"])
def test_a_damaged_record_read_alone_is_refused_and_counted(store: ScheduleStore, damage: dict) -> None:
    """A send of one row whose record is bad: the few-rows path hands it to the column path, which
    says why and counts it."""
    recs = [Record(f"id-{i}", "TOPIC", b"body", NOW + 10 + i, tags="x", keys=("kk",)) for i in range(3)]
    segs, parts, offs, due = _stored(store, recs)
    store.read_record_bytes(segs, parts, offs, due)  # mapped before the damage
    _patch(store, int(segs[1]), int(parts[1]), int(offs[1]), **damage)
    before = store.corrupt_records_found
    got = store.read_record_bytes(segs[1:2], parts[1:2], offs[1:2], due[1:2])
    assert got.ok.tolist() == [False] and isinstance(got.errors[0], CorruptRecordError) and not got.data
    assert store.corrupt_records_found == before + 1
    assert store.read_record_bytes(segs[2:], parts[2:], offs[2:], due[2:]).ok.tolist() == [True]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 19), min_size=1, max_size=40), st.booleans(), st.integers(0, 3))
def test_good_rows_of_one_part_in_one_compiled_call_are_the_general_paths_bytes(
        tmp_path_factory: pytest.TempPathFactory, rows: list[int], with_due: bool, misdate: int) -> None:
    """A send batch's rows of one part, all good (the usual case), however few, are copied out in
    one compiled call: the same buffer, starts, headers and verdicts as the general path, whatever
    the rows (repeated, out of order), their text (not ASCII goes the general way) and their due
    times (one the index does not agree with goes the general way, and is found misdated there)."""
    store = ScheduleStore(tmp_path_factory.mktemp("good") / "data")
    try:
        recs = [Record(f"id-{i}", "тема" if i == 7 else f"T{i % 3}", f"body-{i}".encode() * (i % 5 + 1),
                       NOW + 10 + i, tags="tg" if i % 2 else "", keys=("k1", "ключ")[: i % 3],
                       properties={"p": str(i)} if i % 4 == 0 else {}) for i in range(20)]
        segs, parts, offs, due = _stored(store, recs)
        assert len(set(parts.tolist())) == len(set(segs.tolist())) == 1
        idx = np.array(rows)
        dues = due[idx].copy()
        if misdate:
            dues[misdate % len(dues)] += 1
        args = (segs[idx], parts[idx], offs[idx], dues if with_due else None)
        store.read_record_bytes(segs, parts, offs, due)  # the part mapped, as after the first send
        fast = store.read_record_bytes(*args)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_reader, "gather_good", lambda *a: None)
            mp.setattr(_reader, "_FEW_ROWS", 0)
            general = store.read_record_bytes(*args)
        _same(fast, general)
        assert general.ok.all() == (not (misdate and with_due))
    finally:
        store.close()


_text = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_text, st.lists(_text, max_size=3)), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_ids_and_keys_are_what_decoding_each_record_gives(tmp_path_factory: pytest.TempPathFactory,
                                                          rows: list[tuple[str, list[str]]]) -> None:
    s = ScheduleStore(tmp_path_factory.mktemp("ids"))
    try:
        recs = [Record(msg_id, "T", b"body " * k, NOW + 10 + k, keys=tuple(keys)) for k, (msg_id, keys) in enumerate(rows)]
        segs, parts, offs, due = _stored(s, recs)
        got = s.read_record_bytes(segs, parts, offs, due)
        assert got.ids_and_keys() == ([r.msg_id for r in recs], [r.keys for r in recs])
    finally:
        s.close()
