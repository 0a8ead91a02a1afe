"""The id index of ingest (`storage.meta.MetaStore`): a commit's dedup look-up of new ids, then
their put, in a store already holding the ids of the last half minute at 10k/s.

Run: .venv/bin/python -m pytest bench/test_meta_bench.py --benchmark-only
`extra_info` carries microseconds per id. A commit at 10k/s holds about 143 ids (`bench.stage_cpu`);
nearly all are new, so the look-up is a miss the filters should answer.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from storage.meta import MetaStore

COMMIT = 143
HELD = 300_000  # 30 s at 10k/s: the memtable's ids


def _ids(n: int) -> list[str]:
    return [uuid.uuid4().hex.upper() for _ in range(n)]


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetaStore]:
    m = MetaStore(Path(tmp_path_factory.mktemp("meta")) / "meta")
    for _ in range(HELD // COMMIT):
        ids = _ids(COMMIT)
        m.put_records(ids, [0] * COMMIT, [0] * COMMIT, list(range(COMMIT)), [()] * COMMIT)
    yield m
    m.close()


def test_look_up_new_ids(benchmark: BenchmarkFixture, meta: MetaStore) -> None:
    """One commit's dedup look-up: every id new."""
    fresh = iter(lambda: _ids(COMMIT), None)
    benchmark.pedantic(lambda ids: meta.known(ids), setup=lambda: ((next(fresh),), {}), rounds=400, warmup_rounds=20)
    assert benchmark.stats is not None
    benchmark.extra_info["us_per_id"] = benchmark.stats.stats.median / COMMIT * 1e6


def test_look_up_then_put(benchmark: BenchmarkFixture, meta: MetaStore) -> None:
    """One commit's look-up, then the put of its ids' locations (as `ScheduleStore` commits)."""
    fresh = iter(lambda: _ids(COMMIT), None)
    offsets = list(range(COMMIT))

    def commit(ids: list[str]) -> None:
        assert not any(meta.known(ids))
        meta.put_records(ids, [0] * COMMIT, [0] * COMMIT, offsets, [()] * COMMIT)

    benchmark.pedantic(commit, setup=lambda: ((next(fresh),), {}), rounds=400, warmup_rounds=20)
    assert benchmark.stats is not None
    benchmark.extra_info["us_per_id"] = benchmark.stats.stats.median / COMMIT * 1e6

