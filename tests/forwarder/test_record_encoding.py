"""Delivered messages encoded straight from stored records: byte for byte what the general path
(`encode_message(to_outgoing(Message.from_record(...)))`) sends, and the same refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from forwarder.contract import to_outgoing
from forwarder.record_encoding import encode_records
from forwarder.rocketmq.codec import encode_message
from forwarder.rocketmq.errors import MessageRejectedError
from storage import Record, RecordBytes, ScheduleStore
from timewheel.message import Message

NOW = 1_800_000_000_000
_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


def _read(store: ScheduleStore, records: list[Record]) -> RecordBytes:
    locs = store.append(records, NOW).locations
    new = np.unique(locs["offset"], return_index=True)[1]  # repeated ids are stored once
    locs = locs[np.sort(new)]
    got = store.read_record_bytes(locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16),
                                  locs["offset"].astype(np.uint32))
    assert got.ok.all()
    return got


def _general(raw: RecordBytes, i: int, msg_id: str) -> bytes | MessageRejectedError:
    try:
        return encode_message(to_outgoing(Message.from_record(raw.record(i))), msg_id)
    except MessageRejectedError as e:
        return e


def _same(a: bytes | MessageRejectedError, b: bytes | MessageRejectedError) -> bool:
    if isinstance(a, MessageRejectedError) or isinstance(b, MessageRejectedError):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_text, st.binary(max_size=40), st.lists(_text, max_size=3),
                          st.dictionaries(_text.filter(bool), _text, max_size=2), st.integers(0, 10**6)),
                min_size=1, max_size=8))
def test_every_record_encodes_as_the_general_path_does(
        tmp_path_factory: pytest.TempPathFactory,
        rows: list[tuple[str, bytes, list[str], dict[str, str], int]]) -> None:
    """Tags, keys (none, one, several, empty), properties, separators and all."""
    with ScheduleStore(tmp_path_factory.mktemp("d") / "data") as store:
        records = [Record(f"id\x01{i}" if i == 3 else f"id-{i}", "TOPIC", body, NOW + due, tags=tags,
                          keys=tuple(keys), properties=props)
                   for i, (tags, body, keys, props, due) in enumerate(rows)]
        raw = _read(store, records)
        ids = [f"{i:032X}" for i in range(len(raw))]
        fast = encode_records(raw, ids)
        for i in range(len(raw)):
            assert _same(fast[i], _general(raw, i, ids[i])), i


def test_a_separator_in_tags_is_refused_as_the_general_path_refuses_it(tmp_path: Path) -> None:
    with ScheduleStore(tmp_path / "data") as store:
        raw = _read(store, [Record("a", "T", b"x", NOW + 1), Record("b", "T", b"y", NOW + 2, tags="bad\x02tag")])
        out = encode_records(raw, ["1" * 32, "2" * 32])
        assert isinstance(out[0], bytes) and out[0] == _general(raw, 0, "1" * 32)
        assert isinstance(out[1], MessageRejectedError) and "separators" in str(out[1])


def test_extra_properties_go_on_every_message_by_either_path(tmp_path: Path) -> None:
    """A replica's epoch on a record without properties (fast path) and one with them (general path)."""
    import struct

    from forwarder.rocketmq.message import split_properties

    with ScheduleStore(tmp_path / "data") as store:
        raw = _read(store, [Record("a", "T", b"x", NOW + 1, tags="t", keys=("k",)),
                            Record("b", "T", b"y", NOW + 2, properties={"p": "q"})])
        plain = encode_records(raw, ["1" * 32, "2" * 32])
        stamped = encode_records(raw, ["1" * 32, "2" * 32], {"TW_LEASE_EPOCH": "7"})
    for without, with_epoch in zip(plain, stamped):
        assert isinstance(without, bytes) and isinstance(with_epoch, bytes)

        def props(data: bytes) -> dict[str, str]:
            # a batch body entry: total, magic, body crc, flag, body length + body, properties length + text
            (body_len,) = struct.unpack_from(">i", data, 16)
            (n,) = struct.unpack_from(">h", data, 20 + body_len)
            return split_properties(data[22 + body_len:22 + body_len + n].decode())

        assert props(with_epoch) == {**props(without), "TW_LEASE_EPOCH": "7"}


def test_each_row_goes_under_the_id_derived_from_its_stored_id_and_due_time(tmp_path: Path) -> None:
    from forwarder.contract import delivered_id
    from forwarder.record_encoding import delivered_ids

    with ScheduleStore(tmp_path) as store:
        raw = _read(store, [Record("ü-a:1", "T", b"x", NOW + 1), Record("b:2", "T", b"y", NOW + 2, tags="t")])
        assert delivered_ids(raw, lambda n: ["FRESH"] * n) == [delivered_id("ü-a:1", NOW + 1),
                                                               delivered_id("b:2", NOW + 2)]
