"""Done marks name the parts a segment was read from; a part published since makes it pending again."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from storage import PartStager, Record, ScheduleStore, reopen_segments

NOW = 1_800_000_000_000
HOUR = 3_600_000


def _publish(s: ScheduleStore, seg: int, name: str) -> int:
    staging = s.layout.root / "_staging"
    staging.mkdir(exist_ok=True)
    stager = PartStager(staging, name, s.layout.segment_ms, NOW)
    stager.add(Record(name, "T", b"x", seg + 1000))
    [p] = stager.finish()
    return s.layout.publish_part(seg, p.log, p.index)


def test_a_part_the_mark_does_not_name_reopens_the_segment(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = NOW - 2 * HOUR
        assert _publish(s, seg, "a") == 0
        s.meta.mark_segment_done(seg, [0])
        assert reopen_segments(s.layout, s.meta, [seg]) == [] and s.meta.done_segments() == {seg}
        assert _publish(s, seg, "b") == 1
        assert reopen_segments(s.layout, s.meta, [seg]) == [seg]
        assert s.meta.done_segments() == set() and seg not in s.meta.done_now()
    finally:
        s.close()


def test_the_parts_a_mark_names_survive_a_restart(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    seg = NOW - 2 * HOUR
    _publish(s, seg, "a")
    s.meta.mark_segment_done(seg, [0])
    s.close()
    s = ScheduleStore(tmp_path / "d")
    try:
        assert s.meta.done_parts([seg, seg - HOUR]) == {seg: (0,)}
        _publish(s, seg, "b")
        assert reopen_segments(s.layout, s.meta, [seg]) == [seg]
    finally:
        s.close()


def test_a_retired_segment_or_one_never_written_is_passed_over(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = NOW - 2 * HOUR
        _publish(s, seg, "a")
        s.meta.mark_segment_done(seg, [0])
        s.meta.mark_segment_done(seg - HOUR)  # an hour with nothing stored: no directory
        shutil.rmtree(s.layout.segment_dir(seg))
        assert reopen_segments(s.layout, s.meta, [seg, seg - HOUR, seg - 5 * HOUR]) == []
        assert s.meta.done_segments() == {seg, seg - HOUR}
    finally:
        s.close()


def test_an_older_builds_mark_is_judged_by_the_files_times(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        whole, late = NOW - 3 * HOUR, NOW - 2 * HOUR
        for seg in (whole, late):
            _publish(s, seg, f"a{seg}")
            s.layout.dispatch_log(seg).write_bytes(b"")  # stands for its outcomes, written after the part
            s.meta._db.put(b"s" + seg.to_bytes(8, "big", signed=True), b"done")  # as older builds wrote it
        part = s.layout.part_log(whole, 0)
        old = os.stat(s.layout.dispatch_log(whole)).st_mtime_ns
        os.utime(s.layout.dispatch_log(whole), ns=(old + 10**9, old + 10**9))  # the last outcome came after
        _publish(s, late, "b")  # linked in after the last outcome
        os.utime(s.layout.dispatch_log(late), ns=(0, 0))
        assert os.stat(part).st_ctime_ns < os.stat(s.layout.dispatch_log(whole)).st_mtime_ns
        assert s.meta.done_parts([whole, late]) == {whole: None, late: None}
        assert reopen_segments(s.layout, s.meta, [whole, late]) == [late]
        # the whole one now names its parts: only the exact test applies to it from then on
        assert s.meta.done_parts([whole, late]) == {whole: (0,)}
    finally:
        s.close()


def test_a_record_file_without_its_index_does_not_reopen_a_segment(tmp_path: Path) -> None:
    """A crash between a part's two names leaves a record file alone: the loader reads nothing of it,
    so it must not reopen the segment (at every rescan, for good)."""
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = NOW - 2 * HOUR
        assert _publish(s, seg, "a") == 0
        s.meta.mark_segment_done(seg, [0])
        s.layout.part_log(seg, 1).write_bytes(b"")
        assert reopen_segments(s.layout, s.meta, [seg]) == [] and s.meta.done_segments() == {seg}
    finally:
        s.close()
