"""Entries waiting in the dispatch queue for a later attempt, each kind on the clock it waits by.

Two kinds wait there. A failed send (and an entry the gate holds, a failed pass put back, or one
waiting out a recovery's quiet period) waits a length: its backoff. An entry not due yet (the
timer's wheel turned past it when the wall clock went back; a record whose index gave another due
time) waits for its due time, a wall-clock instant like every due time.

Backoffs are kept on a timeline that the wall clock's steps back do not move: the wall clock plus
every step back seen so far. After a step back of an hour, a one-second backoff still ends one
second after the failure, not an hour and a second. Due times stay on the wall clock: a message
due at 12:00 waits for 12:00 however the clock stepped.

A step back is a reading earlier than the one before. The readings come under the queue's lock, so
they are in order, and one arrives at least every `MAX_WAIT_S` while a dispatch thread waits with
entries here: a step is measured short by at most the time since the last reading (with none here,
every `IDLE_WAIT_S`: a step measured short then moves no backoff, there being none). A step forward cannot be told
apart from time passing: backoffs end early by it (at once at worst), as they always did.
"""
from __future__ import annotations

import numpy as np

from timewheel._due import DueEntries, RetryArrays


class RetryWaits:
    """Backoffs on a timeline steps back do not move, holds until due on the wall clock (no lock:
    the dispatch queue's)."""

    def __init__(self, now_ms: int) -> None:
        """`now_ms`: the first wall-clock reading."""
        self._backoff = RetryArrays()  # next attempt on the steady timeline: wall clock + self._behind
        self._until_due = RetryArrays()  # next attempt at the due time, on the wall clock
        self._last_ms = now_ms
        self._behind = 0  # every step back seen so far, added up

    def __len__(self) -> int:
        return len(self._backoff) + len(self._until_due)

    def observe(self, now_ms: int) -> None:
        """A wall-clock reading, in order with the others: one earlier than the last is a step back."""
        if now_ms < self._last_ms:
            self._behind += self._last_ms - now_ms
        self._last_ms = now_ms

    def add(self, next_ms: np.ndarray, entries: DueEntries, now_ms: int) -> None:
        """Entries to be taken again at the wall-clock `next_ms`, which is `now_ms` plus their backoff;
        an entry whose next attempt is its own due time waits for that instant instead (`hold_until_due`)."""
        self.observe(now_ms)
        at_due = next_ms == entries.due
        if at_due.any():
            self._until_due.add(next_ms[at_due], entries.select(at_due))
            if at_due.all():
                return
            next_ms, entries = next_ms[~at_due], entries.select(~at_due)
        self._backoff.add(next_ms + self._behind, entries)

    def hold_until_due(self, entries: DueEntries) -> None:
        """Entries not due yet, taken from their due time on by the wall clock."""
        self._until_due.add(entries.due, entries)

    def pop_ready(self, now_ms: int) -> DueEntries | None:
        """Remove and return the entries whose wait is over at the wall-clock `now_ms`, oldest due
        first (None: none)."""
        self.observe(now_ms)
        backoff = self._backoff.pop_ready(now_ms + self._behind)
        until_due = self._until_due.pop_ready(now_ms)
        if backoff is None or until_due is None:
            return until_due if backoff is None else backoff
        ready = DueEntries.concat([backoff, until_due])
        return ready.select(np.argsort(ready.due, kind="stable"))

    def next_ms_min(self) -> int | None:
        """When, by the wall clock as last read, the next wait is over (None: nothing waits)."""
        nb, nd = self._backoff.next_ms_min(), self._until_due.next_ms_min()
        if nb is not None:
            nb -= self._behind
        return nb if nd is None else nd if nb is None else min(nb, nd)

    def ready_by(self, now_ms: int) -> bool:
        """Whether a wait is over at the wall-clock `now_ms`."""
        self.observe(now_ms)
        nr = self.next_ms_min()
        return nr is not None and nr <= now_ms

    def due_min(self) -> int | None:
        """The earliest due time waiting, or None."""
        mins = [m for m in (self._backoff.due_min(), self._until_due.due_min()) if m is not None]
        return min(mins) if mins else None

    @property
    def entries(self) -> DueEntries:
        """Every entry waiting."""
        if not len(self._until_due):
            return self._backoff.entries
        if not len(self._backoff):
            return self._until_due.entries
        return DueEntries.concat([self._backoff.entries, self._until_due.entries])
