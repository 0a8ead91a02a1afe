"""Fixtures of the Spark tests: one SparkSession for the session, and stores built with ScheduleStore."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest

from storage import Record, ScheduleStore, dispatch_entries

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MakeStore = Callable[..., ScheduleStore]  # the make_store fixture: ScheduleStore's keywords, a store under tmp_path

T0 = 1_800_000_000_000  # 2027-01-15T08:00:00Z, on an hour boundary
HOUR = 3_600_000

# Warnings PySpark raises in the driver that are not ours to fix; ignored here only.
_SPARK_WARNINGS = (
    "ignore:PySpark does not yet fully support pandas:FutureWarning",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Apply the narrow Spark warning filters to the tests of this directory."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            for f in _SPARK_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f))


@pytest.fixture(scope="session")
def spark() -> Iterator["SparkSession"]:
    """A local[2] SparkSession with the timewheel sources, shared by every Spark test."""
    from spark.session import get_session

    session = get_session("local[2]", "timewheel-tests", {
        "spark.sql.shuffle.partitions": "2",
        "spark.default.parallelism": "2",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "1g",
        "spark.sql.adaptive.enabled": "true",
    })
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def records(n: int, *, prefix: str = "m", start: int = T0, step: int = 1000, topic: str = "ORDERS",
            **kw: object) -> list[Record]:
    """n records of one topic, due `step` ms apart from `start`."""
    return [Record(f"{prefix}{i}", topic, f"body-{prefix}{i}".encode(), start + i * step, **kw)  # type: ignore[arg-type]
            for i in range(n)]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[MakeStore]:
    """Open ScheduleStores under tmp_path (closed at teardown)."""
    stores: list[ScheduleStore] = []

    def make(name: str = "data", **kw: object) -> ScheduleStore:
        """A store in tmp_path/name."""
        s = ScheduleStore(tmp_path / name, **kw)  # type: ignore[arg-type]
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def deliver(store: ScheduleStore, seg: int, sel: slice | np.ndarray, outcome: int, dispatch_ms: int,
            attempts: int = 1) -> None:
    """Record `outcome` for the records `sel` of a segment (in index order)."""
    ix = store.segment_index(seg)
    store.record_dispatch(seg, dispatch_entries(ix.part[sel], ix.offset[sel], ix.due_ms[sel], dispatch_ms, outcome,
                                                attempts), dispatch_ms)
