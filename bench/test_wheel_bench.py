"""TimeWheel micro benchmarks: a segment's million loaded, drained, topped up, cancelled.

Run: .venv/bin/python -m pytest bench/test_wheel_bench.py --benchmark-only

The load is one hour of due times (uniform, 1M entries) into the production wheel (500 ms tick,
16384 slots). Medians of three runs on the 2-core development machine (AMD EPYC with AVX-512,
Python 3.11, numpy 2.4), with a RocketMQ broker of the integration tests busy beside them:

    bulk add, 1M entries over an hour ........................ 25.7 ms
      baseline: np.argsort (quicksort) of the same + gathers .. 26.8 ms, ties in no given order
      baseline: stable np.argsort of the same + gathers ....... 103 ms
    drain the hour slot by slot (7200 pop_due calls) ......... 105 ms  (15 us per slot)
    pop_due every millisecond for 10 s (10 000 calls) ........ 20.8 ms (2.1 us per call)
    add 32 entries into the loaded wheel ..................... 6.1 us
    next_due_ms on the loaded wheel .......................... 0.25 us
    catch-up: one pop_due across the whole loaded hour ....... 29.8 ms
    remove 100 refs from the loaded wheel .................... 7.7 ms

numpy 2 sorts int64 with AVX-512 kernels, so the unstable full sort is no slower than bucketing
here; the wheel needs ties in insertion order, and the stable full sort is four times slower.

Nothing here asserts on time; the figures above are refreshed by hand from the command's output.
"""

from __future__ import annotations

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from timewheel.wheel import TimeWheel

HOUR_MS = 3_600_000
N = 1_000_000
TICK = 500
SLOTS = 16384
START = 1_767_225_600_000  # 2026-01-01T00:00Z, an hour boundary


@pytest.fixture(scope="module")
def hour() -> tuple[np.ndarray, np.ndarray]:
    """One hour of uniformly spread due times and their refs, as a segment load delivers them."""
    rng = np.random.default_rng(2026)
    due = START + rng.integers(0, HOUR_MS, N)
    return due.astype(np.int64), np.arange(N, dtype=np.uint64)


def loaded(hour: tuple[np.ndarray, np.ndarray]) -> TimeWheel:
    """A production-shaped wheel holding the hour."""
    wheel = TimeWheel(TICK, SLOTS, START)
    assert not wheel.add(*hour).any()
    return wheel


def test_bulk_add_1m(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """Bulk add of a segment's million into an empty wheel: bucketing by slot, no sort by due."""

    def setup():
        return (TimeWheel(TICK, SLOTS, START), *hour), {}

    benchmark.pedantic(lambda w, d, r: w.add(d, r), setup=setup, rounds=20)
    wheel = loaded(hour)
    benchmark.extra_info["bytes_per_entry"] = wheel.nbytes / len(wheel)


def test_baseline_full_argsort_1m(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """The alternative bucketing replaces: a full comparison sort of the due times, then gathers."""
    due, refs = hour

    def full_sort():
        order = np.argsort(due)
        return due.take(order), refs.take(order)

    benchmark.pedantic(full_sort, rounds=20)


def test_baseline_stable_argsort_1m(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """The same with ties kept in insertion order, which the wheel promises."""
    due, refs = hour

    def stable_sort():
        order = np.argsort(due, kind="stable")
        return due.take(order), refs.take(order)

    benchmark.pedantic(stable_sort, rounds=5)


def test_drain_hour_slot_by_slot(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """pop_due at the last millisecond of each of the hour's 7200 slots."""
    stops = range(START + TICK - 1, START + HOUR_MS, TICK)

    def drain(wheel: TimeWheel) -> int:
        released = 0
        for now in stops:
            released += len(wheel.pop_due(now)[0])
        return released

    def setup():
        return (loaded(hour),), {}

    benchmark.pedantic(drain, setup=setup, rounds=5)
    benchmark.extra_info["slots"] = len(stops)


def test_pop_due_every_millisecond(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """A driver calling pop_due each millisecond for 10 s (about 2800 entries released)."""
    stops = range(START, START + 10_000)

    def tick_by_ms(wheel: TimeWheel) -> None:
        for now in stops:
            wheel.pop_due(now)

    def setup():
        return (loaded(hour),), {}

    benchmark.pedantic(tick_by_ms, setup=setup, rounds=5)
    benchmark.extra_info["calls"] = len(stops)


def test_add_32_into_loaded_wheel(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """Late arrivals: batches of 32 into a wheel holding the hour (staging, runs and merges)."""
    wheel = loaded(hour)
    rng = np.random.default_rng(32)
    batches = [
        (START + rng.integers(0, HOUR_MS, 32), rng.integers(0, 2**63, 32).astype(np.uint64))
        for _ in range(1024)
    ]
    state = {"i": 0}

    def add32() -> None:
        due, refs = batches[state["i"] % len(batches)]
        state["i"] += 1
        wheel.add(due, refs)

    benchmark(add32)
    assert wheel.check() == []


def test_next_due_ms_on_loaded_wheel(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """What a driver asks before sleeping; cached, so cheap to call every millisecond."""
    wheel = loaded(hour)
    wheel.pop_due(START + 250)
    benchmark(wheel.next_due_ms)


def test_catch_up_whole_hour(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """After a pause: one pop_due across the entire loaded hour (a gather and a radix sort)."""

    def setup():
        return (loaded(hour),), {}

    benchmark.pedantic(lambda w: w.pop_due(START + HOUR_MS), setup=setup, rounds=10)


def test_remove_100_from_loaded_wheel(benchmark: BenchmarkFixture, hour: tuple[np.ndarray, np.ndarray]) -> None:
    """Cancels: 100 refs looked up across the held million (rare; np.isin per array)."""
    rng = np.random.default_rng(100)

    def setup():
        return (loaded(hour), rng.choice(N, 100, replace=False).astype(np.uint64)), {}

    benchmark.pedantic(lambda w, refs: w.remove(refs), setup=setup, rounds=10)
