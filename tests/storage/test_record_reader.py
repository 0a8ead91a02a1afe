"""The one reader of the record layout (`storage.record_reader`): its scalar path (a walk with
`check_record`), its column path (numpy), its compiled scan and `decode` give the same columns, verdicts
and errors, on good records and on damaged ones (flipped bytes, with or without a CRC that matches again, truncation,
an index whose due time or length disagrees)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import CorruptRecordError, Record, decode, encode
from storage.record import HEADER, HEADER_SIZE, check_record, crc32c
from storage.record_reader import (COMPILED, HEADER_DTYPE, SMALL, CheckedRecords, _check_all, _check_each, _scan_all,
                                   check_records)

T0 = 1_800_000_000_000
text = (st.text(max_size=8) | st.text(alphabet="abcXYZ-:0123456789", max_size=12)
        | st.text(alphabet="aé", min_size=120, max_size=140)  # past the column path's ASCII window
        | st.text(alphabet="bc", min_size=300, max_size=400))  # ASCII past it
record = st.builds(
    lambda i, topic, body, due, tags, keys, props: Record(f"{i}-{topic}", topic or "T", body, T0 + due, T0, tags,
                                                          tuple(keys), props),
    st.integers(0, 10**6), text, st.binary(max_size=40), st.integers(-5, 5), text, st.lists(text, max_size=3),
    st.dictionaries(text, text, max_size=2))
damage = st.tuples(st.sampled_from(["flip", "flip+crc", "due", "length", "offset"]), st.integers(0, 10**6),
                   st.integers(1, 255))


def _damaged(blobs: list[bytes], dues: list[int], damages: list[tuple[str, int, int]],
             cut: int | None) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """The records back to back with damage done; offsets, the index's due times and lengths."""
    offs = np.cumsum([0] + [len(b) for b in blobs[:-1]]).astype(np.int64)
    at_first = offs.copy()
    buf = bytearray(b"".join(blobs))
    due, lengths = np.array(dues, np.int64), np.array([len(b) for b in blobs], np.int64)
    for kind, at, value in damages:
        row = at % len(blobs)
        o, n = int(at_first[row]), len(blobs[row])
        if kind.startswith("flip"):
            buf[o + at % n] ^= value
            if kind == "flip+crc":  # the damage a CRC cannot see: only the other checks find it
                ln = struct.unpack_from("<I", buf, o + 4)[0]
                if HEADER_SIZE <= ln and o + ln <= len(buf):
                    struct.pack_into("<I", buf, o + 8, crc32c(bytes(buf[o + 12:o + ln])))
        elif kind == "due":
            due[row] += value
        elif kind == "length":
            lengths[row] += value
        else:
            offs[row] += value
    if cut is not None:
        buf = buf[:cut % (len(buf) + 1)]
    return bytes(buf), offs, due, lengths


def _same(a: CheckedRecords, b: CheckedRecords) -> None:
    assert a.offset.tolist() == b.offset.tolist()
    assert a.ok.tolist() == b.ok.tolist()
    assert a.header.tobytes() == b.header.tobytes()
    assert {k: (e.reason, e.offset, e.record_due_ms) for k, e in a.errors.items()} == \
        {k: (e.reason, e.offset, e.record_due_ms) for k, e in b.errors.items()}
    assert [x.tolist() for x in a.field_starts()] == [x.tolist() for x in b.field_starts()]


def test_the_compiled_scan_is_built() -> None:
    """`pip install` builds it where a C compiler is (as here): without it the Python paths run."""
    assert COMPILED, "storage/_record_scan.pyx was not built: run `make setup` again and read its warnings"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(record, min_size=1, max_size=20), st.lists(damage, max_size=4),
       st.none() | st.integers(0, 10**6), st.booleans(), st.booleans(), st.booleans())
def test_scalar_and_column_paths_agree(recs: list[Record], damages: list, cut: int | None, with_due: bool,
                                       with_length: bool, verify: bool) -> None:
    buf, offs, due, lengths = _damaged([encode(r) for r in recs], [r.due_ms for r in recs], damages, cut)
    args = (due if with_due else None, lengths if with_length else None, verify)
    with memoryview(buf) as mv:
        each, cols = _check_each(mv, offs, *args), _check_all(mv, offs, *args)
        scanned = _scan_all(mv, offs, *args) if COMPILED else cols
    _same(each, cols)
    _same(each, scanned)
    for i, o in enumerate(offs.tolist()):  # and both are check_record's verdicts
        try:
            h = check_record(buf, o, due_ms=int(due[i]) if with_due else None,
                             length=int(lengths[i]) if with_length else None, verify_crc=verify)
        except CorruptRecordError as e:
            assert not each.ok[i] and each.errors[i].reason == e.reason
        else:
            assert each.ok[i] and tuple(each.header[i].tolist()) == h
    if not damages and cut is None:
        assert each.ok.all()
    for i, o in enumerate(offs.tolist()):  # decode (read_records' path) refuses with the same words
        d = int(due[i]) if with_due else None
        try:
            check_record(buf, o, due_ms=d)
        except CorruptRecordError as e:
            with pytest.raises(CorruptRecordError) as raised:
                decode(buf, o, due_ms=d)
            assert (raised.value.reason, raised.value.record_due_ms) == (e.reason, e.record_due_ms)
        else:
            assert decode(buf, o, due_ms=d)[0].due_ms == d or d is None


@settings(max_examples=30, deadline=None)
@given(st.lists(record, min_size=1, max_size=3 * SMALL))
def test_fields_slice_out_what_decode_gives(recs: list[Record]) -> None:
    blobs = [encode(r) for r in recs]
    buf = b"".join(blobs)
    offs = np.cumsum([0] + [len(b) for b in blobs[:-1]])
    got = check_records(buf, offs, due_ms=np.array([r.due_ms for r in recs]))
    starts, lens = got.field_starts(), got.field_lengths()
    for i, o in enumerate(offs.tolist()):
        rec = decode(buf, o)[0]
        ids, topic, tags, _, _, body = (buf[s[i]:s[i] + n[i]] for s, n in zip(starts, lens))
        assert (ids.decode(), topic.decode(), tags.decode(), body) == (rec.msg_id, rec.topic, rec.tags, rec.body)


def test_header_dtype_is_the_struct() -> None:
    blob = encode(Record("id-1", "TOPIC", b"\x00body", T0 + 5, T0, "tag", ("k1", "k2"), {"p": "v"}))
    assert tuple(np.frombuffer(blob[:HEADER.size], HEADER_DTYPE)[0].tolist()) == HEADER.unpack_from(blob)


@pytest.mark.parametrize("n", [1, SMALL + 1])
def test_only_the_due_time_disagreeing_carries_the_records(n: int) -> None:
    blobs = [encode(Record(f"id-{i}", "T", b"b", T0 + i)) for i in range(n)]
    offs = np.cumsum([0] + [len(b) for b in blobs[:-1]])
    due = np.arange(n) + T0
    due[0] += 7
    got = check_records(b"".join(blobs), offs, due_ms=due)
    assert got.ok.tolist() == [False] + [True] * (n - 1)
    assert got.errors[0].record_due_ms == T0 and "index says" in got.errors[0].reason


def test_many_rows_are_checked_in_chunks_to_the_same_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    import storage.record_reader as reader
    monkeypatch.setattr(reader, "_CHUNK", 20)
    blobs = [encode(Record(f"id-{i}", "T", b"b" * i, T0 + i)) for i in range(50)]
    buf, offs, due, lengths = _damaged(blobs, [T0 + i for i in range(50)], [("due", 37, 3), ("flip", 3, 1)], None)
    with memoryview(buf) as mv:
        _same(check_records(buf, offs, due_ms=due, lengths=lengths), _check_each(mv, offs, due, lengths, True))
    assert check_records(buf, offs, due_ms=due).errors[37].record_due_ms == T0 + 37
