"""New names are durable before anything depends on them: published parts, parts and segments a
checkpoint relies on, and in flush="sync" mode new dispatch and ingest log files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import storage.layout
from storage import (DELIVERED, LOCATION_DTYPE, FlushPolicy, Record, ScheduleStore, SegmentLayout, dispatch_entries,
                     encode)
from storage.ingest_log import IngestLog

SEG = 1_800_000_000_000


def _stage(root: Path, name: str) -> tuple[Path, Path]:
    staged = root / "staging"
    staged.mkdir(exist_ok=True)
    log, idx = staged / f"{name}.log", staged / f"{name}.idx"
    log.write_bytes(b"")
    idx.write_bytes(b"")
    return log, idx


def test_segment_directory_is_fsynced_after_both_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = SegmentLayout(tmp_path / "d")
    calls: list[tuple[Path, bool, bool]] = []

    def record(path: Path) -> None:
        # what a crash right after this fsync would find: both names published, staged copy still there
        published = layout.part_log(SEG, 0).exists() and layout.part_index(SEG, 0).exists()
        calls.append((Path(path), published, log.exists()))

    monkeypatch.setattr(storage.layout, "fsync_path", record)
    log, idx = _stage(tmp_path / "d", "a")
    assert layout.publish_part(SEG, log, idx) == 0
    # both names, then the segment directory's own name in schedule/, durable before the staged copy goes
    assert calls == [(layout.segment_dir(SEG), True, True), (layout.schedule_dir, True, True)]

    calls.clear()
    log, idx = _stage(tmp_path / "d", "b")
    assert layout.publish_part(SEG, log, idx) == 1
    # an existing segment too: the engine may have made its directory since its last checkpoint
    assert [c[0] for c in calls] == [layout.segment_dir(SEG), layout.schedule_dir]


class _Syncs:
    """Records what is fsynced (by path, whichever module asks) and when the checkpoint moves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, Path]] = []
        real_fsync, real_fdatasync = os.fsync, os.fdatasync

        def fsync(fd: int) -> None:
            self.events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
            real_fsync(fd)

        def fdatasync(fd: int) -> None:
            self.events.append(("fdatasync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
            real_fdatasync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "fdatasync", fdatasync)

    def fsynced(self) -> list[Path]:
        return [p for kind, p in self.events if kind == "fsync"]


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_checkpoint_makes_new_parts_and_segments_durable_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   flush: FlushPolicy) -> None:
    s = ScheduleStore(tmp_path / "d", flush=flush)
    syncs = _Syncs(monkeypatch)
    real_put = s.meta.put_document

    def put_document(name: str, doc: Any) -> None:
        syncs.events.append(("checkpoint", Path(name)))
        real_put(name, doc)

    monkeypatch.setattr(s.meta, "put_document", put_document)
    s.append([Record("m", "T", b"x", SEG + 1000)], SEG)
    s.checkpoint()  # the ingest log that held the record is let go: the part must be found without it
    s.close()
    moved = syncs.events.index(("checkpoint", Path("checkpoint")))
    before = [p for kind, p in syncs.events[:moved] if kind == "fsync"]
    layout = s.layout
    assert layout.part_log(SEG, 0).resolve() in before and layout.part_index(SEG, 0).resolve() in before
    assert layout.segment_dir(SEG).resolve() in before and layout.schedule_dir.resolve() in before


def test_sync_mode_makes_a_new_dispatch_log_durable_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = ScheduleStore(tmp_path / "d", flush="sync")
    s.append([Record("m", "T", b"x", SEG + 1000)], SEG)
    ix = s.segment_index(SEG)
    syncs = _Syncs(monkeypatch)
    s.record_dispatch(SEG, dispatch_entries(ix.part, ix.offset, ix.due_ms, SEG, DELIVERED), SEG)
    assert ("fdatasync", s.layout.dispatch_log(SEG).resolve()) in syncs.events
    assert s.layout.segment_dir(SEG).resolve() in syncs.fsynced()  # before the entry is relied on
    # and the segment directory's own name: made by the append, it is durable only at the next checkpoint
    assert s.layout.schedule_dir.resolve() in syncs.fsynced()
    s.close()


def test_sync_mode_ingest_log_file_is_durable_by_name_before_its_first_frame(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    wal = IngestLog(tmp_path / "ingest", sync_dir=True)
    syncs = _Syncs(monkeypatch)
    wal.open_new(7)
    blob = encode(Record("m", "T", b"x", SEG), SEG)
    locs = np.zeros(1, LOCATION_DTYPE)
    locs["length"] = len(blob)
    wal.append(locs, [blob], SEG, sync=True)
    wal.close()
    assert [kind for kind, _ in syncs.events] == ["fsync", "fdatasync"]
    assert syncs.events[0][1] == (tmp_path / "ingest").resolve()
