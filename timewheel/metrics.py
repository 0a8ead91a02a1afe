"""Prometheus exposition of the engine's counters, gauges and lateness histogram."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

#: upper bounds (seconds) of the lateness histogram's buckets
LATENESS_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      300.0)


class LatenessBuckets:
    """Cumulative-ready bucket counts of lateness, filled a batch at a time (no per-message call)."""

    def __init__(self, bounds_s: Iterable[float] = LATENESS_BUCKETS_S) -> None:
        self.bounds_ms = np.asarray([b * 1000 for b in bounds_s])
        self.counts = np.zeros(len(self.bounds_ms) + 1, np.int64)  # the last one is +Inf
        self.sum_ms = 0.0

    def observe(self, lateness_ms: np.ndarray) -> None:
        """Count a batch of lateness values (ms)."""
        if len(lateness_ms):
            idx = np.searchsorted(self.bounds_ms, lateness_ms, side="left")
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum_ms += float(lateness_ms.sum())

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        """A Prometheus histogram in seconds."""
        cum = np.cumsum(self.counts)
        buckets = [(f"{b / 1000:g}", int(c)) for b, c in zip(self.bounds_ms, cum[:-1])] + [("+Inf", int(cum[-1]))]
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.sum_ms / 1000)


_COUNTERS = {
    "scheduled": "Messages stored for later delivery (duplicates excluded).",
    "duplicates": "Messages whose id was already stored (producer retries, redeliveries).",
    "delivered": "Messages delivered to their target topic.",
    "cancelled": "Messages cancelled before they were due.",
    "dead_lettered": "Messages sent to the dead-letter path after every attempt failed.",
    "retries": "Failed sends queued for another attempt.",
    "send_failures": "Sends that failed (each attempt).",
    "corrupt": "Records found corrupt at dispatch time (never served).",
    "catch_up_segments": "Past segments drained after downtime.",
}


class EngineCollector(Collector):
    """Reads a stats() snapshot on each scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, object]], lateness: Callable[[], LatenessBuckets]) -> None:
        self._stats = stats
        self._lateness = lateness

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families."""
        st = self._stats()
        for key, doc in _COUNTERS.items():
            if key in st:
                yield CounterMetricFamily(f"timewheel_{key}", doc, value=float(st[key]))  # type: ignore[arg-type]
        for sub, prefix in (("ingest", "timewheel_ingest"), ("delivery", "timewheel_delivery"),
                            ("shaping", "timewheel_shaping")):
            for key, value in (st.get(sub) or {}).items():  # type: ignore[union-attr]
                if isinstance(value, (int, float)):
                    yield CounterMetricFamily(f"{prefix}_{key}", f"{sub}: {key}", value=float(value))
        for key, doc in (("wheel_entries", "Entries held by the in-memory wheel."),
                         ("wheel_bytes", "Bytes held by the wheel's arrays."),
                         ("ready", "Due messages waiting for a sender."),
                         ("backlog", "Overdue messages of past segments waiting (catch-up)."),
                         ("retrying", "Messages waiting for their next attempt."),
                         ("storage_corrupt_records", "Corrupt records the store has found on reads.")):
            if key in st:
                yield GaugeMetricFamily(f"timewheel_{key}", doc, value=float(st[key]))  # type: ignore[arg-type]
        if "circuit_open" in st:
            yield GaugeMetricFamily("timewheel_circuit_open", "1 while sends to the broker are held back.",
                                    value=float(bool(st["circuit_open"])))
        pending = GaugeMetricFamily("timewheel_pending", "Outstanding messages of each loaded segment.",
                                    labels=["segment"])
        for seg, n in (st.get("loaded_segments") or {}).items():  # type: ignore[union-attr]
            pending.add_metric([str(seg)], float(n))
        yield pending
        yield self._lateness().family("timewheel_lateness_seconds", "Send time minus due time.")
