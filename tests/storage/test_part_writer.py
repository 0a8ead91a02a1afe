"""The live-part writer: where a commit's records land, and what each part's three files hold."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import Record, ScheduleStore, StorageWriteError, _writer, check, encode
from storage._writer import PartWriter
from storage.index import index_entries
from storage.layout import SegmentLayout
from storage.origin import ORIGIN_DTYPE
from tests.storage._deleted_under_writer import MOMENTS, delete_under_writer

T0 = 1_800_000_000_000
HOUR = 3_600_000

# a commit: each record's hour (0 or 1), its length, its origin offset; most commits of one hour (the
# array placement's case), some of several; a few commits in a row
_record = st.tuples(st.integers(0, 1), st.integers(1, 90), st.integers(0, 1 << 40))
_records = st.one_of(st.lists(_record, min_size=1, max_size=8), st.lists(_record, min_size=30, max_size=80))
_commit = st.tuples(st.booleans(), _records).map(
    lambda c: [(c[1][0][0], ln, off) for _, ln, off in c[1]] if c[0] else c[1])
_commits = st.lists(_commit, min_size=1, max_size=5)


def _write(root: Path, commits: list[list[tuple[int, int, int]]], max_part_bytes: int) -> list[np.ndarray]:
    writer = PartWriter(SegmentLayout(root), max_part_bytes)
    placed = []
    try:
        for n, commit in enumerate(commits):
            dues = [T0 + hour * HOUR + i for i, (hour, _, _) in enumerate(commit)]
            blobs = [bytes([n * 16 + i % 16]) * length for i, (_, length, _) in enumerate(commit)]
            origins = np.zeros(len(commit), ORIGIN_DTYPE)
            origins["offset"] = [off for _, _, off in commit]
            locs = writer.place(dues, blobs)
            writer.write(locs, blobs, origins)
            placed.append(locs)
    finally:
        # three descriptors a part stay open until then: left open, 150 examples of 100-byte parts
        # held over 14,000, and the suite after them ran out of descriptors
        writer.close()
    return placed


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "schedule").rglob("*")) if p.is_file()}


@settings(max_examples=150, deadline=None)
@given(_commits, st.sampled_from([100, 600, 1 << 20, 1 << 20]))
def test_the_array_placement_writes_what_the_record_by_record_one_writes(
        commits: list[list[tuple[int, int, int]]], max_part_bytes: int) -> None:
    """Commits of one hour or several, parts rolling at the limit or not: the same locations and the
    same bytes in every part's log, index and origin file, whichever way a commit was placed."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        fast = _write(Path(a), commits, max_part_bytes)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_writer, "_ARRAY_PLACE_MIN", 1 << 30)
            slow = _write(Path(b), commits, max_part_bytes)
        for f, s in zip(fast, slow):
            assert f.tobytes() == s.tobytes()
        files = _files(Path(a))
        assert files == _files(Path(b))
        # and each part holds its records in order: log, index entries, origins
        for locs, commit in zip(fast, commits):
            for i, (seg, part, off, ln) in enumerate(zip(locs["segment_ms"].tolist(), locs["part"].tolist(),
                                                         locs["offset"].tolist(), locs["length"].tolist())):
                assert ln == commit[i][1] and seg == T0 + commit[i][0] * HOUR - (T0 + commit[i][0] * HOUR) % HOUR
                layout = SegmentLayout(Path(a))
                log = layout.part_log(seg, part).read_bytes()
                assert len(set(log[off:off + ln])) == 1 and len(log[off:off + ln]) == ln


def test_a_one_part_commit_of_many_records_is_written_in_one_write_per_file(tmp_path: Path) -> None:
    """The usual commit under load (one hour, the live part open): three writes, whole."""
    layout = SegmentLayout(tmp_path)
    writer = PartWriter(layout, 1 << 20)
    try:  # its raw descriptors are not closed by the garbage collector
        first = writer.place([T0], [b"a"])
        writer.write(first, [b"a"], np.zeros(1, ORIGIN_DTYPE))
        dues = [T0 + i for i in range(100)]
        blobs = [bytes([i]) * (i + 1) for i in range(100)]
        locs = writer.place(dues, blobs)
        assert locs["offset"].tolist() == [1 + sum(range(1, i + 1)) for i in range(100)]
        writer.write(locs, blobs, np.zeros(100, ORIGIN_DTYPE))
    finally:
        writer.close()
    seg, part = int(locs["segment_ms"][0]), int(locs["part"][0])
    assert layout.part_log(seg, part).read_bytes() == b"a" + b"".join(blobs)
    want = index_entries([T0, *dues], [0, *locs["offset"].tolist()], [1, *locs["length"].tolist()]).tobytes()
    assert layout.part_index(seg, part).read_bytes() == want


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors in /proc")
def test_a_part_whose_index_cannot_be_opened_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """The part's log is opened before its index: when the index fails (EMFILE, a bad file), the log's
    descriptor is closed, not held by nobody until the process ends."""
    layout = SegmentLayout(tmp_path)
    writer = PartWriter(layout, 1 << 20)
    try:
        locs = writer.place([T0], [b"a"])
        seg, part = int(locs["segment_ms"][0]), int(locs["part"][0])
        layout.part_index(seg, part).unlink()
        layout.part_index(seg, part).mkdir()  # opening it for writing fails: EISDIR
        before = _open_fds()
        with pytest.raises(IsADirectoryError):
            writer.write(locs, [b"a"], np.zeros(1, ORIGIN_DTYPE))
        assert _open_fds() == before
    finally:
        writer.close()


@pytest.mark.parametrize("when", MOMENTS)
def test_a_live_parts_index_deleted_between_two_appends_keeps_every_record_readable(
        tmp_path: Path, when: str) -> None:
    # the writer keeps a live part's files open, and closes them once more parts were written since than
    # it keeps open (opening them again at the part's next write): either way, every record of the part
    # must be found through its index when its segment comes due, and at the next start
    first = [Record(f"id-{i}", "T", b"x" * (i + 1), T0 + i * 10) for i in range(5)]
    second = [Record(f"id-{i}", "T", b"y" * (i + 1), T0 + i * 10) for i in range(5, 8)]
    ids = [r.msg_id for r in first + second]
    store = ScheduleStore(tmp_path)
    seg = T0 - T0 % store.layout.segment_ms
    try:
        store.append(first, T0, [("b:0", 100 + i) for i in range(5)])
        (idx,) = list(tmp_path.glob("schedule/*/*.idx"))
        delete_under_writer(store, idx, when, T0)
        store.append(second, T0, [("b:0", 200 + i) for i in range(3)])
        index = store.segment_index(seg)
        got = store.read_records([seg] * len(index), index.part.tolist(), index.offset.tolist(), index.due_ms.tolist())
        assert [r.msg_id for r in got if isinstance(r, Record)] == ids
        # the origin sidecar, kept, still gives each record its own origin
        assert store.read_origins(np.full(len(index), seg), index.part, index.offset)["offset"].tolist() == \
            [100 + i for i in range(5)] + [200 + i for i in range(3)]
    finally:
        store.close()
    with ScheduleStore(tmp_path) as again:
        assert len(again.segment_index(seg)) == len(ids)
        assert [f for f in check(again.layout).findings if f.path in (str(idx), str(idx.with_suffix(".org")))] == []


def test_a_part_whose_records_cannot_be_indexed_to_their_end_again_is_not_appended_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # its index deleted while the writer had the part closed, and its log ending in a torn record: indexing
    # it again would cut the log under the offsets the writer gives the next records, so the commit fails
    monkeypatch.setattr(_writer, "_MAX_OPEN_FDS", 1)
    layout = SegmentLayout(tmp_path)
    writer = PartWriter(layout, 1 << 20)

    def commit(due: int) -> tuple[int, int]:
        blobs = [encode(Record(f"id-{due}", "T", b"x", due), T0)]
        locs = writer.place([due], blobs)
        writer.write(locs, blobs, np.zeros(1, ORIGIN_DTYPE))
        return int(locs["segment_ms"][0]), int(locs["part"][0])

    try:
        seg, part = commit(T0)
        commit(T0 + HOUR)  # closes the first part's files
        log_path, idx_path = layout.part_log(seg, part), layout.part_index(seg, part)
        with open(log_path, "ab") as f:
            f.write(b"\x00" * 7)
        idx_path.unlink()
        with pytest.raises(StorageWriteError, match=str(idx_path)):
            commit(T0 + 1)
        assert os.path.getsize(log_path) == len(encode(Record(f"id-{T0}", "T", b"x", T0), T0)) + 7
    finally:
        writer.close()
