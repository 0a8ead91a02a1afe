"""Due messages once read from disk: a batch with its aligned arrays, and the shaper's held queues."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from timewheel.message import Message


@dataclass(slots=True)
class Batch:
    """Due messages read for sending, with their arrays aligned: where each lives and its tries."""

    messages: list[Message]
    due: np.ndarray
    refs: np.ndarray
    attempts: np.ndarray
    segs: np.ndarray
    parts: np.ndarray
    offsets: np.ndarray

    def select(self, mask: np.ndarray) -> "Batch":
        """The sub-batch where mask is True."""
        idx = np.flatnonzero(mask)
        return Batch([self.messages[i] for i in idx.tolist()] if self.messages else [], self.due[idx],
                     self.refs[idx], self.attempts[idx], self.segs[idx], self.parts[idx], self.offsets[idx])


class HeldQueues:
    """Due messages the shaper holds back: a FIFO per topic (they are due, so already read)."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[tuple[Batch, int, int]]] = {}  # topic -> (batch, row, held since)
        self.size = 0

    def add(self, b: Batch, now: int) -> None:
        """Hold every message of a batch under its topic, from `now`."""
        for i, m in enumerate(b.messages):
            self.queues.setdefault(m.topic, deque()).append((b, i, now))
        self.size += len(b.messages)

    def earliest_due(self) -> int | None:
        """Earliest due time of the messages held (None: none)."""
        firsts = [int(min(b.due[i] for b, i, _ in q)) for q in self.queues.values() if q]
        return min(firsts) if firsts else None

    def sizes(self) -> dict[str, int]:
        """Messages held per topic (topics holding none left out)."""
        return {t: len(q) for t, q in self.queues.items() if q}

    def take(self, grants: dict[str, int], limit: int) -> tuple[Batch | None, np.ndarray]:
        """Up to `limit` messages as granted per topic, oldest first; and since when each was held."""
        rows: list[tuple[Batch, int, int]] = []
        for topic, n in grants.items():
            q = self.queues.get(topic)
            while q and n > 0 and len(rows) < limit:
                rows.append(q.popleft())
                n -= 1
        if not rows:
            return None, np.empty(0)
        self.size -= len(rows)
        idx = [r[1] for r in rows]
        src = [r[0] for r in rows]
        out = Batch([b.messages[i] for b, i in zip(src, idx)],
                    np.array([b.due[i] for b, i in zip(src, idx)], np.int64),
                    np.array([b.refs[i] for b, i in zip(src, idx)], np.uint64),
                    np.array([b.attempts[i] for b, i in zip(src, idx)], np.int16),
                    np.array([b.segs[i] for b, i in zip(src, idx)], np.int64),
                    np.array([b.parts[i] for b, i in zip(src, idx)], np.uint16),
                    np.array([b.offsets[i] for b, i in zip(src, idx)], np.uint32))
        return out, np.array([r[2] for r in rows], np.int64)
