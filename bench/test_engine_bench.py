"""Engine micro benchmarks: a 1M-record segment loaded into wheel-ready form, memory per entry.

Run: .venv/bin/python -m pytest bench/test_engine_bench.py --benchmark-only
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from pytest_benchmark.fixture import BenchmarkFixture

from storage import ScheduleStore
from timewheel.loader import SegmentLoader
from timewheel.wheel import TimeWheel

from bench.conftest import HOUR, ONE_MILLION


def test_load_segment_into_wheel_1m(benchmark: BenchmarkFixture, million_segment: tuple[Path, int]) -> None:
    """Index sidecar + dispatch log (every record delivered) -> filtered -> wheel."""
    root, seg = million_segment
    store = ScheduleStore(root)
    # a dispatch log that covers every record is the worst case for filtering; the wheel-ready
    # form of an undispatched segment is measured with the log hidden below
    def load() -> TimeWheel:
        wheel = TimeWheel(500, 2 * 7200 + 10, seg)
        wheel.add(*SegmentLoader(store).load(seg))
        return wheel

    benchmark(load)
    store.close()


def test_load_undispatched_segment_into_wheel_1m(benchmark: BenchmarkFixture,
                                                 million_segment: tuple[Path, int]) -> None:
    root, seg = million_segment
    store = ScheduleStore(root)
    path = store.layout.dispatch_log(seg)
    hidden = path.with_suffix(".hidden")
    path.rename(hidden)
    try:
        def load() -> TimeWheel:
            wheel = TimeWheel(500, 2 * 7200 + 10, seg)
            wheel.add(*SegmentLoader(store).load(seg))
            return wheel

        wheel = benchmark(load)
        assert len(wheel) == ONE_MILLION
        benchmark.extra_info["bytes_per_entry"] = wheel.nbytes / len(wheel)
    finally:
        hidden.rename(path)
        store.close()


def test_wheel_bytes_per_entry_after_load(million_segment: tuple[Path, int]) -> None:
    root, seg = million_segment
    wheel = TimeWheel(500, 2 * 7200 + 10, seg)
    due = seg + np.random.default_rng(0).integers(0, HOUR, ONE_MILLION)
    wheel.add(due, np.arange(ONE_MILLION, dtype=np.uint64))
    print(f"\nwheel bytes per loaded entry: {wheel.nbytes / len(wheel):.2f}")
    assert wheel.nbytes / len(wheel) <= 16
