"""The last-minute lateness window over the engine's cumulative buckets."""
from __future__ import annotations

import numpy as np
import pytest

from timewheel.app.lateness_window import LatenessWindow
from timewheel.lateness import LatenessBuckets


def test_only_the_last_minute_counts() -> None:
    b = LatenessBuckets()
    w = LatenessWindow(b.bounds_ms, window_ms=60_000, step_ms=5_000)
    b.observe(np.full(1000, 200.0))  # an old burst of 200 ms lateness
    for t in range(0, 120_001, 5_000):
        assert w.sample(t, b.counts)
        if t == 90_000:
            b.observe(np.full(10, 3.0))  # recent: 3 ms
    counts, span = w.recent(120_000, b.counts)
    assert span == 60_000
    assert counts.sum() == 10
    p50, p99 = w.percentiles(counts, (50, 99))
    assert 2.0 < p50 <= 5.0 and 2.0 < p99 <= 5.0  # inside the (2, 5] ms bucket


def test_before_a_snapshot_falls_inside_the_window_everything_since_start_counts() -> None:
    b = LatenessBuckets()
    w = LatenessWindow(b.bounds_ms)
    b.observe(np.array([1.5, 40.0]))
    counts, span = w.recent(1_000, b.counts)
    assert counts.sum() == 2 and span == 0


def test_snapshots_closer_than_a_step_are_not_kept() -> None:
    b = LatenessBuckets()
    w = LatenessWindow(b.bounds_ms, window_ms=10_000, step_ms=5_000)
    assert w.sample(0, b.counts)
    assert not w.sample(4_999, b.counts)
    assert w.sample(5_000, b.counts)


def test_percentiles_interpolate_inside_a_bucket_like_histogram_quantile() -> None:
    w = LatenessWindow(np.array([10.0, 20.0]))
    # 10 values in (10, 20]: the median is half way through that bucket
    assert w.percentiles(np.array([0, 10, 0]), (50,)) == [15.0]
    # a rank in +Inf answers the last finite bound
    assert w.percentiles(np.array([0, 0, 5]), (99,)) == [20.0]
    assert w.percentiles(np.zeros(3, np.int64), (50, 99)) == [0.0, 0.0]


def test_the_window_must_be_whole_steps() -> None:
    with pytest.raises(ValueError, match="multiple"):
        LatenessWindow(np.array([1.0]), window_ms=7_000, step_ms=5_000)
