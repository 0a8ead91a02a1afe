"""A commit's check for segments marked done costs nothing that grows with how many there are: with
retention off, one more is marked every hour, for as long as the engine runs."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from storage import MetaStore

HOUR = 3_600_000
BASE = 1_800_000_000_000 - 1_800_000_000_000 % HOUR


class _CountingSet(frozenset[int]):
    """A frozenset that counts how often it is walked element by element."""

    walks = 0

    def __iter__(self) -> Iterator[int]:
        type(self).walks += 1
        return super().__iter__()


def test_a_commit_into_a_later_segment_does_not_walk_the_segments_marked_done(tmp_path: Path) -> None:
    meta = MetaStore(tmp_path / "meta")
    try:
        for i in range(50):
            meta.mark_segment_done(BASE + i * HOUR)
        # the same segments, in a set that counts the walks over it (a year of hours: 8,760 of them)
        meta._done = _CountingSet(meta._done)
        _CountingSet.walks = 0
        meta.put_records(["a", "b"], [BASE + 60 * HOUR] * 2, [0, 0], [0, 100], [(), ()])
        assert _CountingSet.walks == 0, "every commit walked every segment marked done"
        assert meta.locations(["a"])[0] is not None
    finally:
        meta.close()


def test_a_late_record_still_clears_its_segments_mark_and_no_other(tmp_path: Path) -> None:
    meta = MetaStore(tmp_path / "meta")
    try:
        for i in range(3):
            meta.mark_segment_done(BASE + i * HOUR)
        meta.put_records(["late"], [BASE + HOUR], [1], [0], [()])
        assert meta.done_segments() == {BASE, BASE + 2 * HOUR}
        assert meta.done_now() == frozenset({BASE, BASE + 2 * HOUR})
        meta.forget_segment(BASE + 2 * HOUR)
        meta.put_records(["later"], [BASE + 2 * HOUR], [1], [0], [()])  # the newest mark is gone: nothing to clear
        meta.put_records(["old"], [BASE], [1], [0], [()])
        assert meta.done_segments() == set() and meta.done_now() == frozenset()
        meta.mark_segment_done(BASE + 5 * HOUR)
        meta.put_records(["x"], [BASE + 5 * HOUR], [0], [0], [()])
        assert meta.done_segments() == set()
    finally:
        meta.close()
