"""Lateness over the last minute, from snapshots of the engine's cumulative lateness buckets.

The engine only counts lateness since it started (`timewheel.lateness.LatenessBuckets`). A
ring of snapshots of those counts, one per `step_ms`, turns that into a sliding window: the
counts of the last minute are the counts now minus the oldest snapshot still inside the
minute. Each snapshot is one row of a numpy array (no object per message, no per-message work).

Like `timewheel/wheel.py` this is a pure data structure: it reads no clock and owns no
thread; the service samples it every few seconds and asks it on each status request.

Percentiles come from bucket counts, so they are interpolated linearly inside the bucket that
holds the rank, as Prometheus' histogram_quantile does; a rank in the +Inf bucket answers the
last finite bound.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class LatenessWindow:
    """Sliding-window bucket counts of lateness (default: the last 60 s, snapshots every 5 s)."""

    def __init__(self, bounds_ms: np.ndarray, window_ms: int = 60_000, step_ms: int = 5_000) -> None:
        if window_ms <= 0 or step_ms <= 0 or window_ms % step_ms:
            raise ValueError(f"window_ms={window_ms} must be a positive multiple of step_ms={step_ms}")
        self.bounds_ms = np.asarray(bounds_ms, np.float64)
        self.window_ms = window_ms
        self.step_ms = step_ms
        rows = window_ms // step_ms + 1  # one more than the window holds: the baseline at its start
        self._t = np.full(rows, np.iinfo(np.int64).min, np.int64)
        self._counts = np.zeros((rows, len(self.bounds_ms) + 1), np.int64)
        self._next = 0

    def sample(self, now_ms: int, counts: np.ndarray) -> bool:
        """Keep a snapshot of the cumulative `counts` unless the last one is under `step_ms` old."""
        last = int(self._t[self._next - 1])  # a Python int: the empty marker must not overflow int64
        if now_ms - last < self.step_ms:
            return False
        self._t[self._next] = now_ms
        self._counts[self._next] = counts
        self._next = (self._next + 1) % len(self._t)
        return True

    def recent(self, now_ms: int, counts: np.ndarray) -> tuple[np.ndarray, int]:
        """Bucket counts since the oldest snapshot inside the window, and how long that is (ms).

        Before any snapshot falls inside the window, the counts since the start (span 0: unknown).
        """
        inside = self._t >= now_ms - self.window_ms
        if not inside.any():
            return np.asarray(counts, np.int64).copy(), 0
        i = int(np.flatnonzero(inside)[np.argmin(self._t[inside])])
        return np.asarray(counts, np.int64) - self._counts[i], int(now_ms - self._t[i])

    def percentiles(self, counts: np.ndarray, ps: Sequence[float]) -> list[float]:
        """Lateness (ms) at percentiles `ps` of bucket `counts` (as `recent` returns); 0 when empty."""
        cum = np.cumsum(counts)
        if not len(cum) or cum[-1] <= 0:
            return [0.0] * len(ps)
        rank = np.asarray(ps, np.float64) / 100 * cum[-1]
        idx = np.minimum(np.searchsorted(cum, rank, side="left"), len(cum) - 1)
        upper = np.append(self.bounds_ms, self.bounds_ms[-1])[idx]  # +Inf answers the last finite bound
        lower = np.where(idx > 0, np.append(0.0, self.bounds_ms)[idx], 0.0)
        below = np.where(idx > 0, cum[np.maximum(idx - 1, 0)], 0)
        width = np.maximum(np.asarray(counts)[idx], 1)
        frac = np.clip((rank - below) / width, 0.0, 1.0)
        return [float(v) for v in np.where(idx < len(self.bounds_ms), lower + (upper - lower) * frac, upper)]
