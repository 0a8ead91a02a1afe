"""A send's take and a cancel while the dispatch queue remembers many cancels (a workload that
cancels most of what it schedules, as orders paid before their timeout): both must stay cheap
however many are held.

Run: .venv/bin/python -m pytest bench/test_cancel_bench.py --benchmark-only
"""
from __future__ import annotations

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from timewheel import ManualClock
from timewheel._due import DueEntries
from timewheel.dispatch_queue import DispatchQueue

T0 = 1_800_000_000_000


def _queue(held: int) -> DispatchQueue:
    q = DispatchQueue(ManualClock(T0), batch_size=256, catch_up_chunk=100_000)
    rng = np.random.default_rng(1)
    for _ in range(held // 1000):  # cancels come in batches of a thousand
        q.cancel(rng.integers(2**33, 2**40, 1000, dtype=np.uint64))
    return q


def _entries(n: int, first: int) -> DueEntries:
    refs = np.arange(first, first + n, dtype=np.uint64)
    return DueEntries(np.full(n, T0, np.int64), refs, np.zeros(n, np.int16), np.full(n, T0, np.int64),
                      np.zeros(n, np.uint16), refs.astype(np.uint32))


@pytest.mark.parametrize("held", [0, 100_000, 1_000_000])
def test_take_with_cancels_held(benchmark: BenchmarkFixture, held: int) -> None:
    """Push 60 due entries and take them (one send's batch at 10k/s)."""
    q = _queue(held)
    counter = iter(range(10**9))

    def one() -> int:
        q.push_ready(_entries(60, next(counter) * 60))
        taken = q.take(256)
        q.clear_in_hand()
        return taken[1] if taken else 0

    assert benchmark.pedantic(one, rounds=200, warmup_rounds=5) == 60


@pytest.mark.parametrize("held", [0, 100_000, 1_000_000])
def test_one_more_cancel(benchmark: BenchmarkFixture, held: int) -> None:
    """Cancel one more loaded message."""
    q = _queue(held)
    counter = iter(range(10**9))
    benchmark.pedantic(lambda: q.cancel(np.array([next(counter)], np.uint64)), rounds=200, warmup_rounds=5)


@pytest.mark.parametrize("held", [100_000, 1_000_000])
def test_wheel_removal(benchmark: BenchmarkFixture, held: int) -> None:
    """One removal from a wheel holding `held` entries: it scans them all, so the timer applies
    cancels' removals in batches (at most once a second, or per 4,096) rather than pass by pass."""
    from timewheel.wheel import TimeWheel

    w = TimeWheel(start_ms=T0)
    w.add(T0 + np.random.default_rng(1).integers(0, 3_600_000, held), np.arange(held, dtype=np.uint64))
    counter = iter(range(0, 10**9, 7))
    benchmark.pedantic(lambda: w.remove(np.array([next(counter)], np.uint64)), rounds=50, warmup_rounds=2)


@pytest.mark.parametrize("waiting", [60_000, 600_000])
def test_add_a_failed_batch(benchmark: BenchmarkFixture, waiting: int) -> None:
    """60 failed entries queued for retry while `waiting` already wait (a minute of a 10k/s
    outage is 600,000)."""
    q = DispatchQueue(ManualClock(T0), batch_size=256, catch_up_chunk=100_000)
    q.retry(np.full(waiting, T0 + 60_000, np.int64), _entries(waiting, 0))
    counter = iter(range(1, 10**9))
    benchmark.pedantic(lambda: q.retry(np.full(60, T0 + 60_000, np.int64), _entries(60, next(counter) * 60 + waiting)),
                       rounds=300, warmup_rounds=5)
