"""Prometheus exposition of the engine's counters, gauges and lateness histogram."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np
from hdrh.histogram import HdrHistogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
                                   SummaryMetricFamily)
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


def hdr_percentiles(h: HdrHistogram, percentiles: Iterable[float]) -> list[int]:
    """Values at `percentiles` of an HdrHistogram, in one vectorised pass over its counts.

    The library walks its ~23k buckets in Python for each percentile (~2 ms each); stats() and
    every metrics scrape asked for three, on the engine's lock.
    """
    ps = list(percentiles)
    counts = np.ctypeslib.as_array(h.counts)[:h.counts_len]
    cum = np.cumsum(counts, dtype=np.int64)
    if not len(cum) or cum[-1] == 0:
        return [0] * len(ps)
    targets = [h.get_target_count_at_percentile(p) for p in ps]
    idx = np.searchsorted(cum, targets, side="left").tolist()
    return [h.get_highest_equivalent_value(h.get_value_from_index(min(i, len(cum) - 1))) for i in idx]


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
        yield from _shaping_families(st.get("shaping") or {})  # type: ignore[arg-type]
        for sub, prefix in (("ingest", "timewheel_ingest"), ("delivery", "timewheel_delivery")):
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


_SHAPING_COUNTERS = {
    "granted": "Messages the traffic shaper let go.",
    "sent": "Messages sent after shaping.",
    "failed": "Sends that failed after shaping (they back their topic off).",
    "throttled": "Messages held back at least once by a rate limit, the global cap or a backoff.",
    "backoffs": "Times a topic's rate was cut after failed sends.",
}
_SHAPING_GAUGES = {
    "backed_off_topics": "Topics sending below their normal rate after failed sends.",
    "waiting": "Due messages waiting for the traffic shaper.",
    "global_rate": "Global cap in messages per second (0: none).",
}


def _shaping_families(sh: Mapping[str, object]) -> Iterable[Metric]:
    """Traffic shaping: totals, and per topic and per class (lateness it caused, throttling)."""
    if not sh:
        return
    for key, doc in _SHAPING_COUNTERS.items():
        if isinstance(sh.get(key), (int, float)):
            yield CounterMetricFamily(f"timewheel_shaping_{key}", doc, value=float(sh[key]))  # type: ignore[arg-type]
    for key, doc in _SHAPING_GAUGES.items():
        if isinstance(sh.get(key), (int, float)):
            yield GaugeMetricFamily(f"timewheel_shaping_{key}", doc, value=float(sh[key]))  # type: ignore[arg-type]
    for key, value in sh.items():  # anything else numeric, as before
        if key not in _SHAPING_COUNTERS and key not in _SHAPING_GAUGES and key not in ("held_ms_sum", "held_count") \
                and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield CounterMetricFamily(f"timewheel_shaping_{key}", f"shaping: {key}", value=float(value))
    held = SummaryMetricFamily("timewheel_shaping_held_seconds", "Time due messages waited for the traffic shaper.")
    held.add_metric([], count_value=float(sh.get("held_count", 0)),  # type: ignore[arg-type]
                    sum_value=float(sh.get("held_ms_sum", 0.0)) / 1000)  # type: ignore[arg-type]
    yield held
    for level, key, labels in (("topic", "topics", ["topic", "class"]), ("class", "classes", ["class"])):
        rows: Mapping[str, Mapping[str, object]] = sh.get(key) or {}  # type: ignore[assignment]
        held = SummaryMetricFamily(f"timewheel_shaping_{level}_held_seconds",
                                   f"Time due messages waited for the traffic shaper, per {level}.", labels=labels)
        counters = {key: CounterMetricFamily(f"timewheel_shaping_{level}_{key}", f"{doc} Per {level}.", labels=labels)
                    for key, doc in _SHAPING_COUNTERS.items()}
        rate = GaugeMetricFamily("timewheel_shaping_topic_rate",
                                 "A topic's effective rate limit in messages per second (0: none), "
                                 "lowered while it is backed off.", labels=labels) if level == "topic" else None
        for name, row in rows.items():
            values = [name, str(row.get("class", ""))] if level == "topic" else [name]
            held.add_metric(values, count_value=float(row.get("held_count", 0)),  # type: ignore[arg-type]
                            sum_value=float(row.get("held_ms_sum", 0.0)) / 1000)  # type: ignore[arg-type]
            for key, fam in counters.items():
                fam.add_metric(values, float(row.get(key, 0)))  # type: ignore[arg-type]
            if rate is not None:
                rate.add_metric(values, float(row.get("effective_rate", 0.0)))  # type: ignore[arg-type]
        yield held
        yield from counters.values()
        if rate is not None:
            yield rate
