"""EngineStats: typed fields, and the JSON keys the service and tools have always read."""
from __future__ import annotations

import json

from timewheel.lateness import LatenessSummary
from timewheel.stats import EngineCounters, EngineStats

KEYS = {"scheduled", "duplicates", "delivered", "cancelled", "dead_lettered", "retries", "corrupt", "send_failures",
        "catch_up_segments", "dispatch_log_errors", "ready", "backlog", "retrying", "catch_up_pending_segments",
        "held_by_shaping", "storage_corrupt_records", "shaping", "wheel_entries", "wheel_bytes", "loaded_segments",
        "lateness_ms", "tombstones", "cancel_requests", "cancels_applied", "cancelled_on_arrival",
        "cancel_tombstones_evicted", "cancels_held", "timer_thread_passes", "meta_store_bytes",
        "storage_corrupt_origin_rows", "storage_origin_rows_lost"}


def test_as_dict_keeps_the_keys_and_is_json() -> None:
    st = EngineStats(EngineCounters(scheduled=3, delivered=2), ready=1, shaping={"throttled": 0},
                     loaded_segments={"1800000000000": 1}, lateness_ms=LatenessSummary(1.0, 2.0, 3.0, 4.0, 2))
    d = json.loads(json.dumps(st.as_dict()))
    assert set(d) == KEYS
    assert (d["scheduled"], d["delivered"], d["ready"]) == (3, 2, 1)
    assert d["lateness_ms"] == {"p50": 1.0, "p99": 2.0, "p999": 3.0, "max": 4.0, "count": 2}
    assert d["loaded_segments"] == {"1800000000000": 1} and d["shaping"] == {"throttled": 0}


def test_no_shaping_key_without_a_shaper() -> None:
    assert set(EngineStats().as_dict()) == KEYS - {"shaping"}
