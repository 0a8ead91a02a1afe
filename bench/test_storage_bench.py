"""Storage micro benchmarks: batch append (async, sync), index and dispatch-log loads of 1M records.

Run: .venv/bin/python -m pytest bench/test_storage_bench.py --benchmark-only
Figures are reported by pytest-benchmark; `extra_info` carries messages per second.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from storage import Record, ScheduleStore, encode, read_dispatch_log
from storage.layout import SegmentLayout

from bench.conftest import HOUR, NOW, ONE_MILLION

BODY = b"x" * 200


def _batches(prefix: str, size: int, spread_ms: int) -> Iterator[list[Record]]:
    rng = np.random.default_rng(7)
    for b in itertools.count():
        dues = (NOW + rng.integers(0, spread_ms, size)).tolist()
        yield [Record(f"{prefix}-{b}-{i}", "ORDERS", BODY, d) for i, d in enumerate(dues)]


@pytest.mark.parametrize("flush,batch", [("async", 1000), ("sync", 100)])
def test_append(benchmark: BenchmarkFixture, tmp_path: Path, flush: Literal["async", "sync"],
                batch: int) -> None:
    store = ScheduleStore(tmp_path / flush, flush=flush)
    per_round = 20_000
    source = _batches(flush, batch, 48 * HOUR)

    def setup() -> tuple[tuple[list[list[Record]]], dict[str, object]]:
        return ([next(source) for _ in range(per_round // batch)],), {}

    def run(batches: list[list[Record]]) -> None:
        for recs in batches:
            store.append(recs, NOW)

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
    assert benchmark.stats is not None
    benchmark.extra_info["messages_per_s"] = round(per_round / benchmark.stats.stats.median)
    store.close()


def test_encode(benchmark: BenchmarkFixture) -> None:
    recs = next(_batches("e", 20_000, HOUR))
    benchmark(lambda: [encode(r) for r in recs])
    assert benchmark.stats is not None
    benchmark.extra_info["messages_per_s"] = round(len(recs) / benchmark.stats.stats.median)


def test_load_index_1m(benchmark: BenchmarkFixture, million_segment: tuple[Path, int]) -> None:
    root, seg = million_segment
    store = ScheduleStore(root)
    ix = benchmark(store.segment_index, seg)
    assert len(ix) == ONE_MILLION
    store.close()


def test_load_dispatch_log_1m(benchmark: BenchmarkFixture, million_segment: tuple[Path, int]) -> None:
    root, seg = million_segment
    layout = SegmentLayout.open_existing(root)
    read = benchmark(read_dispatch_log, layout.dispatch_log(seg))
    assert len(read.entries) == ONE_MILLION


@pytest.fixture(scope="module")
def stored_reads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScheduleStore, np.ndarray]]:
    """256 records as the engine stores them (200-byte bodies, tags, one key; every 8th with properties)."""
    store = ScheduleStore(tmp_path_factory.mktemp("reads") / "data")
    recs = [Record(f"{i:032X}:0badf00d", "BENCH_OUT", BODY, NOW + 10 + i, tags="tag", keys=(f"order-{i}",),
                   properties={"p": str(i)} if i % 8 == 7 else {}) for i in range(256)]
    locs = store.append(recs, NOW).locations
    yield store, locs
    store.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["python-check", "compiled-scan"])
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_read_record_bytes(benchmark: BenchmarkFixture, stored_reads: tuple[ScheduleStore, np.ndarray], rows: int,
                           compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Due records read as checked bytes (`read_record_bytes`), as the dispatcher reads a send batch
    (checked by numpy and Python, or by the compiled scan)."""
    import storage.record_reader as reader
    if not compiled:
        monkeypatch.setattr(reader, "_scan", None)
    store, locs = stored_reads
    segs, parts = locs["segment_ms"][:rows].astype(np.int64), locs["part"][:rows].astype(np.uint16)
    offs, due = locs["offset"][:rows].astype(np.uint32), locs["due_ms"][:rows].astype(np.int64)
    got = benchmark(store.read_record_bytes, segs, parts, offs, due)
    assert got.ok.all()
    assert benchmark.stats is not None
    benchmark.extra_info["us_per_read"] = round(benchmark.stats.stats.mean * 1e6, 2)
