"""Send batches built from stored records in one pass (`cut_records`): byte for byte the request
bodies of the general path (`delivered_ids`, then `encode_records`, then `cut_encoded`), the same
ids, the same refusals, for both the scalar path (a few rows) and the column path."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from forwarder import record_batches
from forwarder.record_batches import SCALAR_ROWS, cut_records
from forwarder.record_encoding import delivered_ids, encode_records
from forwarder.rocketmq import BROKER_MAX_MESSAGE_BYTES, OutgoingMessage, RemotingError
from forwarder.rocketmq._send_batch import Outcome, cut_encoded
from storage import Record, RecordBytes, ScheduleStore

NOW = 1_800_000_000_000
_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=10)
_RESERVED_NAMES = ("UNIQ_KEY", "TAGS", "KEYS", "WAIT", "TW_DUE_MS", "TW_ORIGINAL_MSG_ID", "TW_LEASE_EPOCH")
_LONG = "k" * 33_000  # its properties exceed RocketMQ's 32767 bytes
_ids = st.one_of(_text.filter(bool), st.sampled_from(["a\x01b", "a\x00", "ü-組:1"]))  # the store holds no empty id
_tags = st.one_of(_text, st.sampled_from(["bad\x02tag", _LONG]))
_keys = st.one_of(st.lists(st.one_of(_text, st.just("k\x01")), max_size=3), st.just([_LONG]),
                 st.sampled_from([[""], ["", ""]]))  # one empty key is no KEYS; two are a space
_props = st.dictionaries(st.one_of(_text.filter(bool), st.sampled_from(_RESERVED_NAMES)), _text, max_size=3)
_topics = st.sampled_from(["T", "Orders", "тема-組", "A%B"])
_records = st.lists(st.tuples(_ids, _topics, st.integers(0, 600), _tags, _keys,
                              st.one_of(st.just({}), _props), st.integers(0, 10**6)), min_size=1, max_size=40)
_Row = tuple[str, str, int, str, list[str], dict[str, str], int]  # id, topic, body size, tags, keys, properties, due


def _fresh(n: int) -> list[str]:
    return [f"F{k:031X}" for k in range(n)]


def _read(store: ScheduleStore, records: list[Record]) -> RecordBytes:
    locs = store.append(records, NOW).locations
    locs = locs[np.sort(np.unique(locs["offset"], return_index=True)[1])]  # repeated ids are stored once
    got = store.read_record_bytes(locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16),
                                  locs["offset"].astype(np.uint32))
    assert got.ok.all()
    return got


def _general(raw: RecordBytes, extra: dict[str, str] | None, max_message: int, max_count: int,
             max_bytes: int) -> tuple[list, dict[int, RemotingError], list[str]]:
    """The reference: each step over every row in turn."""
    ids = delivered_ids(raw, _fresh)
    topics = raw.topics()
    out: list[Outcome] = [None] * len(raw)
    batches = cut_encoded(topics, encode_records(raw, ids, extra), ids, {t: object() for t in topics},  # type: ignore[misc]
                          out, max_message=max_message, max_count=max_count, max_bytes=max_bytes)
    errors = {i: o for i, o in enumerate(out) if isinstance(o, RemotingError)}
    return [(b.topic, b.index, b.ids, b"".join(b.parts)) for b in batches], errors, ids


def _assert_same(raw: RecordBytes, extra: dict[str, str] | None, max_message: int, max_count: int,
                 max_bytes: int) -> None:
    for scalar_rows in (0, 1 << 20):  # the column path and the scalar path, whatever the number of rows
        for compiled in (True, False):  # with the compiled loop taking the plainest rows, and without
            with _scalar_rows(scalar_rows), _compiled(compiled):
                _assert_same_once(raw, extra, max_message, max_count, max_bytes)


@contextlib.contextmanager
def _compiled(on: bool) -> Iterator[None]:
    assert record_batches.COMPILED, "forwarder/_record_cut.pyx was not built: run `make setup` again"
    was = record_batches._compiled_cut
    record_batches._compiled_cut = was if on else None
    try:
        yield
    finally:
        record_batches._compiled_cut = was


@contextlib.contextmanager
def _scalar_rows(n: int) -> Iterator[None]:
    was = record_batches.SCALAR_ROWS
    record_batches.SCALAR_ROWS = n
    try:
        yield
    finally:
        record_batches.SCALAR_ROWS = was


def _assert_same_once(raw: RecordBytes, extra: dict[str, str] | None, max_message: int, max_count: int,
                      max_bytes: int) -> None:
    want, want_errors, want_ids = _general(raw, extra, max_message, max_count, max_bytes)
    cut = cut_records(raw, _fresh, extra, max_message=max_message, max_count=max_count, max_bytes=max_bytes)
    assert cut.ids == want_ids
    assert [(b.topic, b.index, b.ids, b"".join(b.parts)) for b in cut.batches] == want
    assert sum(b.size for b in cut.batches) == sum(len(w[3]) for w in want)
    got_errors = {i: e for i, _, e in cut.rejected}
    assert {i: (type(e), str(e)) for i, e in got_errors.items()} == {
        i: (type(e), str(e)) for i, e in want_errors.items()}
    topics = raw.topics()
    assert all(t == topics[i] for i, t, _ in cut.rejected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_records, st.sampled_from([None, {"TW_LEASE_EPOCH": "7"}, {"TW_LEASE_EPOCH": "9", "x%s": "%d%%ü"}]),
       st.integers(300, 1200),
       st.integers(1, 8), st.integers(1, 4000))
def test_one_pass_bodies_are_the_general_paths_byte_for_byte(tmp_path_factory: pytest.TempPathFactory,
                                                              rows: list[_Row], extra: dict[str, str] | None,
                                                              max_message: int, max_count: int, max_bytes: int) -> None:
    """Empty and limit-sized bodies, unicode, reserved property names, separators, no id, long keys."""
    with ScheduleStore(tmp_path_factory.mktemp("d") / "data") as store:
        records = [Record(mid, topic, bytes([i % 251]) * n, NOW + due, tags=tags, keys=tuple(keys), properties=props)
                   for i, (mid, topic, n, tags, keys, props, due) in enumerate(rows)]
        _assert_same(_read(store, records), extra, max_message, max_count, max_bytes)


def test_bodies_at_the_brokers_size_limit_and_both_paths(tmp_path: Path) -> None:
    """A message of exactly the broker's maximum goes, one byte more is refused; many rows take the
    column path, a few the scalar path."""
    with ScheduleStore(tmp_path / "data") as store:
        small = [Record(f"id-{i}", "T", b"", NOW + i, tags="t", keys=("k",)) for i in range(SCALAR_ROWS + 5)]
        raw = _read(store, small)
        _assert_same(raw, None, BROKER_MAX_MESSAGE_BYTES, 128, 1 << 20)
        _assert_same(raw.select(np.arange(3)), None, BROKER_MAX_MESSAGE_BYTES, 128, 1 << 20)
        one = _read(store, [Record(f"big-{BROKER_MAX_MESSAGE_BYTES}", "T", b"", NOW + 1)])
        overhead = len(b"".join(cut_records(one, _fresh, max_message=BROKER_MAX_MESSAGE_BYTES, max_count=1,
                                            max_bytes=BROKER_MAX_MESSAGE_BYTES).batches[0].parts))
        for n, refused in ((BROKER_MAX_MESSAGE_BYTES - overhead, []), (BROKER_MAX_MESSAGE_BYTES - overhead + 1, [0])):
            big = _read(store, [Record(f"big-{n}", "T", b"b" * n, NOW + 1), Record(f"x-{n}", "T", b"x", NOW + 2)])
            _assert_same(big, None, BROKER_MAX_MESSAGE_BYTES, 128, BROKER_MAX_MESSAGE_BYTES)
            cut = cut_records(big, _fresh, max_message=BROKER_MAX_MESSAGE_BYTES, max_count=128,
                              max_bytes=BROKER_MAX_MESSAGE_BYTES)
            assert [i for i, _, _ in cut.rejected] == refused


def test_records_with_properties_of_their_own_stay_on_the_one_pass(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Users' properties are common: such a row is not encoded message by message (the byte-equality
    test above cannot tell which way a row went); one named as a property delivery sets is."""
    general: list[int] = []
    real = record_batches.encode_message

    def encode_message(msg: OutgoingMessage, msg_id: str) -> bytes:
        general.append(1)
        return real(msg, msg_id)

    monkeypatch.setattr(record_batches, "encode_message", encode_message)
    with ScheduleStore(tmp_path / "data") as store:
        raw = _read(store, [Record(f"id{i}", "T", b"x" * 10, NOW + 5, properties={"BENCH_ID": str(i), "k": "v"})
                            for i in range(SCALAR_ROWS + 8)]
                    + [Record("clash", "T", b"y", NOW + 5, properties={"TW_DUE_MS": "1"})])
        for extra in (None, {"TW_LEASE_EPOCH": "3"}):
            general.clear()
            _assert_same_once(raw, extra, BROKER_MAX_MESSAGE_BYTES, 256, 4 << 20)
            cut = cut_records(raw, _fresh, extra, max_message=BROKER_MAX_MESSAGE_BYTES, max_count=256,
                              max_bytes=4 << 20)
            assert sum(len(b.index) for b in cut.batches) == len(raw)
            assert len(general) == 2, "each of the two cuts (the comparison's and this one) encodes the clash alone"


def test_an_empty_key_is_no_keys_on_every_path(tmp_path: Path) -> None:
    """A record stored with one empty key goes without KEYS (the general path joins its keys to
    nothing), two empty keys with a space; in a batch of several rows, where the compiled loop cuts."""
    recs = [Record(f"id-{i}", "T", b"x", NOW + i, keys=keys)
            for i, keys in enumerate([("",), ("a",), ("", ""), ("",), ()])]
    with ScheduleStore(tmp_path / "data") as store:
        raw = _read(store, recs)
    want, _, _ = _general(raw, None, BROKER_MAX_MESSAGE_BYTES, 128, 1 << 20)
    assert b"KEYS\x01\x02" not in want[0][3] and b"KEYS\x01 \x02" in want[0][3]
    _assert_same(raw, None, BROKER_MAX_MESSAGE_BYTES, 128, 1 << 20)
