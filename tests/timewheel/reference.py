"""A trivially correct wheel over heapq, with TimeWheel's API: the oracle for its tests.

As Kafka's MockTimer is for its TimingWheel: no slots, no buckets, just a priority queue of
(due, insertion sequence, ref), plus the same time, cursor and horizon arithmetic, written out
once more in the plainest way.
"""

from __future__ import annotations

import heapq
import itertools
import sys

import numpy as np

from timewheel.wheel import ADDED, BEYOND, EXPIRED


class ReferenceWheel:
    """TimeWheel's behaviour over a heap of Python tuples (slow, obviously right)."""

    def __init__(self, tick_ms: int = 500, slots: int = 16384, start_ms: int = 0) -> None:
        """Create an empty wheel whose time is start_ms."""
        self.tick_ms = tick_ms
        self.slots = slots
        self.time_ms = start_ms  # first millisecond not yet released
        self._heap: list[tuple[int, int, int]] = []
        self._seq = itertools.count()

    @property
    def cursor_ms(self) -> int:
        """Start of the slot holding time_ms."""
        return self.time_ms // self.tick_ms * self.tick_ms

    @property
    def horizon_ms(self) -> int:
        """Entries due at or after this are BEYOND."""
        return self.cursor_ms + self.slots * self.tick_ms

    @property
    def nbytes(self) -> int:
        """Bytes of the heap and its tuples (Python objects, unlike TimeWheel)."""
        return sys.getsizeof(self._heap) + sum(
            sys.getsizeof(e) + sum(sys.getsizeof(x) for x in e) for e in self._heap
        )

    def __len__(self) -> int:
        """Number of entries held."""
        return len(self._heap)

    def add(self, due_ms: np.ndarray, refs: np.ndarray) -> np.ndarray:
        """Hold entries due in [time_ms, horizon_ms); return a status per entry."""
        status = []
        for due, ref in zip(np.asarray(due_ms).tolist(), np.asarray(refs).tolist(), strict=True):
            if due < self.time_ms:
                status.append(EXPIRED)
            elif due >= self.horizon_ms:
                status.append(BEYOND)
            else:
                heapq.heappush(self._heap, (due, next(self._seq), ref))
                status.append(ADDED)
        return np.array(status, dtype=np.uint8)

    def pop_due(self, now_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """Remove and return every entry due by now_ms, by due then insertion order."""
        out = []
        if now_ms >= self.time_ms:
            self.time_ms = now_ms + 1
            while self._heap and self._heap[0][0] <= now_ms:
                out.append(heapq.heappop(self._heap))
        return (
            np.array([e[0] for e in out], dtype=np.int64),
            np.array([e[2] for e in out], dtype=np.uint64),
        )

    def next_due_ms(self) -> int | None:
        """Earliest due time held, or None."""
        return self._heap[0][0] if self._heap else None

    def remove(self, refs: np.ndarray) -> int:
        """Remove every entry whose ref is in refs; return how many."""
        gone = set(np.asarray(refs).tolist())
        kept = [e for e in self._heap if e[2] not in gone]
        removed = len(self._heap) - len(kept)
        heapq.heapify(kept)
        self._heap = kept
        return removed
