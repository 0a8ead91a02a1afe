"""The self-audit (`summarize`, `check`) over a data directory holding a file it cannot read: that
file is a finding, named with why, and every other file is still read; retention's look at one
segment (`summarize_segment`) still raises, so it never retires a segment it could not read."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from storage import (DELIVERED, Record, ScheduleStore, SegmentLayout, check, dispatch_entries, summarize,
                     summarize_segment)

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z
HOUR = 3_600_000


def _two_segments(tmp_path: Path) -> tuple[SegmentLayout, Path, Path]:
    """Three records in each of two segments, one of each delivered; the second segment's last
    record has a flipped body byte. Returns the layout and both segment directories."""
    d = tmp_path / "data"
    with ScheduleStore(d) as store:
        for h in range(2):
            store.append([Record(f"m{h}-{i}", "ORDERS", b"body", NOW + h * HOUR + i) for i in range(3)], NOW)
            seg = store.layout.segment_start(NOW + h * HOUR)
            ix = store.segment_index(seg)
            store.record_dispatch(seg, dispatch_entries(ix.part[:1], ix.offset[:1], ix.due_ms[:1], NOW, DELIVERED),
                                  NOW)
        segs = [store.layout.segment_dir(store.layout.segment_start(NOW + h * HOUR)) for h in range(2)]
    log = segs[1] / "00000.log"
    data = bytearray(log.read_bytes())
    data[-2] ^= 0xFF
    log.write_bytes(bytes(data))
    return SegmentLayout.open_existing(d), segs[0], segs[1]


def _a_directory_in_place_of(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("fix", [False, True], ids=["check", "check fix"])
@pytest.mark.parametrize("name", ["00000.log", "00000.idx", "dispatch.log"])
def test_check_names_a_file_it_cannot_read_and_checks_the_rest(tmp_path: Path, name: str, fix: bool) -> None:
    layout, first, second = _two_segments(tmp_path)
    _a_directory_in_place_of(first / name)
    rep = check(layout, fix=fix, now_ms=NOW)
    unreadable = [f for f in rep.findings if f.kind == "unreadable"]
    assert [f.path for f in unreadable] == [str(first / name)], rep.findings
    assert "Is a directory" in unreadable[0].detail, unreadable
    # the other segment was read whole: its flipped byte found, its records counted
    assert [f.path for f in rep.findings if f.kind == "corrupt_record"] == [str(second / "00000.log")], rep.findings
    assert rep.segments == 2 and rep.records >= 3
    # the delivered entry of a part that could not be read names a record of it, not nothing
    assert not [f for f in rep.findings if f.kind == "unknown_dispatch_entry"], rep.findings


@pytest.mark.parametrize("name", ["00000.idx", "dispatch.log"])
def test_summarize_names_a_file_it_cannot_read_and_counts_the_rest(tmp_path: Path, name: str) -> None:
    layout, first, second = _two_segments(tmp_path)
    _a_directory_in_place_of(first / name)
    report = summarize(layout)
    findings = report["findings"]
    assert isinstance(findings, list) and [f["path"] for f in findings] == [str(first / name)], findings
    assert findings[0]["kind"] == "unreadable" and "Is a directory" in findings[0]["detail"], findings
    segments = report["segments"]
    assert isinstance(segments, list) and len(segments) == 2
    assert (segments[1]["records"], segments[1]["dispatched"], segments[1]["pending"]) == (3, 1, 2), segments


def test_summarize_and_check_name_a_schedule_that_is_not_a_directory(tmp_path: Path) -> None:
    layout, _, _ = _two_segments(tmp_path)
    shutil.rmtree(layout.schedule_dir)
    layout.schedule_dir.write_text("not a directory")
    report = summarize(layout)
    assert report["findings"] == [{"kind": "unreadable", "path": str(layout.schedule_dir),
                                   "detail": "cannot be read: Not a directory"}], report
    assert report["segments"] == []
    rep = check(layout)
    assert [(f.kind, f.path) for f in rep.findings] == [("unreadable", str(layout.schedule_dir))], rep.findings


def test_retention_s_look_at_a_segment_it_cannot_read_still_raises(tmp_path: Path) -> None:
    """Retention retires a segment whose summary has nothing pending: one whose index could not be
    read must not look empty to it."""
    layout, first, _ = _two_segments(tmp_path)
    _a_directory_in_place_of(first / "00000.idx")
    with pytest.raises(IsADirectoryError):
        summarize_segment(layout, layout.list_segments()[0])
