"""Metrics helpers: percentiles of the lateness histogram."""
from __future__ import annotations

from hdrh.histogram import HdrHistogram
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.lateness import hdr_percentiles

PERCENTILES = (0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3_600_000_000), st.integers(1, 1000)), min_size=1, max_size=50))
def test_percentiles_match_the_library(values: list[tuple[int, int]]) -> None:
    h = HdrHistogram(1, 3_600_000_000, 3)
    for v, c in values:
        h.record_value(v, c)
    expected = [h.get_value_at_percentile(p) for p in PERCENTILES[1:]]
    assert hdr_percentiles(h, PERCENTILES[1:]) == expected


def test_empty_histogram_gives_zeros() -> None:
    assert hdr_percentiles(HdrHistogram(1, 3_600_000_000, 3), (50, 99)) == [0, 0]
