"""The rows of the brokers that served each target topic: their bytes in both forms, round trips, and
malformed text refused with `BrokerRowsError` naming what is wrong."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import (BrokerRowsError, broker_pairs_of, broker_rows_of, broker_rows_of_pairs, broker_topics_of,
                     decode_broker_array, decode_broker_lines, encode_broker_array, encode_broker_lines)
from storage.broker_rows import cut_torn

SAMPLE = {"T": {"broker-b", "broker-a"}, "U": {"broker-a"}, "T\u00f6": {"broker-\u00fc"}, "E": set()}
#: the sample as `dedupe-brokers.txt` has always held it
SAMPLE_FILE = (b"# brokers that served the engine's target topics, one JSON array a line: [broker, topic, ...]; "
               b"delete a broker's lines once it is gone for good (docs/OPERATIONS.md)\n"
               b'["broker-a", "T", "U"]\n["broker-b", "T"]\n["broker-\\u00fc", "T\\u00f6"]\n')
#: the sample as a part of the `dedupe-brokers` znode has always held it
SAMPLE_PART = b'[["broker-a","T","U"],["broker-b","T"],["broker-\\u00fc","T\\u00f6"]]'

names = st.text(min_size=1, max_size=12)
rows = st.lists(st.lists(names, min_size=1, max_size=4), max_size=6)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                        max_size=3), max_leaves=12)


def _is_row(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(s, str) and s for s in value)


def test_the_bytes_of_both_forms_are_the_ones_written_before() -> None:
    assert encode_broker_lines(broker_rows_of(SAMPLE)).encode() == SAMPLE_FILE
    assert encode_broker_array(broker_rows_of(SAMPLE)) == SAMPLE_PART
    assert encode_broker_array(broker_rows_of_pairs(broker_pairs_of(broker_rows_of(SAMPLE)))) == SAMPLE_PART
    assert encode_broker_array([]) == b"[]"


def test_what_was_written_before_still_reads() -> None:
    held = {t: bs for t, bs in SAMPLE.items() if bs}
    assert broker_topics_of(decode_broker_lines(SAMPLE_FILE.decode())) == held
    assert broker_topics_of(decode_broker_array(SAMPLE_PART)) == held
    edited = '# a note\n\n  # another\n["broker-a", "T"]\r\n   \n["broker-a", "U"]\n["broker-c"]\n'  # by hand
    assert broker_topics_of(decode_broker_lines(edited)) == {"T": {"broker-a"}, "U": {"broker-a"}}
    assert decode_broker_array(b"") == []


@pytest.mark.parametrize("data,said", [
    (b"{not json", "the array: not JSON"),
    (b"\xff", "the array: not JSON"),
    (b'{"a": 1}', "the array: an object, not an array of rows"),
    (b'[["a", "T"], 7]', "row 2: a number, not an array [broker, topic, ...]"),
    (b"[[]]", "row 1: an empty array, no broker name"),
    (b'[["", "T"]]', "row 1: the broker name is empty"),
    (b'[["a", "T", null]]', "row 1: topic 2 is null, not a string"),
    (b"[" * 100_000, "the array: nested too deeply"),
])
def test_a_malformed_part_is_refused_naming_what_is_wrong(data: bytes, said: str) -> None:
    with pytest.raises(BrokerRowsError, match="^" + re.escape(said)):
        decode_broker_array(data)


def test_a_malformed_line_is_refused_naming_it() -> None:
    with pytest.raises(BrokerRowsError, match=r"^line 3: not JSON .*'\[\"broker-b\", \"T\"'$"):
        decode_broker_lines('# header\n["broker-a", "T"]\n["broker-b", "T"\n')
    with pytest.raises(BrokerRowsError, match=r"^line 1: topic 1 is a boolean, not a string"):
        decode_broker_lines('["broker-a", true]\n')


@settings(max_examples=300, deadline=None)
@given(rows)
def test_rows_round_trip_through_both_forms(held: list[list[str]]) -> None:
    assert decode_broker_lines(encode_broker_lines(held)) == held
    assert decode_broker_array(encode_broker_array(held)) == held


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, st.sets(names, max_size=4), max_size=6))
def test_topics_round_trip_through_rows(topics: dict[str, set[str]]) -> None:
    made = broker_rows_of(topics)
    assert broker_topics_of(made) == {t: bs for t, bs in topics.items() if bs}
    assert [r[0] for r in made] == sorted({r[0] for r in made}), "one row a broker, in order"
    assert all(r[1:] == sorted(r[1:]) for r in made)
    assert broker_rows_of_pairs(broker_pairs_of(made)) == made


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_that_is_not_rows_is_refused_with_the_typed_error(value: object) -> None:
    data = json.dumps(value).encode()
    if isinstance(value, list) and all(_is_row(r) for r in value):
        assert decode_broker_array(data) == value
    else:
        with pytest.raises(BrokerRowsError):
            decode_broker_array(data)
    line = json.dumps(value)
    if _is_row(value):
        assert decode_broker_lines(line) == [value]
    else:
        with pytest.raises(BrokerRowsError):
            decode_broker_lines(line)


@pytest.mark.parametrize("decode,inputs", [
    pytest.param(decode_broker_array, st.binary(max_size=40) | st.text(max_size=40).map(str.encode), id="array"),
    pytest.param(decode_broker_lines, st.text(max_size=60), id="lines"),
])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_arbitrary_input_reads_as_rows_or_raises_the_typed_error(decode: Callable[[Any], list[list[str]]],
                                                                 inputs: st.SearchStrategy[Any],
                                                                 data: st.DataObject) -> None:
    try:
        read = decode(data.draw(inputs))
    except BrokerRowsError:
        return
    assert all(_is_row(r) for r in read)


@pytest.mark.parametrize("tail,cut", [
    (b"", False),
    (b'["broker-c", "V"', True),
    (b'["broker-c", "V", "W\\u00', True),
    (b'["broker-c", "\xc3', True),  # cut inside a character
    (b'["broker-c", "V"]', False),  # a whole row, its line break missing: an edit by hand, kept
    (b"# a note", False),
    (b"  ", False),
])
def test_a_torn_last_line_is_set_apart_and_nothing_else(tail: bytes, cut: bool) -> None:
    data = SAMPLE_FILE + encode_broker_lines([["broker-a", "V"]], header=False).encode() + tail
    assert cut_torn(data) == ((data[: len(data) - len(tail)], tail) if cut else (data, b""))


def test_a_bad_line_before_the_last_is_not_cut() -> None:
    data = SAMPLE_FILE + b'["broker-c", "V"\n["broker-d", "W'
    kept, torn = cut_torn(data)
    assert torn == b'["broker-d", "W' and kept == SAMPLE_FILE + b'["broker-c", "V"\n'
    with pytest.raises(BrokerRowsError, match="^line 5: not JSON"):
        decode_broker_lines(kept.decode())


@settings(max_examples=300, deadline=None)
@given(rows, rows, st.data())
def test_rows_appended_read_back_merged_and_any_torn_append_cut_to_the_rows_before(
        first: list[list[str]], later: list[list[str]], data: st.DataObject) -> None:
    whole = encode_broker_lines(first).encode()
    appended = encode_broker_lines(later, header=False).encode()
    assert broker_topics_of(decode_broker_lines((whole + appended).decode())) == broker_topics_of(first + later)
    torn = appended[: data.draw(st.integers(0, len(appended)))]
    whole_lines = torn.count(b"\n") + appended[len(torn):].startswith(b"\n")  # torn before a line break only
    kept, cut = cut_torn(whole + torn)
    assert kept + cut == whole + torn
    assert decode_broker_lines(kept.decode()) == first + later[:whole_lines]
    assert cut == (b"" if appended[len(torn):].startswith(b"\n") else torn[torn.rfind(b"\n") + 1:])
