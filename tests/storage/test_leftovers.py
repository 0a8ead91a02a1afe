"""Copies of a part's sidecars that a crash left beside it (`NNNNN.idx.tmp`, `NNNNN.org.tmp`: a sidecar
deleted under the writer, made again, the crash between its copy and its rename). An origin sidecar's
copy whose sidecar is gone holds the part's only origin rows: the next start, the writer opening the
part again and `check(fix=True)` put it in place, aligned to the index; any other copy is removed.
`check()` names each, and what its fix will do."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from storage import LOST_QUEUE, NO_QUEUE, Record, ScheduleStore, SegmentLayout, check
from storage.origin import ORIGIN_DTYPE, ORIGIN_ROW_SIZE
from storage import _writer

T0 = 1_700_000_000_000
HOUR = 3_600_000
#: the origins of the records `_stored` keeps
OFFSETS = [500 + i for i in range(5)]


def _records(n: int, start: int = 0) -> list[Record]:
    return [Record(f"id-{start + i}", "T", b"x" * (i % 7), T0 + (start + i) * 10) for i in range(n)]


def _stored(data_dir: Path) -> tuple[list[str], Path]:
    """Five records of one part stored with origins and checkpointed (the store closed): their ids,
    and the part's record file."""
    with ScheduleStore(data_dir) as store:
        recs = _records(len(OFFSETS))
        store.append(recs, T0, [("b:0", o) for o in OFFSETS])
    (log,) = list(data_dir.glob("schedule/*/00000.log"))
    return [r.msg_id for r in recs], log


def _origins(store: ScheduleStore, ids: list[str]) -> list[int | str | None]:
    """Each record's origin offset; None for unknown, "lost" for a row written and lost."""
    locs = [loc for loc in store.meta.locations(ids) if loc is not None]
    assert len(locs) == len(ids)
    rows = store.read_origins(np.array([loc.segment_ms for loc in locs], np.int64),
                              np.array([loc.part for loc in locs], np.int64),
                              np.array([loc.offset for loc in locs], np.int64))
    return [None if int(r["queue"]) == NO_QUEUE else "lost" if int(r["queue"]) == LOST_QUEUE else int(r["offset"])
            for r in rows]


def _indexed(store: ScheduleStore) -> int:
    """How many records the index of the one segment holds."""
    (seg,) = store.layout.list_segments()
    return len(store.segment_index(seg).offset)


def _left_copy(sidecar: Path, rows: float | None = None) -> Path:
    """The crash's state: `sidecar` moved to its copy's name (its own name gone), the copy cut to
    `rows` rows (a crash during the copy); the copy."""
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    os.rename(sidecar, tmp)
    if rows is not None:
        os.truncate(tmp, int(rows * ORIGIN_ROW_SIZE))
    return tmp


@pytest.mark.parametrize("rows", [None, 3, 3.5])
def test_the_next_start_puts_an_origin_sidecars_copy_in_place_when_the_sidecar_is_gone(
        tmp_path: Path, rows: float | None) -> None:
    ids, log = _stored(tmp_path)
    tmp = _left_copy(log.with_suffix(".org"), rows)
    with ScheduleStore(tmp_path) as store:
        kept = len(OFFSETS) if rows is None else int(rows)
        assert _origins(store, ids) == OFFSETS[:kept] + ["lost"] * (len(OFFSETS) - kept)
        assert [f for f in store.recovery.findings if str(tmp) in f]
    assert not tmp.exists()
    assert log.with_suffix(".org").stat().st_size == len(OFFSETS) * ORIGIN_ROW_SIZE
    assert check(SegmentLayout.open_existing(tmp_path)).findings == []


@pytest.mark.parametrize("sidecar", [".idx", ".org"])
def test_the_next_start_removes_a_copy_whose_sidecar_is_there(tmp_path: Path, sidecar: str) -> None:
    ids, log = _stored(tmp_path)
    tmp = log.with_suffix(sidecar + ".tmp")
    tmp.write_bytes(b"\x07" * 40)  # whatever the copy holds, the sidecar at its name is the one
    with ScheduleStore(tmp_path) as store:
        assert _origins(store, ids) == OFFSETS
        assert _indexed(store) == len(OFFSETS)
    assert not tmp.exists()
    assert check(SegmentLayout.open_existing(tmp_path)).findings == []


def test_the_next_start_removes_an_index_copy_and_indexes_the_part_again_keeping_its_origins(tmp_path: Path) -> None:
    ids, log = _stored(tmp_path)
    tmp = _left_copy(log.with_suffix(".idx"))
    with ScheduleStore(tmp_path) as store:
        assert _indexed(store) == len(OFFSETS)
        assert _origins(store, ids) == OFFSETS  # the rows were written in step with the records
    assert not tmp.exists()
    assert check(SegmentLayout.open_existing(tmp_path)).findings == []


def test_the_writer_opening_a_part_again_puts_an_origin_sidecars_copy_in_place(tmp_path: Path) -> None:
    # a copy that appears while the engine has the part closed: the writer's O_CREAT of the sidecar
    # would otherwise make an empty one, and the part's rows would all read as lost
    store = ScheduleStore(tmp_path)
    try:
        first = _records(5)
        store.append(first, T0, [("b:0", o) for o in OFFSETS])
        (org,) = list(tmp_path.glob("schedule/*/00000.org"))
        _close_the_part(store)
        tmp = _left_copy(org)
        more = _records(2, 5)
        store.append(more, T0, [("b:0", 900), ("b:0", 901)])
        assert not tmp.exists()
        assert _origins(store, [r.msg_id for r in first + more]) == OFFSETS + [900, 901]
    finally:
        store.close()


def _close_the_part(store: ScheduleStore) -> None:
    """Have the writer close the first part's files (it opens them again at its next write): it keeps
    at most `_MAX_OPEN_FDS` parts open, so one record in each of that many other hours closes it."""
    others = [Record(f"other-{h}", "T", b"o", T0 + (h + 1) * HOUR) for h in range(_writer._MAX_OPEN_FDS)]
    store.append(others, T0, [("b:1", h) for h in range(len(others))])


@pytest.mark.parametrize("sidecar, adopted", [(".org", True), (".org", False), (".idx", False)])
def test_check_names_a_copy_and_its_fix_settles_it(tmp_path: Path, sidecar: str, adopted: bool) -> None:
    ids, log = _stored(tmp_path)
    if adopted:
        tmp = _left_copy(log.with_suffix(sidecar), 3)
    else:
        tmp = log.with_suffix(sidecar + ".tmp")
        shutil.copyfile(log.with_suffix(sidecar), tmp)
    layout = SegmentLayout.open_existing(tmp_path)
    found = [f for f in check(layout).findings if f.path == str(tmp)]
    assert [f.kind for f in found] == ["leftover_copy"]
    assert ("puts it in place" if adopted else "removes it") in found[0].detail
    assert tmp.exists()
    rep = check(layout, fix=True)
    assert [(f.kind, f.path) for f in rep.findings] == [("leftover_copy", str(tmp))] and rep.fixed == 1
    assert ("put in place" if adopted else "removed") in rep.findings[0].detail
    assert not tmp.exists()
    assert check(layout).findings == []
    if adopted:
        rows = np.fromfile(log.with_suffix(sidecar), ORIGIN_DTYPE)
        assert rows["offset"][:3].tolist() == OFFSETS[:3] and rows["queue"][3:].tolist() == [LOST_QUEUE] * 2


def test_check_does_not_report_the_writers_copy_made_while_it_watches(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a running engine making a deleted sidecar again: its copy is renamed into place a moment later
    _, log = _stored(tmp_path)
    tmp = _left_copy(log.with_suffix(".org"))
    sleep = time.sleep

    def renamed_meanwhile(seconds: float) -> None:  # the rename lands while check watches the copy
        if tmp.exists():
            os.rename(tmp, log.with_suffix(".org"))
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", renamed_meanwhile)
    rep = check(SegmentLayout.open_existing(tmp_path))
    assert (rep.findings, rep.tails_in_flight) == ([], 1)


def test_check_fix_leaves_a_copy_beside_a_part_the_engine_has_open(tmp_path: Path) -> None:
    # the engine holds the part's lock while it has it open: its own copy may be on its way into place
    with ScheduleStore(tmp_path) as store:
        store.append(_records(2), T0, [("b:0", 1), ("b:0", 2)])
        (org,) = list(tmp_path.glob("schedule/*/00000.org"))
        tmp = org.with_name(org.name + ".tmp")
        shutil.copyfile(org, tmp)
        rep = check(store.layout, fix=True)
        assert (rep.findings, rep.fixed, rep.tails_in_flight) == ([], 0, 1)
        assert tmp.exists()


def test_check_names_a_copy_without_its_part_as_an_orphan(tmp_path: Path) -> None:
    _, log = _stored(tmp_path)
    stray = log.with_name("00007.org.tmp")
    stray.write_bytes(b"")
    rep = check(SegmentLayout.open_existing(tmp_path), fix=True)
    assert [(f.kind, f.path) for f in rep.findings] == [("orphan_index", str(stray))] and stray.exists()
