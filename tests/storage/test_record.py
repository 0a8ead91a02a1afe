"""The record codec: round trips, pinned bytes, and corruption always raising the codec's error."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import CorruptRecordError, InvalidRecordError, Record, decode, encode
from storage.record import HEADER_SIZE, MAX_BODY, MAX_FIELD, MAX_PROPERTIES

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


def _props_of_size(total: int) -> dict[str, str]:
    """Properties whose encoding is exactly `total` bytes (0, or at least 5)."""
    props: dict[str, str] = {}
    full = 4 + 5 + MAX_FIELD  # one entry: two uint16 lengths, a 5-byte key, the longest value
    while total >= full + 5:
        props[f"k{len(props):04d}"] = "v" * MAX_FIELD
        total -= full
    if total:
        props["z"] = "v" * (total - 5)
    return props


def _near(limit: int) -> st.SearchStrategy[int]:
    """Sizes a little under, at and over a limit, and small ones."""
    return st.one_of(st.integers(1, 4), st.integers(limit - 2, limit + 2))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_anything_encode_accepts_decode_returns(data: st.DataObject) -> None:
    """The limits of encode and decode are one definition: a record near every limit either is refused
    when encoded or round-trips."""
    id_len, topic_len, tags_len = (data.draw(_near(MAX_FIELD)) for _ in range(3))
    keys_len = data.draw(_near(MAX_FIELD))
    props_len = data.draw(st.one_of(st.just(0), _near(MAX_PROPERTIES).filter(lambda n: n >= 5)))
    body_len = data.draw(st.one_of(st.integers(0, 4), st.integers(MAX_BODY - 2, MAX_BODY + 2)))
    due = data.draw(st.one_of(st.integers(-(2**63) - 1, -(2**63) + 1), st.integers(2**63 - 2, 2**63),
                              st.integers(0, 2**41)))
    rec = Record("i" * id_len, "t" * topic_len, b"b" * body_len, due, 0, "g" * tags_len,
                 ("k" * max(keys_len - 2, 0),), _props_of_size(props_len))
    try:
        blob = encode(rec)
    except InvalidRecordError:
        return
    assert decode(blob) == (rec, len(blob))
