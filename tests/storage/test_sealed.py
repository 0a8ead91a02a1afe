"""Sealed parts: staged in the engine's byte layout, published whole into their segments, or removed."""
from __future__ import annotations

from pathlib import Path

import pytest

from storage import PartStager, Record, SealedPartWriter, SegmentLayout, check, decode, read_index

T0 = 1_800_000_000_000
HOUR = 3_600_000


def _records(n: int, step: int) -> list[Record]:
    return [Record(f"m{i}", "T", f"body-{i}".encode(), T0 + i * step, keys=("k",)) for i in range(n)]


def test_staged_parts_publish_into_their_segments(tmp_path: Path) -> None:
    layout = SegmentLayout(tmp_path / "data")
    staging = tmp_path / "data" / "_staging" / "job"
    staging.mkdir(parents=True)
    stager = PartStager(staging, "t0", layout.segment_ms, enqueue_ms=T0, max_part_bytes=100, buffer_bytes=1)
    recs = _records(6, HOUR // 2)  # 3 hours, 2 per hour; 100 bytes hold one record: 6 parts
    for r in recs:
        stager.add(r)
    staged = stager.finish()
    assert len(staged) == 6 and {p.segment_ms for p in staged} == {T0, T0 + HOUR, T0 + 2 * HOUR}
    for p in staged:
        layout.publish_part(p.segment_ms, p.log, p.index)
    got = []
    for seg in layout.list_segments():
        for part in layout.list_parts(seg):
            raw = layout.part_log(seg, part).read_bytes()
            for e in read_index(layout.part_index(seg, part)):
                rec, n = decode(raw, int(e["offset"]))
                assert n == int(e["length"]) and rec.due_ms == int(e["due_ms"]) and rec.enqueue_ms == T0
                assert layout.segment_start(rec.due_ms) == seg
                got.append(rec.msg_id)
    assert sorted(got) == sorted(r.msg_id for r in recs)
    assert not list(staging.iterdir())
    staging.rmdir()
    staging.parent.rmdir()
    assert check(layout).ok


def test_abort_removes_every_staged_file(tmp_path: Path) -> None:
    stager = PartStager(tmp_path, "t1", HOUR, enqueue_ms=T0)
    for r in _records(4, HOUR):
        stager.add(r)
    stager.finish()
    stager.add(Record("late", "T", b"x", T0 + 9 * HOUR))
    assert len(list(tmp_path.iterdir())) == 10
    stager.abort()
    assert not list(tmp_path.iterdir())


def test_staged_names_belong_to_one_writer(tmp_path: Path) -> None:
    SealedPartWriter(T0, tmp_path / "a.log", tmp_path / "a.idx")
    with pytest.raises(FileExistsError):
        SealedPartWriter(T0, tmp_path / "a.log", tmp_path / "b.idx")
