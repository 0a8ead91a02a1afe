"""Array queues of due entries: no Python object per message, only chunks of parallel arrays.

`DueChunks` holds entries in the order they were pushed (the timer pushes one small chunk a tick,
catch-up a whole segment sorted by due time); `RetryArrays` holds failed sends until their next
attempt. Neither locks: their owner does (the dispatch queue, or the timer for its deferred list).
"""
from __future__ import annotations

from collections import deque

import numpy as np

EMPTY_I64 = np.empty(0, np.int64)
EMPTY_U64 = np.empty(0, np.uint64)
EMPTY_I16 = np.empty(0, np.int16)

#: (due ms, refs, attempts so far), aligned
DueArrays = tuple[np.ndarray, np.ndarray, np.ndarray]


class DueChunks:
    """Due entries in push order, as chunks of (due, refs, attempts) arrays."""

    def __init__(self) -> None:
        self.chunks: deque[DueArrays] = deque()
        self.size = 0

    def push(self, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray | None = None) -> None:
        """Append entries (attempts default to none yet)."""
        if len(due):
            self.chunks.append((due, refs, np.zeros(len(due), np.int16) if attempts is None else attempts))
            self.size += len(due)

    def first_due(self) -> int:
        """Due time of the oldest entry (the queue must not be empty)."""
        return int(self.chunks[0][0][0])

    def take(self, n: int) -> DueArrays | None:
        """Up to n of the oldest entries, across chunks; None when empty."""
        if not self.chunks:
            return None
        parts: list[DueArrays] = []
        got = 0
        while self.chunks and got < n:
            due, refs, att = self.chunks.popleft()
            if got + len(due) > n:
                k = n - got
                self.chunks.appendleft((due[k:], refs[k:], att[k:]))
                due, refs, att = due[:k], refs[:k], att[:k]
            parts.append((due, refs, att))
            got += len(due)
        self.size -= got
        if len(parts) == 1:
            return parts[0]
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]))

    def take_all(self) -> DueArrays | None:
        """Every entry, oldest first; None when empty."""
        return self.take(self.size) if self.size else None


class RetryArrays:
    """Failed sends waiting for their next attempt: parallel arrays, no object per message."""

    def __init__(self) -> None:
        self.next_ms = EMPTY_I64
        self.due = EMPTY_I64
        self.refs = EMPTY_U64
        self.attempts = EMPTY_I16

    def __len__(self) -> int:
        return len(self.due)

    def add(self, next_ms: np.ndarray, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray) -> None:
        """Queue entries for another attempt at `next_ms`."""
        self.next_ms = np.concatenate((self.next_ms, next_ms))
        self.due = np.concatenate((self.due, due))
        self.refs = np.concatenate((self.refs, refs))
        self.attempts = np.concatenate((self.attempts, attempts))

    def pop_ready(self, now_ms: int) -> DueArrays:
        """Remove and return the entries whose next attempt is due by `now_ms`."""
        sel = self.next_ms <= now_ms
        if not sel.any():
            return EMPTY_I64, EMPTY_U64, EMPTY_I16
        # oldest due first: what a replica held while it could not send goes out in due order
        order = np.argsort(self.due[sel], kind="stable")
        out = self.due[sel][order], self.refs[sel][order], self.attempts[sel][order]
        keep = ~sel
        self.next_ms, self.due, self.refs, self.attempts = (self.next_ms[keep], self.due[keep], self.refs[keep],
                                                            self.attempts[keep])
        return out

    def next_ms_min(self) -> int | None:
        """When the next attempt is due, or None."""
        return int(self.next_ms.min()) if len(self.next_ms) else None
