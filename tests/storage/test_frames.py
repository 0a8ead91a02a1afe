"""Frames the store trusts (ingest log, dispatch log) under flipped bytes: a CRC covers every field."""
from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import DELIVERED, Record, ScheduleStore, check, dispatch_entries, encode, encode_frame, read_dispatch_log
from storage.dispatch import _HEADER_DTYPE, FRAME_MAGIC, FRAME_MAGIC_V3, ROW_SIZE, frame_crc, no_answers
from storage.dispatch import FRAME_MAGIC_V1 as FRAME_MAGIC_V1_DISPATCH
from storage.ingest_log import FRAME_MAGIC_V1, LOCATION_DTYPE, IngestLog
from storage.record import crc32c
from tests.storage.test_store import NOW, crash, recs


def _wal_file(s: ScheduleStore) -> Path:
    [path] = sorted(s.layout.ingest_dir.glob("*.wal"))[-1:]
    return path


def test_changed_ingest_frame_count_never_overwrites_an_intact_part(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(10), NOW)
    s.append(recs(10, prefix="n"), NOW)
    seg = s.layout.segment_start(NOW)
    log = s.layout.part_log(seg, 0)
    wal = _wal_file(s)
    crash(s)
    before = log.read_bytes()
    raw = bytearray(wal.read_bytes())
    struct.pack_into("<I", raw, 4, 9)  # the first frame's count: 10 -> 9
    wal.write_bytes(bytes(raw))
    for _ in range(2):  # opens, and opens again
        s2 = ScheduleStore(tmp_path / "d")
        assert log.read_bytes() == before
        ix = s2.segment_index(seg)
        got = [r.msg_id if isinstance(r, Record) else repr(r)
               for r in s2.read_records([seg] * len(ix), ix.part.tolist(), ix.offset.tolist())]
        assert got == [f"m{i}" for i in range(10)] + [f"n{i}" for i in range(10)]
        s2.close()
    assert check(s2.layout).ok


def test_first_version_ingest_frames_are_still_replayed(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    seg = s.layout.segment_start(NOW)
    wal = _wal_file(s)
    crash(s)
    blobs = [encode(r, NOW) for r in recs(3)]
    locs = np.zeros(3, LOCATION_DTYPE)
    locs["segment_ms"] = seg
    locs["due_ms"] = [r.due_ms for r in recs(3)]
    locs["length"] = [len(b) for b in blobs]
    locs["offset"] = np.concatenate(([0], np.cumsum(locs["length"][:-1])))
    payload = locs.tobytes() + b"".join(blobs)
    wal.write_bytes(struct.pack("<IIIIq", FRAME_MAGIC_V1, 3, len(payload), crc32c(payload), NOW) + payload)
    s2 = ScheduleStore(tmp_path / "d")
    assert s2.recovery.replayed_records == 3
    ix = s2.segment_index(seg)
    assert [s2.read_record(seg, 0, o).msg_id for o in ix.offset.tolist()] == ["m0", "m1", "m2"]
    assert s2.meta.locations(["m2"])[0] is not None
    s2.close()


@pytest.mark.parametrize("field,value", [pytest.param(0, 0xDEAD, id="magic"), pytest.param(4, 1 << 30, id="count"),
                                         pytest.param(4, 1, id="short-count")])
def test_one_bad_dispatch_frame_hides_nothing_after_it(tmp_path: Path, field: int, value: int) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(8), NOW)
    seg = s.layout.segment_start(NOW)
    ix = s.segment_index(seg)
    for i in range(0, 6, 2):  # three frames of two entries
        s.record_dispatch(seg, dispatch_entries(ix.part[i:i + 2], ix.offset[i:i + 2], ix.due_ms[i:i + 2], NOW,
                                                DELIVERED), NOW)
    s.close()
    dl = s.layout.dispatch_log(seg)
    raw = bytearray(dl.read_bytes())
    struct.pack_into("<I", raw, 3 * 24 + field, value)  # the second frame's header row
    dl.write_bytes(bytes(raw))
    s2 = ScheduleStore(tmp_path / "d")  # a restart appends after what it reads
    s2.record_dispatch(seg, dispatch_entries(ix.part[6:8], ix.offset[6:8], ix.due_ms[6:8], NOW, DELIVERED), NOW)
    read = s2.dispatch_log(seg)
    s2.close()
    assert sorted(read.entries["offset"].tolist()) == sorted(ix.offset[[0, 1, 4, 5, 6, 7]].tolist())
    assert (read.corrupt_frames, read.torn_bytes) == (1, 0)
    assert [f.kind for f in check(s2.layout).findings] == ["corrupt_dispatch_frame"]


def test_first_version_dispatch_frames_are_still_read(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(2), NOW)
    seg = s.layout.segment_start(NOW)
    ix = s.segment_index(seg)
    body = dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED).tobytes()
    s.layout.dispatch_log(seg).write_bytes(struct.pack("<IIIIq", FRAME_MAGIC_V1_DISPATCH, 2, crc32c(body), 0, NOW)
                                           + body)
    s.record_dispatch(seg, dispatch_entries(ix.part[:1], ix.offset[:1], ix.due_ms[:1], NOW, DELIVERED), NOW)
    read = s.dispatch_log(seg)
    s.close()
    assert len(read.entries) == 3 and read.corrupt_frames == 0


def _dispatch_frames(sizes: list[int]) -> list[np.ndarray]:
    out, offset = [], 0
    for n in sizes:
        offs = np.arange(offset, offset + n, dtype=np.uint32) * 100
        out.append(dispatch_entries(0, offs, offs.astype(np.int64) + NOW, NOW, DELIVERED))
        offset += n
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.data())
def test_a_flipped_byte_in_a_dispatch_log_loses_only_its_own_frame(sizes: list[int], data: st.DataObject) -> None:
    frames = _dispatch_frames(sizes)
    raw = bytearray(b"".join(encode_frame(f, NOW) for f in frames))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    hit = int(np.searchsorted(np.cumsum([24 * (1 + n) for n in sizes]), at, side="right"))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "dispatch.log"
        path.write_bytes(bytes(raw))
        read = read_dispatch_log(path)
    want = np.concatenate([f for i, f in enumerate(frames) if i != hit] or [frames[0][:0]])
    assert read.entries.tobytes() == want.tobytes()
    assert read.corrupt_frames + (read.torn_bytes > 0) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_a_flipped_byte_in_the_ingest_log_skips_only_its_frame(sizes: list[int], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as d:
        wal = IngestLog(Path(d))
        wal.open_new(0)
        ends = []
        for k, n in enumerate(sizes):
            blobs = [encode(r, NOW) for r in recs(n, prefix=f"f{k}-")]
            locs = np.zeros(n, LOCATION_DTYPE)
            locs["length"] = [len(b) for b in blobs]
            wal.append(locs, blobs, NOW, sync=False)
            ends.append(wal.position)
        wal.close()
        path = next(Path(d).glob("*.wal"))
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
        path.write_bytes(bytes(raw))
        reread = IngestLog(Path(d))
        got = [f.end for f in reread.frames(0, 0)]
    starts = [0, *ends[:-1]]
    assert got == [e for s, e in zip(starts, ends) if not s <= at < e]
    # the frame is skipped, and said so, unless it was the last one (a torn tail, cut)
    assert len(reread.skipped) == (0 if at >= starts[-1] else 1)


@given(st.integers(0, 5), st.integers(-2**40, 2**40), st.text(max_size=20), st.booleans())
def test_a_frames_header_row_is_the_header_dtype_of_its_fields(n: int, written: int, note: str,
                                                                 with_answers: bool) -> None:
    """The header row, packed with struct, reads back as `_HEADER_DTYPE` with the frame's fields."""
    entries = dispatch_entries(np.zeros(n, np.uint16), np.arange(n), np.arange(n) + NOW, NOW, DELIVERED)
    frame = encode_frame(entries, written, no_answers(n) if with_answers else None, note)
    head = np.frombuffer(frame[:ROW_SIZE], _HEADER_DTYPE)[0]
    v3 = with_answers or bool(note)
    assert int(head["magic"]) == (FRAME_MAGIC_V3 if v3 else FRAME_MAGIC) and int(head["count"]) == n
    assert int(head["written_ms"]) == written
    assert int(head["note_len"]) == (len(note.encode("utf-8", "replace")[:4096]) if v3 else 0)
    zeroed = np.frombuffer(frame[:ROW_SIZE], _HEADER_DTYPE).copy()
    zeroed["crc"] = 0
    assert int(head["crc"]) == frame_crc(zeroed.tobytes(), frame[ROW_SIZE:])
