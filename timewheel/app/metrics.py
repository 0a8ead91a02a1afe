"""Prometheus exposition of the engine's counters, gauges and lateness histogram."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
                                   SummaryMetricFamily)
from prometheus_client.registry import Collector, CollectorRegistry

from timewheel.app.gc_pauses import GcPauses
from timewheel.lateness import LatenessBuckets
from timewheel.stats import EngineStats

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
    "cancel_requests": "Cancels handed to the engine (each queue's copy of a control message, and the admin API's).",
    "cancels_applied": "Cancels applied: new to this engine (copies and repeats are only looked up).",
    "cancelled_on_arrival": "Messages a cancel sent before them cancelled as they arrived (never stored).",
    "cancel_tombstones_evicted": "Cancels forgotten before their retention because max_tombstones was reached.",
    "timer_thread_passes": "Dispatch passes the timer's thread ran itself at a low rate (the others ran on the "
                           "dispatch threads); stops growing while sends are slow.",
}


class EngineCollector(Collector):
    """Reads an EngineStats snapshot (and, from a service, its RocketMQ endpoints' counters) on each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], lateness: Callable[[], LatenessBuckets],
                 endpoints: Callable[[], Mapping[str, object]] | None = None) -> None:
        """`endpoints`: a dict with `ingest` and `delivery` counter dicts and `circuit_open`, if any."""
        self._stats = stats
        self._lateness = lateness
        self._endpoints = endpoints

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families."""
        st = self._stats()
        for key, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"timewheel_{key}", doc, value=float(getattr(st.counters, key)))
        yield CounterMetricFamily("timewheel_storage_corrupt_origin_rows", "Origin sidecar rows found failing their "
                                  "CRC32C (read as lost: a standby holds their records until it holds the lease).",
                                  value=float(st.storage_corrupt_origin_rows))
        yield CounterMetricFamily("timewheel_storage_origin_rows_lost", "Origin sidecar rows written as lost since "
                                  "the start (an OS crash took them, or the sidecar was cut or deleted): their records "
                                  "stay stored; a standby holds them until it holds the lease.",
                                  value=float(st.storage_origin_rows_lost))
        yield from _shaping_families(st.shaping or {})
        ep = self._endpoints() if self._endpoints is not None else {}
        for sub, prefix in (("ingest", "timewheel_ingest"), ("delivery", "timewheel_delivery"), ("ha", "timewheel_ha"),
                            ("dedupe", "timewheel_dedupe")):
            counters = ep.get(sub)
            for key, value in (counters.items() if isinstance(counters, Mapping) else ()):
                if isinstance(value, (int, float)):
                    yield CounterMetricFamily(f"{prefix}_{key}", f"{sub}: {key}", value=float(value))
        for key, doc in (("wheel_entries", "Entries held by the in-memory wheel."),
                         ("wheel_bytes", "Bytes held by the wheel's arrays."),
                         ("ready", "Due messages waiting for a sender."),
                         ("backlog", "Overdue messages of past segments waiting (catch-up)."),
                         ("retrying", "Messages waiting for their next attempt."),
                         ("storage_corrupt_records", "Corrupt records the store has found on reads."),
                         ("tombstones", "Cancels held for messages that may still arrive."),
                         ("cancels_held", "Cancels of loaded segments the dispatch queue remembers until the "
                                          "segment is done.")):
            yield GaugeMetricFamily(f"timewheel_{key}", doc, value=float(getattr(st, key)))
        if "ha_holder" in ep:
            yield GaugeMetricFamily("timewheel_ha_holder", "1 while this replica holds its shard's lease and may send.",
                                    value=float(bool(ep["ha_holder"])))
        if "serving" in ep:
            yield GaugeMetricFamily("timewheel_serving", "1 while /readyz answers 200 (its 503 says why not).",
                                    value=float(bool(ep["serving"])))
        if "circuit_open" in ep:
            yield GaugeMetricFamily("timewheel_circuit_open", "1 while sends to the broker are held back.",
                                    value=float(bool(ep["circuit_open"])))
        clock = ep.get("broker_clock")
        offset = clock.get("offset_ms") if isinstance(clock, Mapping) else None
        if isinstance(offset, int):  # measured: sends are held while it is over the bound
            yield GaugeMetricFamily("timewheel_broker_clock_offset_ms", "This host's clock minus the broker's it is "
                                    "most ahead of, in ms, as last measured (sends are held while it is over "
                                    "rocketmq.max_clock_ahead_ms).", value=float(offset))
        meta = GaugeMetricFamily("timewheel_meta_store_memory_bytes", "The meta store's memory by kind: block cache "
                                 "(bounded by RocksDB's default capacity), memtables, table readers.", labels=["kind"])
        for kind, n in st.meta_store_bytes.items():
            meta.add_metric([kind], float(n))
        yield meta
        pending = GaugeMetricFamily("timewheel_pending", "Outstanding messages of each loaded segment.",
                                    labels=["segment"])
        for seg, n in st.loaded_segments.items():
            pending.add_metric([seg], float(n))
        yield pending
        yield _lateness_family(self._lateness(), "timewheel_lateness_seconds", "Send time minus due time.")


def service_registry(stats: Callable[[], EngineStats], lateness: Callable[[], LatenessBuckets],
                     endpoints: Callable[[], Mapping[str, object]], pauses: GcPauses) -> CollectorRegistry:
    """The registry a service's admin endpoint exports: the engine's families (`EngineCollector`) and the
    garbage collector's pauses."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats, lateness, endpoints))
    registry.register(GcPausesCollector(pauses))
    return registry


class GcPausesCollector(Collector):
    """The garbage collector's pauses by generation, and the objects frozen out of its sight."""

    def __init__(self, pauses: GcPauses) -> None:
        """`pauses`: installed by the service while it runs."""
        self._pauses = pauses

    def collect(self) -> Iterable[Metric]:
        """Yield the metric families."""
        count = CounterMetricFamily("timewheel_gc_pauses", "Garbage collections, by generation; each one stops "
                                    "every Python thread of the engine while it runs.", labels=["generation"])
        seconds = CounterMetricFamily("timewheel_gc_pause_seconds", "Time spent in garbage collections, by generation.",
                                      labels=["generation"])
        longest = GaugeMetricFamily("timewheel_gc_pause_longest_seconds",
                                    "The longest garbage collection since the start, by generation.",
                                    labels=["generation"])
        for g, p in enumerate(self._pauses.snapshot()):
            count.add_metric([str(g)], float(p.collections))
            seconds.add_metric([str(g)], p.seconds)
            longest.add_metric([str(g)], p.longest_seconds)
        yield from (count, seconds, longest)
        yield GaugeMetricFamily("timewheel_gc_frozen_objects", "Objects of the start moved out of the garbage "
                                "collector's full passes (`timewheel serve` freezes them once started).",
                                value=float(self._pauses.frozen))


def _lateness_family(buckets: LatenessBuckets, name: str, doc: str) -> HistogramMetricFamily:
    """A Prometheus histogram in seconds."""
    rows = [("+Inf" if b == float("inf") else f"{b:g}", c) for b, c in buckets.cumulative()]
    return HistogramMetricFamily(name, doc, buckets=rows, sum_value=buckets.sum_ms / 1000)


_SHAPING_COUNTERS = {
    "granted": "Messages the traffic shaper let go.",
    "released": "Messages granted, then given back untaken (their tokens returned).",
    "sent": "Messages sent after shaping.",
    "failed": "Sends that failed after shaping (they back their topic off).",
    "throttled": "Messages held back at least once by a rate limit, the global cap or a backoff.",
    "backoffs": "Times a topic's rate was cut after failed sends.",
}
_SHAPING_GAUGES = {
    "backed_off_topics": "Topics sending below their normal rate after failed sends.",
    "waiting": "Due messages waiting for the traffic shaper.",
    "global_rate": "Global cap in messages per second (0: none).",
    "topics_tracked": "Topics the traffic shaper holds state for (an idle topic's goes after a minute).",
    "topics_not_listed": "Topics left out of the per-topic shaping series (at most 100 are: those a rule names "
                         "or backed off first, then the most waiting, then the most recently used).",
}


def _shaping_families(sh: Mapping[str, object]) -> Iterable[Metric]:
    """Traffic shaping: totals, and per class and per listed topic (lateness it caused, throttling); the
    shaper lists a bounded number of topics, so the topic label's values stay bounded."""
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
