"""Fixtures shared by the micro benchmarks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from storage import DELIVERED, INDEX_DTYPE, ScheduleStore, dispatch_entries
from storage.layout import SegmentLayout

NOW = 1_800_000_000_000
HOUR = 3_600_000
ONE_MILLION = 1_000_000


@pytest.fixture(scope="module")
def million_segment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
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
