"""Retention killed or cut off by a power loss partway: what the next start finds."""
from __future__ import annotations

from pathlib import Path

import pytest

import storage.retention as retention_module
import storage.store as store_module
from storage import DELIVERED, PartStager, Record, ScheduleStore, dispatch_entries, reopen_segments

NOW = 1_800_000_000_000
HOUR = 3_600_000


class Killed(BaseException):
    """The process dies here."""


def crash(s: ScheduleStore) -> None:
    """Drop a store as a killed process would: no checkpoint, no flush."""
    s._wal.close()
    s.writer.close()
    s.meta._db.close()


def pending_at_start(s: ScheduleStore) -> set[int]:
    """The past segments a start loads: those not marked done, or made pending again by a new part."""
    done = s.meta.done_segments()
    done.difference_update(reopen_segments(s.layout, s.meta, sorted(done)))
    return {seg for seg in s.layout.list_segments() if seg not in done}


@pytest.mark.parametrize("archive", [False, True])
def test_a_part_published_into_an_hour_retired_just_before_a_crash_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, archive: bool) -> None:
    """Retention moved a done segment out of schedule/ (and deleted it), then was killed before it
    dropped the segment's done mark. A backfill published a part into that hour, made again, while
    the engine was stopped: part 0, a number the stale mark names, so the start took the segment
    for sent and its records were never delivered."""
    s = ScheduleStore(tmp_path / "d")
    s.append([Record(f"m{i}", "T", b"x", NOW + i) for i in range(2)], NOW)
    seg = s.layout.segment_start(NOW)
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    assert s.mark_segment_done(seg, lambda: True, [0])
    s.checkpoint()
    if archive:  # killed once the segment is in archive/ for good
        real_fsync = store_module.fsync_path

        def fsync_then_killed(path: Path) -> None:
            real_fsync(path)
            raise Killed

        monkeypatch.setattr(store_module, "fsync_path", fsync_then_killed)
    else:  # killed once retiring/ no longer holds it
        real_rmtree = retention_module.shutil.rmtree

        def rmtree_then_killed(path: Path) -> None:
            real_rmtree(path)
            raise Killed

        monkeypatch.setattr(retention_module.shutil, "rmtree", rmtree_then_killed)
    with pytest.raises(Killed):
        s.retire(NOW + 5 * HOUR, min_age_ms=HOUR, archive=archive)
    monkeypatch.undo()
    crash(s)

    staging = tmp_path / "d" / "_staging"
    staging.mkdir()
    stager = PartStager(staging, "job-1", s.layout.segment_ms, NOW + 6 * HOUR)
    stager.add(Record("backfilled", "T", b"y", NOW + 7))
    for part in stager.finish():
        assert s.layout.publish_part(part.segment_ms, part.log, part.index) == 0

    s = ScheduleStore(tmp_path / "d")
    assert seg in pending_at_start(s), "a published part no one sent is taken for sent"
    s.close()
