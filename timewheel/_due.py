"""Array queues of due entries: no Python object per message, only chunks of parallel arrays.

An entry carries everything a sender needs to read its record: due time, wheel ref, attempts so
far, and its location (segment, part, offset), resolved by the timer when it pushes the entry.
`DueChunks` holds entries in the order they were pushed (the timer pushes one small chunk a tick,
catch-up a whole segment sorted by due time); `RetryArrays` holds failed sends until their next
attempt (by one clock: `timewheel._retry_waits` keeps two, for backoffs and for due times);
`earliest` picks the earliest few by due time. Nothing locks: the owner does (the dispatch queue,
or the timer for its deferred list).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

EMPTY_I64 = np.empty(0, np.int64)
EMPTY_U64 = np.empty(0, np.uint64)
EMPTY_I16 = np.empty(0, np.int16)
EMPTY_U16 = np.empty(0, np.uint16)
EMPTY_U32 = np.empty(0, np.uint32)


class DueEntries(NamedTuple):
    """Due entries as aligned arrays: due ms, refs, attempts so far, and where each record lives."""

    due: np.ndarray  # int64
    refs: np.ndarray  # uint64
    attempts: np.ndarray  # int16
    segs: np.ndarray  # int64, segment start ms
    parts: np.ndarray  # uint16
    offsets: np.ndarray  # uint32

    @property
    def size(self) -> int:
        """How many entries."""
        return len(self.due)

    def select(self, idx: np.ndarray | slice) -> "DueEntries":
        """The entries at `idx` (a mask, indices or a slice)."""
        return DueEntries(self.due[idx], self.refs[idx], self.attempts[idx], self.segs[idx], self.parts[idx],
                          self.offsets[idx])

    @staticmethod
    def concat(parts: list["DueEntries"]) -> "DueEntries":
        """The entries of several, in order."""
        if len(parts) == 1:
            return parts[0]
        return DueEntries(*(np.concatenate(cols) for cols in zip(*parts)))

    @staticmethod
    def empty() -> "DueEntries":
        """No entries."""
        return DueEntries(EMPTY_I64, EMPTY_U64, EMPTY_I16, EMPTY_I64, EMPTY_U16, EMPTY_U32)


class DueChunks:
    """Due entries in push order, as chunks of `DueEntries`."""

    def __init__(self) -> None:
        self.chunks: deque[DueEntries] = deque()
        self.size = 0

    def push(self, entries: DueEntries) -> None:
        """Append entries."""
        if len(entries.due):
            self.chunks.append(entries)
            self.size += len(entries.due)

    def first_due(self) -> int:
        """Due time of the oldest entry (the queue must not be empty)."""
        return int(self.chunks[0].due[0])

    def take(self, n: int) -> DueEntries | None:
        """Up to n of the oldest entries, across chunks; None when empty."""
        if not self.chunks:
            return None
        parts: list[DueEntries] = []
        got = 0
        while self.chunks and got < n:
            chunk = self.chunks.popleft()
            if got + len(chunk.due) > n:
                k = n - got
                self.chunks.appendleft(chunk.select(slice(k, None)))
                chunk = chunk.select(slice(None, k))
            parts.append(chunk)
            got += len(chunk.due)
        self.size -= got
        return DueEntries.concat(parts)

    def take_all(self) -> DueEntries | None:
        """Every entry, oldest first; None when empty."""
        return self.take(self.size) if self.size else None


class RetryArrays:
    """Failed sends waiting for their next attempt: parallel arrays, no object per message.

    Kept as chunks in the order they were added, each with its earliest next attempt and due
    time: in a broker outage hundreds of thousands wait here, and adding a failed batch to one
    array copied them all (2.4 ms with 600,000 waiting, for each failed send). Up to `_MAX_CHUNKS`
    are kept before they are merged into one, so an add costs a fraction of that, amortised."""

    _MAX_CHUNKS = 64

    def __init__(self) -> None:
        self._chunks: list[tuple[np.ndarray, DueEntries]] = []  # (next attempt ms, entries), in add order
        self._next_min: list[int] = []  # per chunk
        self._due_min: list[int] = []  # per chunk
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def next_ms(self) -> np.ndarray:
        """When each waiting entry is tried next (aligned with `entries`)."""
        self._merge()
        return self._chunks[0][0] if self._chunks else EMPTY_I64

    @property
    def entries(self) -> DueEntries:
        """The entries waiting, in the order they were added."""
        self._merge()
        return self._chunks[0][1] if self._chunks else DueEntries.empty()

    @property
    def due(self) -> np.ndarray:
        """Due times of the entries waiting."""
        return self.entries.due

    def due_min(self) -> int | None:
        """The earliest due time waiting, or None."""
        return min(self._due_min) if self._due_min else None

    def add(self, next_ms: np.ndarray, entries: DueEntries) -> None:
        """Queue entries for another attempt at `next_ms`."""
        if not len(next_ms):
            return
        self._append(next_ms, entries)
        if len(self._chunks) > self._MAX_CHUNKS:
            self._merge()

    def _append(self, next_ms: np.ndarray, entries: DueEntries, minima: tuple[int, int] | None = None) -> None:
        """Add a chunk (`minima`: its earliest next attempt and due time, when already known)."""
        self._chunks.append((next_ms, entries))
        next_min, due_min = minima if minima is not None else (int(next_ms.min()), int(entries.due.min()))
        self._next_min.append(next_min)
        self._due_min.append(due_min)
        self._n += len(next_ms)

    def _merge(self) -> None:
        if len(self._chunks) < 2:
            return
        chunks, minima = self._chunks, (min(self._next_min), min(self._due_min))
        self._chunks, self._next_min, self._due_min, self._n = [], [], [], 0
        self._append(np.concatenate([c[0] for c in chunks]), DueEntries.concat([c[1] for c in chunks]), minima)

    def pop_ready(self, now_ms: int) -> DueEntries | None:
        """Remove and return the entries whose next attempt is due by `now_ms` (None: none)."""
        if not self._n or min(self._next_min) > now_ms:
            return None
        out: list[DueEntries] = []
        chunks = list(zip(self._chunks, self._next_min, self._due_min))
        self._chunks, self._next_min, self._due_min, self._n = [], [], [], 0
        for (next_ms, entries), next_min, due_min in chunks:
            if next_min > now_ms:  # nothing of it is ready: kept as it is, its minima too
                self._append(next_ms, entries, (next_min, due_min))
                continue
            sel = next_ms <= now_ms
            out.append(entries.select(sel))
            if not sel.all():
                keep = ~sel
                self._append(next_ms[keep], entries.select(keep))
        # oldest due first: what a replica held while it could not send goes out in due order
        ready = DueEntries.concat(out)
        return ready.select(np.argsort(ready.due, kind="stable"))

    def next_ms_min(self) -> int | None:
        """When the next attempt is due, or None."""
        return min(self._next_min) if self._next_min else None


def earliest(e: DueEntries, limit: int) -> tuple[int | None, DueEntries]:
    """The `limit` earliest of `e` by due time, and the earliest due time of the rest (None: no rest).

    A partition, not a sort: in an outage hundreds of thousands wait, and only the `limit` earliest
    are named. Which of several equal to the next one are set apart does not matter: that one bounds
    the mark, so none of them passes it.
    """
    due = e.due
    if len(due) > limit:
        part = np.argpartition(due, limit)
        rest: int | None = int(due[part[limit]])
        first = part[:limit]
        first = first[np.argsort(due[first], kind="stable")]
    else:
        rest, first = None, np.argsort(due, kind="stable")
    return rest, e.select(first)


def earliest_apart(waiting: list[DueEntries], retrying: DueEntries | None, limit: int,
                   stragglers_before_ms: int | None) -> tuple[int | None, DueEntries]:
    """`DispatchQueue.earliest_due_apart` over its chunks `waiting` (ready, backlog, in hand) and the
    entries `retrying` (None: none): the earliest due time of everything not set apart, and up to
    `limit` of the earliest entries set apart (those retrying and, with `stragglers_before_ms`, those
    waiting that were due before it), by due time."""
    mins: list[int] = []
    candidates: list[DueEntries] = []
    for e in waiting:
        if not len(e.due):
            continue
        if stragglers_before_ms is None:
            mins.append(int(e.due.min()))
            continue
        late = e.due < stragglers_before_ms
        if not late.any():
            mins.append(int(e.due.min()))
            continue
        if not late.all():
            mins.append(int(e.due[~late].min()))
            e = e.select(late)
        rest, few = earliest(e, limit)  # a catch-up backlog can hold millions
        if rest is not None:
            mins.append(rest)
        candidates.append(few)
    if retrying is not None:
        rest, few = earliest(retrying, limit)
        if rest is not None:
            mins.append(rest)
        candidates.append(few)
    apart = DueEntries.concat(candidates) if candidates else DueEntries.empty()
    rest, apart = earliest(apart, limit)
    if rest is not None:
        mins.append(rest)
    return (min(mins) if mins else None), apart
