"""Dispatch frames that keep the broker's answers and a note (TWD3) beside older frames."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import (DEAD_LETTERED, DELIVERED, RETRIED, ScheduleStore, broker_message_id, broker_message_ids,
                     dispatch_entries,
                     encode_frame, no_answers, read_dispatch_entries_of, read_dispatch_log)
from storage.dispatch import ANSWER_DTYPE

NOW = 1_700_000_000_000


def _entries(first: int, n: int, outcome: int = DELIVERED) -> np.ndarray:
    offs = np.arange(first, first + n, dtype=np.uint32) * 100
    return dispatch_entries(1, offs, offs.astype(np.int64) + NOW, NOW, outcome, 2)


def _answers(first: int, n: int) -> np.ndarray:
    a = np.zeros(n, ANSWER_DTYPE)
    a["queue_offset"] = np.arange(first, first + n) + 1000
    a["commit_offset"] = np.arange(first, first + n) * 512
    a["store_ip"] = [127, 0, 0, 1]
    a["store_port"] = 10911
    a["queue_id"] = 3
    return a


def test_answers_and_notes_come_back_aligned_with_their_entries(tmp_path: Path) -> None:
    path = tmp_path / "dispatch.log"
    path.write_bytes(encode_frame(_entries(0, 3), NOW)
                     + encode_frame(_entries(3, 2), NOW, _answers(3, 2))
                     + encode_frame(_entries(5, 1, RETRIED), NOW, note="broker busy: [TIMEOUT_CLEAN_QUEUE]")
                     + encode_frame(_entries(6, 2, DEAD_LETTERED), NOW, note="not delivered after 3 attempts"))
    read = read_dispatch_log(path)
    assert read.corrupt_frames == 0 and read.torn_bytes == 0
    assert (read.entries["offset"] == np.arange(8) * 100).all()
    assert read.entries["outcome"].tolist() == [1, 1, 1, 1, 1, 6, 2, 2]
    assert read.answers["queue_offset"].tolist() == [-1, -1, -1, 1003, 1004, -1, -1, -1]
    assert [read.notes[i] if i >= 0 else None for i in read.note.tolist()] == \
        [None] * 5 + ["broker busy: [TIMEOUT_CLEAN_QUEUE]"] + ["not delivered after 3 attempts"] * 2


def test_the_broker_message_id_is_store_host_port_and_commit_offset() -> None:
    a = _answers(7, 1)[0]
    # what a 5.x broker answers for 127.0.0.1:10911 at commit-log offset 3584
    assert broker_message_id(a) == "7F00000100002A9F0000000000000E00"
    assert broker_message_id(no_answers(1)[0]) is None


def test_the_engine_writes_answers_through_the_store(tmp_path: Path) -> None:
    with ScheduleStore(tmp_path) as s:
        seg = s.layout.segment_start(NOW)
        s.record_dispatch(seg, _entries(0, 2), NOW, _answers(0, 2))
        s.record_dispatch(seg, _entries(2, 1, RETRIED), NOW, note="timeout")
        read = s.dispatch_log(seg)
    assert read.answers["commit_offset"].tolist() == [0, 512, 0]
    assert read.notes == ["timeout"] and read.note.tolist() == [-1, -1, 0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["plain", "answered", "noted"])), min_size=1,
                max_size=6), st.data())
def test_a_flipped_byte_loses_only_its_own_frame_whatever_the_versions(frames: list[tuple[int, str]],
                                                                       data: st.DataObject) -> None:
    blobs, wants, first = [], [], 0
    for n, kind in frames:
        e = _entries(first, n)
        blobs.append(encode_frame(e, NOW, _answers(first, n) if kind == "answered" else None,
                                  "a note that spans more than one row of the log" if kind == "noted" else ""))
        wants.append((e, _answers(first, n) if kind == "answered" else no_answers(n)))
        first += n
    raw = bytearray(b"".join(blobs))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    hit = int(np.searchsorted(np.cumsum([len(b) for b in blobs]), at, side="right"))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "dispatch.log"
        path.write_bytes(bytes(raw))
        read = read_dispatch_log(path)
    kept = [w for i, w in enumerate(wants) if i != hit]
    want_e = np.concatenate([e for e, _ in kept]) if kept else _entries(0, 0)
    want_a = np.concatenate([a for _, a in kept]) if kept else no_answers(0)
    assert read.entries.tobytes() == want_e.tobytes()
    assert read.answers.tobytes() == want_a.tobytes()
    assert read.corrupt_frames + (read.torn_bytes > 0) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["plain", "answered", "noted"])), min_size=1,
                max_size=6), st.data())
def test_the_look_up_of_a_few_records_agrees_with_reading_the_whole_log(frames: list[tuple[int, str]],
                                                                        data: st.DataObject) -> None:
    blobs, first = [], 0
    for n, kind in frames:
        e = _entries(first % 5, n)  # offsets repeat: a record may have several entries
        blobs.append(encode_frame(e, NOW, _answers(first, n) if kind == "answered" else None,
                                  "retried: broker busy" if kind == "noted" else ""))
        first += n
    raw = bytearray(b"".join(blobs))
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):  # read while a frame is being appended: the file ends anywhere
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    wanted = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "dispatch.log"
        path.write_bytes(bytes(raw))
        whole = read_dispatch_log(path)
        some = read_dispatch_entries_of(path, np.ones(len(wanted), np.uint16), np.asarray(wanted, np.uint32) * 100)
    keep = np.isin(whole.entries["offset"], np.asarray(wanted) * 100)
    assert some.entries.tobytes() == whole.entries[keep].tobytes()
    assert some.answers.tobytes() == whole.answers[keep].tobytes()
    assert [some.notes[i] if i >= 0 else None for i in some.note.tolist()] == \
        [whole.notes[i] if i >= 0 else None for i in whole.note[keep].tolist()]


def test_the_ids_of_a_batch_at_once_are_the_ids_one_by_one() -> None:
    answers = np.concatenate([_answers(0, 3), no_answers(2), _answers(9, 1)])
    answers["store_ip"][1] = 0  # an IPv6 store host: not recorded
    assert broker_message_ids(answers) == [broker_message_id(a) or "" for a in answers]
    ids = broker_message_ids(answers)
    assert [ids[i] for i in (1, 3, 4)] == ["", "", ""] and all(len(ids[i]) == 32 for i in (0, 2, 5))
