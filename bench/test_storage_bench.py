"""Storage micro benchmarks: batch append (async, sync), index and dispatch-log loads of 1M records.

Run: .venv/bin/python -m pytest bench/test_storage_bench.py --benchmark-only
Figures are reported by pytest-benchmark; `extra_info` carries messages per second.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from storage import (DELIVERED, INDEX_DTYPE, Record, ScheduleStore, dispatch_entries, encode, read_dispatch_log)
from storage.layout import SegmentLayout

NOW = 1_800_000_000_000
HOUR = 3_600_000
BODY = b"x" * 200
ONE_MILLION = 1_000_000


def _batches(prefix: str, size: int, spread_ms: int):
    rng = np.random.default_rng(7)
    for b in itertools.count():
        dues = (NOW + rng.integers(0, spread_ms, size)).tolist()
        yield [Record(f"{prefix}-{b}-{i}", "ORDERS", BODY, d) for i, d in enumerate(dues)]


@pytest.mark.parametrize("flush,batch", [("async", 1000), ("sync", 100)])
def test_append(benchmark, tmp_path: Path, flush: str, batch: int) -> None:
    store = ScheduleStore(tmp_path / flush, flush=flush)
    per_round = 20_000
    source = _batches(flush, batch, 48 * HOUR)

    def setup():
        return ([next(source) for _ in range(per_round // batch)],), {}

    def run(batches):
        for recs in batches:
            store.append(recs, NOW)

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
    benchmark.extra_info["messages_per_s"] = round(per_round / benchmark.stats.stats.median)
    store.close()


def test_encode(benchmark) -> None:
    recs = next(_batches("e", 20_000, HOUR))
    benchmark(lambda: [encode(r) for r in recs])
    benchmark.extra_info["messages_per_s"] = round(len(recs) / benchmark.stats.stats.median)


@pytest.fixture(scope="module")
def million_segment(tmp_path_factory) -> tuple[Path, int]:
    """A segment of 1M records with an equally long dispatch log, written as the engine would."""
    root = tmp_path_factory.mktemp("million")
    layout = SegmentLayout(root)
    seg = layout.segment_start(NOW)
    rng = np.random.default_rng(1)
    idx = np.empty(ONE_MILLION, INDEX_DTYPE)
    idx["due_ms"] = seg + rng.integers(0, HOUR, ONE_MILLION)
    idx["length"] = 250
    idx["offset"] = np.arange(ONE_MILLION, dtype=np.uint32) * 250
    layout.segment_dir(seg).mkdir(parents=True)
    idx.tofile(layout.part_index(seg, 0))
    with open(layout.part_log(seg, 0), "wb") as f:
        f.truncate(ONE_MILLION * 250)
    store = ScheduleStore(root)
    for chunk in np.array_split(np.arange(ONE_MILLION), 1000):
        store.record_dispatch(seg, dispatch_entries(0, idx["offset"][chunk], idx["due_ms"][chunk], NOW,
                                                    DELIVERED), NOW)
    store.close()
    return root, seg


def test_load_index_1m(benchmark, million_segment) -> None:
    root, seg = million_segment
    store = ScheduleStore(root)
    ix = benchmark(store.segment_index, seg)
    assert len(ix) == ONE_MILLION
    store.close()


def test_load_dispatch_log_1m(benchmark, million_segment) -> None:
    root, seg = million_segment
    layout = SegmentLayout.open_existing(root)
    read = benchmark(read_dispatch_log, layout.dispatch_log(seg))
    assert len(read.entries) == ONE_MILLION
