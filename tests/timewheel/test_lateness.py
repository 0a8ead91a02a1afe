"""Metrics helpers: percentiles of the lateness histogram."""
from __future__ import annotations

import numpy as np
import pytest
from hdrh.histogram import HdrHistogram
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel.lateness import LATENESS_MAX_US, LatenessBuckets, LatenessRecorder, hdr_percentiles

PERCENTILES = (0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3_600_000_000), st.integers(1, 1000)), min_size=1, max_size=50))
def test_percentiles_match_the_library(values: list[tuple[int, int]]) -> None:
    h = HdrHistogram(1, LATENESS_MAX_US, 3)
    for v, c in values:
        h.record_value(v, c)
    expected = [h.get_value_at_percentile(p) for p in PERCENTILES[1:]]
    assert hdr_percentiles(h, PERCENTILES[1:]) == expected


def test_empty_histogram_gives_zeros() -> None:
    assert hdr_percentiles(HdrHistogram(1, LATENESS_MAX_US, 3), (50, 99)) == [0, 0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 400_000)), max_size=60), max_size=4))
def test_a_recorder_counts_what_a_value_at_a_time_would(batches: list[list[int]]) -> None:
    r = LatenessRecorder()
    h = HdrHistogram(1, LATENESS_MAX_US, 3)
    b = LatenessBuckets()
    for batch in batches:
        values = np.asarray(batch, np.int64)
        r.observe(values)
        b.observe(values)
        for v in batch:
            h.record_value(v * 1000)
    assert r.buckets.counts.tolist() == b.counts.tolist() and r.buckets.sum_ms == b.sum_ms
    assert list(r.histogram.counts) == list(h.counts) and r.histogram.get_total_count() == h.get_total_count()
    assert (r.histogram.get_min_value(), r.histogram.get_max_value()) == (h.get_min_value(), h.get_max_value())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5000), max_size=9), max_size=12), st.integers(1, 10))
def test_values_kept_are_counted_once_whenever_the_recorder_counts_them(batches: list[list[int]], every: int) -> None:
    """Kept values are counted when enough wait or when read, never twice and never lost."""
    import timewheel.lateness as lateness
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lateness, "_PENDING_MAX", every)
        r = LatenessRecorder()
        h = HdrHistogram(1, LATENESS_MAX_US, 3)
        for k, batch in enumerate(batches):
            r.observe(np.asarray(batch, np.int64))
            for v in batch:
                h.record_value(v * 1000)
            if k % 3 == 2:  # a scrape between sends
                assert r.summary().count == h.get_total_count()
        assert list(r.histogram.counts) == list(h.counts) and r.buckets.counts.sum() == h.get_total_count()


def test_lateness_past_the_histogram_s_range_is_counted_not_dropped() -> None:
    # a week-long outage's deliveries are the ones an operator asks about: the histogram dropped them
    r = LatenessRecorder()
    r.observe(np.array([5, 7 * 86_400_000, 90 * 86_400_000], np.int64))  # 5 ms, a week, 90 days
    s = r.summary()
    assert s.count == 3 and s.max >= 30 * 86_400_000 * 0.999
    assert s.p50 >= 7 * 86_400_000 * 0.999  # the week-late one is the median, not left out
