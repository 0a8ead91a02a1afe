"""A part number is taken by one writer at a time: the engine rolling to a new live part and a
backfill publishing a sealed part into the same segment never share one."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

import storage.layout
from storage import _files
from storage import PartStager, Record, ScheduleStore, read_index
from storage.index import INDEX_ENTRY_SIZE

NOW = 1_800_000_000_000


def test_a_live_part_claimed_while_a_backfill_publishes_leaves_both_parts_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = s.layout.segment_start(NOW)
        staging = s.layout.root / "_staging"
        staging.mkdir()
        stager = PartStager(staging, "bf", s.layout.segment_ms, NOW)
        for i in range(3):
            stager.add(Record(f"bf{i}", "T", b"x", seg + 1000 + i))
        [p] = stager.finish()
        index_bytes = p.index.read_bytes()
        assert len(index_bytes) == 3 * INDEX_ENTRY_SIZE

        # The publish links the index, then waits before linking the log: the engine's first
        # commit into this segment claims its live part in that moment (a thread of its own).
        linked_index, engine_done = threading.Event(), threading.Event()
        real_link = os.link

        def slow_link(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
            real_link(src, dst, *a, **kw)
            if str(dst).endswith(".idx") and not linked_index.is_set():
                linked_index.set()
                engine_done.wait(1.0)  # with the lock the engine waits for the publish: go on then

        monkeypatch.setattr(storage.layout.os, "link", slow_link)
        published: list[int] = []
        t = threading.Thread(target=lambda: published.append(s.layout.publish_part(seg, p.log, p.index)))
        t.start()
        assert linked_index.wait(5.0)

        def commit() -> None:
            s.append([Record("live1", "T", b"y", NOW + 5000)], NOW)
            engine_done.set()

        engine = threading.Thread(target=commit)
        engine.start()
        t.join(10.0)
        engine.join(10.0)
        assert not t.is_alive() and not engine.is_alive()

        [bf_part] = published
        live_part = s.writer.live[seg].part
        assert bf_part != live_part
        assert s.layout.part_index(seg, bf_part).read_bytes() == index_bytes, "the published index was cut"
        assert len(read_index(s.layout.part_index(seg, live_part))) == 1, "the live part lost its index"
        assert sorted(s.layout.list_parts(seg)) == sorted([bf_part, live_part])
    finally:
        s.close()


def test_a_filesystem_without_locks_still_takes_part_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """flock refused as unsupported (some network filesystems): parts are still claimed and
    published, and the operator is told once what is not safe there."""
    import errno

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_files.fcntl, "flock", no_locks)
    monkeypatch.setattr(_files, "_no_locks_said", set())  # said once a process: not yet here
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = s.layout.segment_start(NOW)
        s.append([Record("live1", "T", b"y", NOW + 5000)], NOW)
        assert s.layout.list_parts(seg) == [0]
        assert "cannot be locked" in caplog.text and "No locks available" in caplog.text
    finally:
        s.close()


def test_another_lock_error_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def broken(fd: int, op: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_files.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Input/output error"):
        storage.layout.SegmentLayout(tmp_path / "d").claim_part(NOW)


def test_a_part_published_while_retention_moves_its_segment_out_stays_in_the_data_directory(
        tmp_path: Path) -> None:
    """Retention checks a done segment's files unchanged, then moves its directory out; a backfill
    publishing a part into that segment in between once had it moved out with the rest (then
    deleted, never sent). Now the publish waits for the move and lands in the segment made again."""
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = s.layout.segment_start(NOW)
        s.append([Record("old", "T", b"x", seg + 10)], NOW)
        s.seal_live_parts(NOW + 3_600_000)
        s.checkpoint()
        staging = s.layout.root / "_staging"
        staging.mkdir()
        stager = PartStager(staging, "bf", s.layout.segment_ms, NOW)
        stager.add(Record("late-bf", "T", b"y", seg + 2000))
        [p] = stager.finish()
        published: list[int] = []
        publisher = threading.Thread(target=lambda: published.append(s.layout.publish_part(seg, p.log, p.index)))
        files_before = sorted(os.listdir(s.layout.segment_dir(seg)))

        def unchanged() -> bool:  # retention's last look, then the publish starts before the move
            same = sorted(os.listdir(s.layout.segment_dir(seg))) == files_before
            publisher.start()
            publisher.join(0.5)  # with the lock it waits for the move; without it, it is done by now
            return same

        dst = tmp_path / "retiring-copy"
        moved = s.take_out_segment(seg, unchanged, dst)
        publisher.join(10.0)
        assert not publisher.is_alive() and len(published) == 1
        [part] = published
        assert moved
        assert s.layout.list_parts(seg) == [part], "the published part went out with the retired segment"
        assert sorted(os.listdir(dst)) == files_before, "the retired segment took more than retention read"
        assert len(read_index(s.layout.part_index(seg, part))) == 1
    finally:
        s.close()
