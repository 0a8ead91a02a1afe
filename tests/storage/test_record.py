"""The record codec: round trips, pinned bytes, and corruption always raising the codec's error."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import CorruptRecordError, InvalidRecordError, Record, decode, encode
from storage.record import HEADER_SIZE

text = st.text(min_size=1, max_size=40)
records = st.builds(
    Record,
    msg_id=text,
    topic=text,
    body=st.binary(max_size=2000),
    due_ms=st.integers(-(2**62), 2**62),
    enqueue_ms=st.integers(0, 2**62),
    tags=st.text(max_size=20),
    keys=st.lists(st.text(max_size=20), max_size=5).map(tuple),
    properties=st.dictionaries(st.text(max_size=20), st.text(max_size=50), max_size=6),
)


@settings(max_examples=500)
@given(records)
def test_round_trip(rec: Record) -> None:
    blob = encode(rec)
    back, length = decode(blob)
    assert back == rec
    assert length == len(blob)


@settings(max_examples=300)
@given(records, st.data())
def test_any_truncation_raises_corruption(rec: Record, data: st.DataObject) -> None:
    blob = encode(rec)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptRecordError):
        decode(blob[:cut])


@settings(max_examples=300)
@given(records, st.data())
def test_any_flipped_byte_raises_corruption(rec: Record, data: st.DataObject) -> None:
    blob = bytearray(encode(rec))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecordError):
        decode(bytes(blob))


@settings(max_examples=1000)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(raw: bytes) -> None:
    try:
        decode(raw)
    except CorruptRecordError:
        pass


PINNED = Record("m1", "T", b"hi", 1_700_000_000_000, 1_600_000_000_000, "tg", ("k",), {"a": "b"})


@pytest.mark.parametrize(
    "rec,hex_prefix,crc",
    [pytest.param(PINNED, "a7010000", 0x3830BEC0, id="all-fields"),
     pytest.param(Record("x", "y", b"", 0), "a7010000", None, id="minimal")],
)
def test_pinned_bytes(rec: Record, hex_prefix: str, crc: int | None) -> None:
    blob = encode(rec)
    assert blob[:4].hex() == hex_prefix
    assert int.from_bytes(blob[4:8], "little") == len(blob)
    if crc is not None:
        assert int.from_bytes(blob[8:12], "little") == crc
    assert decode(blob)[0] == rec


def test_layout_of_pinned_record() -> None:
    blob = encode(PINNED)
    assert len(blob) == HEADER_SIZE + 2 + 1 + 2 + (2 + 1) + (2 + 1 + 2 + 1) + 2
    assert blob[HEADER_SIZE:HEADER_SIZE + 2] == b"m1"
    assert blob.endswith(b"hi")


@pytest.mark.parametrize("rec,msg", [
    (Record("", "T", b"", 0), "message id"),
    (Record("id", "", b"", 0), "target topic"),
    (Record("id", "T" * 70000, b"", 0), "exceed"),
])
def test_invalid_records_are_refused(rec: Record, msg: str) -> None:
    with pytest.raises(InvalidRecordError, match=msg):
        encode(rec)
