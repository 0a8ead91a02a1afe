"""The segment loader's account of records that arrive after their segment was loaded."""
from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from storage import Record, ScheduleStore
from storage.ingest_log import LOCATION_DTYPE
from timewheel.loader import LoadedSegment, SegmentLoader

SEG = 1_800_000_000_000 - 1_800_000_000_000 % 3_600_000

_rows = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3000), st.integers(44, 600)), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(rows=_rows, ends=st.dictionaries(st.integers(0, 2), st.integers(0, 3000), max_size=3))
def test_what_a_commit_adds_is_what_lies_past_each_parts_loaded_end(rows: list[tuple[int, int, int]],
                                                                   ends: dict[int, int]) -> None:
    """Each new record counts once, and each part's loaded end moves past the new ones: one part
    or several, all past the end or some already loaded (the reference: one row at a time)."""
    loader = SegmentLoader(Mock())
    loader.loaded[SEG] = LoadedSegment(SEG, dict(ends), outstanding=5)
    locs = np.zeros(len(rows), LOCATION_DTYPE)
    locs["segment_ms"] = SEG
    locs["part"] = [p for p, _, _ in rows]
    locs["offset"] = [o for _, o, _ in rows]
    locs["length"] = [n for _, _, n in rows]
    want_end = dict(ends)
    want_rows = []
    for i, (p, o, n) in enumerate(rows):
        if o >= ends.get(p, 0):  # past what the load (not this commit) covered
            want_rows.append(i)
            want_end[p] = max(want_end.get(p, 0), o + n)
    fresh = loader.not_covered(SEG, locs)
    assert fresh.tobytes() == locs[want_rows].tobytes()
    assert loader.loaded[SEG].loaded_end == want_end
    assert loader.loaded[SEG].outstanding == 5 + len(want_rows)


def _failing_once(monkeypatch: pytest.MonkeyPatch, store: ScheduleStore, name: str) -> list[int]:
    """Make `store.<name>` raise on its next call only; returns the calls' count."""
    calls: list[int] = []
    real = getattr(store, name)

    def flaky(*a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("a read failed half way")
        return real(*a, **k)

    monkeypatch.setattr(store, name, flaky)
    return calls


def test_a_load_that_fails_half_way_leaves_its_segment_unloaded_and_loads_whole_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index was read, the dispatch log was not: nothing may count as loaded (a retried load
    would otherwise skip the segment, or return nothing for what it marked loaded)."""
    with ScheduleStore(tmp_path) as store:
        store.append([Record(f"m{i}", "T", b"x", SEG + 1000 + i) for i in range(5)], SEG)
        loader = SegmentLoader(store)
        calls = _failing_once(monkeypatch, store, "dispatch_log")
        with pytest.raises(OSError):
            loader.load(SEG)
        assert SEG not in loader.loaded
        due, refs = loader.load(SEG)
        assert sorted(due.tolist()) == [SEG + 1000 + i for i in range(5)] and len(calls) == 2
        assert loader.loaded[SEG].outstanding == 5


def test_a_refresh_that_fails_half_way_moves_no_loaded_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part that appeared after the load is read again whole when the first read of it failed."""
    with ScheduleStore(tmp_path) as store:
        store.append([Record(f"m{i}", "T", b"x", SEG + 1000 + i) for i in range(3)], SEG)
        loader = SegmentLoader(store)
        with monkeypatch.context() as m:  # the load sees no part yet: the part appears after it
            m.setattr(store.layout, "list_parts", lambda seg: [])
            assert len(loader.load(SEG)[0]) == 0
        calls = _failing_once(monkeypatch, store, "dispatch_log")
        with pytest.raises(OSError):
            loader.refresh(SEG)
        assert loader.loaded[SEG].loaded_end == {} and loader.loaded[SEG].outstanding == 0
        due, _ = loader.refresh(SEG)
        assert len(due) == 3 and len(calls) == 2 and loader.loaded[SEG].outstanding == 3
