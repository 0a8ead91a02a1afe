"""Lateness of deliveries: an HdrHistogram for percentiles and fixed buckets for Prometheus.

Both are filled a batch at a time by the dispatcher (`LatenessRecorder` counts a few sends' values
at once); neither calls anything per message.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from hdrh.histogram import HdrHistogram

from timewheel._arrays import FEW, counts

#: upper bounds (seconds) of the lateness histogram's buckets
LATENESS_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      300.0)


class LatenessBuckets:
    """Cumulative-ready bucket counts of lateness, filled a batch at a time (no per-message call)."""

    def __init__(self, bounds_s: Iterable[float] = LATENESS_BUCKETS_S) -> None:
        self.bounds_ms = np.asarray([b * 1000 for b in bounds_s])
        self._bounds = self.bounds_ms.tolist()
        self.counts = np.zeros(len(self.bounds_ms) + 1, np.int64)  # the last one is +Inf
        self.sum_ms = 0.0

    def observe_counts(self, values_ms: list[int], n: list[int]) -> None:
        """Count distinct lateness values (ms), each `n` times (a few values: no array work)."""
        bounds = self._bounds
        for v, c in zip(values_ms, n):
            self.counts[bisect.bisect_left(bounds, v)] += c
            self.sum_ms += v * c

    def observe(self, lateness_ms: np.ndarray) -> None:
        """Count a batch of lateness values (ms)."""
        if len(lateness_ms):
            idx = np.searchsorted(self.bounds_ms, lateness_ms, side="left")
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum_ms += float(lateness_ms.sum())

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound in seconds, cumulative count) per bucket, +Inf last."""
        cum = np.cumsum(self.counts)
        return [(b / 1000, int(c)) for b, c in zip(self.bounds_ms, cum[:-1])] + [(float("inf"), int(cum[-1]))]


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


@dataclass(frozen=True, slots=True)
class LatenessSummary:
    """Percentiles of send time minus due time, in ms, and how many sends they cover."""

    p50: float = 0.0
    p99: float = 0.0
    p999: float = 0.0
    max: float = 0.0
    count: int = 0


class LatenessRecorder:
    """The engine's lateness: an HdrHistogram (µs, ms resolution) and Prometheus buckets, filled together.

    A send's values are kept as they come and counted `_PENDING_MAX` at a time, or when either is
    read: recording one value costs the histogram's Python a few µs, more than a send of one message
    spends on anything else of its own."""

    def __init__(self) -> None:
        self._histogram = HdrHistogram(1, LATENESS_MAX_US, 3)
        self._buckets = LatenessBuckets()
        self._lock = threading.Lock()  # several dispatch threads record
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    @property
    def histogram(self) -> HdrHistogram:
        """Every value observed so far, in µs."""
        self.flush()
        return self._histogram

    @property
    def buckets(self) -> LatenessBuckets:
        """Every value observed so far, in Prometheus buckets."""
        self.flush()
        return self._buckets

    def observe(self, lateness_ms: np.ndarray) -> None:
        """Count a batch of lateness values (ms, non-negative ints); the array is kept, not copied."""
        with self._lock:
            self._pending.append(lateness_ms)
            self._pending_n += len(lateness_ms)
            if self._pending_n >= _PENDING_MAX:
                self._count_pending()

    def flush(self) -> None:
        """Count the values kept so far."""
        with self._lock:
            self._count_pending()

    def _count_pending(self) -> None:
        if not self._pending:
            return
        values = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        self._pending, self._pending_n = [], 0
        distinct, n = _distinct(values)
        self._buckets.observe_counts(distinct, n)
        record = self._histogram.record_value
        for v, c in zip(distinct, n):
            # the histogram drops what it cannot hold without a word: a week's lateness counts as its most
            record(min(v * 1000, LATENESS_MAX_US), c)

    def summary(self) -> LatenessSummary:
        """p50/p99/p999/max so far; the percentiles are read off the lock: a scrape must not hold up
        the dispatchers longer than counting what they kept."""
        h = self.histogram
        p50, p99, p999 = hdr_percentiles(h, (50, 99, 99.9))
        return LatenessSummary(p50 / 1000, p99 / 1000, p999 / 1000, h.get_max_value() / 1000, h.get_total_count())


#: the most lateness the percentiles tell apart (µs): 30 days; more is counted as that much
LATENESS_MAX_US = 30 * 86_400 * 1_000_000
#: lateness values kept before they are counted (`LatenessRecorder`)
_PENDING_MAX = 4096
#: lateness below this many ms is counted with one bincount (a send batch's values lie close together)
_BINCOUNT_BELOW = 1 << 16


def _distinct(values: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct values of non-negative ints, ascending, and how often each occurs: one bincount
    when they are small (the usual lateness), not a sort."""
    if len(values) <= FEW:
        pairs = counts(values)
        return [v for v, _ in pairs], [c for _, c in pairs]
    lo = int(values.min())
    if int(values.max()) - lo < _BINCOUNT_BELOW:
        bins = np.bincount(values - lo if lo else values)
        nz = np.flatnonzero(bins)
        return (nz + lo).tolist(), bins[nz].tolist()
    distinct, n = np.unique(values, return_counts=True)
    return distinct.tolist(), n.tolist()
