"""Origin sidecar rows written as lost reach the engine's stats, its metrics and the status document."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from storage import Record, ScheduleStore
from storage.origin import ORIGIN_ROW_SIZE
from timewheel import Engine, EngineConfig, ManualClock, Message
from timewheel.app.metrics import EngineCollector
from timewheel.app.status import status_document

T0 = 1_800_000_000_000


class _Sink:
    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        return [True] * len(messages)


def test_rows_recovery_wrote_as_lost_are_in_the_stats_the_metrics_and_the_status(tmp_path: Path) -> None:
    data = tmp_path / "d"
    store = ScheduleStore(data)
    store.append([Record(f"id-{i}", "T", b"x", T0 + 3_600_000 + i) for i in range(6)], T0,
                 [("b:1", 100 + i) for i in range(6)])
    store._wal.close()  # a crash before any checkpoint: the ingest log replays the six at the next open
    store.writer.close()
    store.meta.close()
    (org,) = list(data.glob("schedule/*/*.org"))
    os.truncate(org, 2 * ORIGIN_ROW_SIZE)  # the page cache lost four of the six rows
    e = Engine(EngineConfig(data), _Sink(), ManualClock(T0)).start(background=False)
    try:
        stats = e.stats()
        assert stats.storage_origin_rows_lost == 4
        samples = {s.name: s.value for m in EngineCollector(e.stats, lambda: e.lateness_buckets).collect()
                   for s in m.samples}
        assert samples["timewheel_storage_origin_rows_lost_total"] == 4.0
        doc = status_document(stats.as_dict(), serving=True, now_ms=T0, lag=None, lag_error=None,
                              lateness_ms=[0.0, 0.0], lateness_count=0, lateness_span_ms=0)
        assert doc["storage_origin_rows_lost"] == 4
    finally:
        e.stop()
