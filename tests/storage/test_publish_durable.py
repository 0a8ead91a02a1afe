"""publish_part makes the published names durable: the segment directory is fsynced after the links."""
from __future__ import annotations

from pathlib import Path

import pytest

import storage.layout
from storage import SegmentLayout

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
    assert (layout.segment_dir(SEG), True, True) in calls
    # the segment directory was new, so its parent's entry for it is made durable too
    assert calls[0][0] == layout.schedule_dir

    calls.clear()
    log, idx = _stage(tmp_path / "d", "b")
    assert layout.publish_part(SEG, log, idx) == 1
    assert [c[0] for c in calls] == [layout.segment_dir(SEG)], "an existing segment needs only its own fsync"
