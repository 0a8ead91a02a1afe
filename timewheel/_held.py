"""Due messages once read from disk: a batch with its aligned arrays, and the shaper's held queues.

A batch carries its messages in one of two forms: `Message` objects (a sink with only
`send_batch`), or the records' stored bytes (`storage.RecordBytes`, for a sink with
`send_records`: no Python object per message on the hot path). `messages` materialises the
objects on demand, for the rare paths (dead letters) and for sinks that need them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from storage import RecordBytes
from timewheel._due import DueEntries
from timewheel.message import Message


@dataclass(slots=True)
class Batch:
    """Due messages read for sending, with their arrays aligned: where each lives and its tries."""

    _messages: list[Message] | None
    due: np.ndarray
    refs: np.ndarray
    attempts: np.ndarray
    segs: np.ndarray
    parts: np.ndarray
    offsets: np.ndarray
    #: the records as stored (every row good), instead of `Message` objects
    raw: RecordBytes | None = None
    #: each row's target topic (kept for the shaper's queues and its accounting)
    topics: list[str] | None = None

    def __len__(self) -> int:
        return len(self.due)

    @property
    def messages(self) -> list[Message]:
        """The messages as objects (decoded from the stored bytes on first use when raw)."""
        if self._messages is None:
            raw = self.raw
            assert raw is not None
            self._messages = [Message.from_record(raw.record(i), a + 1)
                              for i, a in zip(range(len(raw)), self.attempts.tolist())]
        return self._messages

    def entries(self) -> DueEntries:
        """The rows as due entries (to queue them again, location and all)."""
        return DueEntries(self.due, self.refs, self.attempts, self.segs, self.parts, self.offsets)

    def topic_list(self) -> list[str]:
        """Each row's target topic."""
        if self.topics is None:
            self.topics = self.raw.topics() if self.raw is not None else [m.topic for m in self.messages]
        return self.topics

    def select(self, mask: np.ndarray) -> "Batch":
        """The sub-batch where mask is True (or at the indices given)."""
        idx = np.flatnonzero(mask) if mask.dtype == bool else mask
        rows = idx.tolist() if self._messages is not None or self.topics is not None else []
        return Batch([self._messages[i] for i in rows] if self._messages is not None else None, self.due[idx],
                     self.refs[idx], self.attempts[idx], self.segs[idx], self.parts[idx], self.offsets[idx],
                     self.raw.select(idx) if self.raw is not None else None,
                     [self.topics[i] for i in rows] if self.topics is not None else None)

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        """One batch of the rows of several, in order (record bytes are compacted, not shared)."""
        if len(batches) == 1:
            return batches[0]
        raw = None
        if all(b.raw is not None for b in batches):
            raw = RecordBytes.concat([b.raw for b in batches])  # type: ignore[misc]
            messages = None
        else:
            messages = [m for b in batches for m in b.messages]
        topics = [t for b in batches for t in b.topic_list()]
        return Batch(messages, np.concatenate([b.due for b in batches]), np.concatenate([b.refs for b in batches]),
                     np.concatenate([b.attempts for b in batches]), np.concatenate([b.segs for b in batches]),
                     np.concatenate([b.parts for b in batches]), np.concatenate([b.offsets for b in batches]),
                     raw, topics)


class HeldQueues:
    """Due messages the shaper holds back: a FIFO per topic (they are due, so already read); a topic
    whose queue empties leaves none behind (producers may name a new topic per message)."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[tuple[Batch, int, int]]] = {}  # topic -> (batch, row, held since)
        self.size = 0

    def add(self, b: Batch, now: int) -> None:
        """Hold every message of a batch under its topic, from `now`."""
        for i, topic in enumerate(b.topic_list()):
            self.queues.setdefault(topic, deque()).append((b, i, now))
        self.size += len(b)

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
            if q is not None and not q:
                del self.queues[topic]
        if not rows:
            return None, np.empty(0)
        self.size -= len(rows)
        by_batch: dict[int, tuple[Batch, list[int], list[int]]] = {}
        for b, i, since in rows:
            entry = by_batch.setdefault(id(b), (b, [], []))
            entry[1].append(i)
            entry[2].append(since)
        parts = [b.select(np.asarray(idx, np.int64)) for b, idx, _ in by_batch.values()]
        held_since = np.array([s for _, _, since in by_batch.values() for s in since], np.int64)
        return Batch.concat(parts), held_since

    def take_refs(self, refs: np.ndarray) -> DueEntries | None:
        """Take out the messages held whose refs are among `refs`, wherever they wait (None: none is)."""
        if not self.size:
            return None
        batches = {id(b): b for q in self.queues.values() for b, _, _ in q}
        hits = {key: named for key, b in batches.items() if (named := np.isin(b.refs, refs)).any()}
        if not hits:
            return None
        rows: dict[int, list[int]] = {}
        for topic, q in list(self.queues.items()):
            kept: deque[tuple[Batch, int, int]] = deque()
            for b, i, since in q:
                m = hits.get(id(b))
                if m is not None and m[i]:
                    rows.setdefault(id(b), []).append(i)
                else:
                    kept.append((b, i, since))
            if kept:
                self.queues[topic] = kept
            else:
                del self.queues[topic]
        if not rows:  # the rows named left already (granted): only others of their batches are held
            return None
        self.size -= sum(map(len, rows.values()))
        return DueEntries.concat([batches[key].entries().select(np.asarray(idx, np.int64)) for key, idx in rows.items()])
