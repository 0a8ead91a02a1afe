"""The segment loader's account of records that arrive after their segment was loaded."""
from __future__ import annotations

from unittest.mock import Mock

import numpy as np
from hypothesis import given, settings, strategies as st

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
