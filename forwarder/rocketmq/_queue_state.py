"""The queues a consumer owns: each one's pull state in one place, and what was accepted below which offset.

Membership adds and releases queues here; the pull threads read and move each queue's offsets;
answers to the broker's questions read them. One lock guards the whole table, never held while
talking to a broker.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from forwarder.rocketmq.consumer_status import QueueReport

__all__ = ["Queue", "QueueState", "QueueTable"]

#: (broker name, queue id)
Queue = tuple[str, int]


@dataclass
class QueueState:
    """One owned queue's pull state: its offsets, the pull in flight, retries and decode failures."""

    offset: int  # next offset to pull
    committed: int  # last offset committed to the broker (-1: the broker must be told `offset`)
    in_flight: int | None = None  # opaque of the outstanding pull
    retry_at: float = 0.0  # monotonic time before which it is not pulled (a refused batch)
    released: bool = False  # assigned to another member: its pull thread commits and drops it
    decode_failures: int = 0  # pulls in a row at this offset whose body (or offsets) could not be read
    gap_pulls: int = 0  # pulls in a row at this offset whose messages left a gap below nextBeginOffset
    last_pull_ms: int = 0  # wall clock of the last answered pull (reported to admin tools)
    last_consume_ms: int = 0  # wall clock of the last batch accepted
    sent_ms: int = 0  # wall-clock ms when the pull in flight was sent
    caught_up_ms: int = 0  # wall-clock ms before which everything stored in the queue was accepted

    def take_commit(self) -> bool:
        """Whether the next pull carries a commit of `offset` (then counted as committed)."""
        if self.offset <= self.committed:
            return False
        self.committed = self.offset
        return True

    def accepted(self, next_offset: int, caught_up: bool) -> None:
        """The callback took the batch pulled from here: move on to `next_offset`."""
        self.offset, self.decode_failures, self.gap_pulls = next_offset, 0, 0
        self.last_consume_ms = int(time.time() * 1000)
        if caught_up:
            self.caught_up_ms = self.sent_ms  # the queue held nothing more when the pull was answered
        self.in_flight = None

    def retry_after(self, backoff_s: float) -> None:
        """Pull the same offset again, not before `backoff_s` from now."""
        self.retry_at = time.monotonic() + backoff_s
        self.in_flight = None


class QueueTable:
    """The queues this member owns (one `QueueState` each), and per queue ever consumed here the
    offset below which every message was accepted (kept after the queue moves away: what was
    stored stays stored)."""

    def __init__(self) -> None:
        """Empty: membership adds what the group allocates."""
        self.lock = threading.Lock()
        self._owned: dict[Queue, QueueState] = {}
        self._stored: dict[Queue, int] = {}
        #: every PULL_OFFSET_MOVED answer, as "<broker>:<queue id> <from> -> <to>" (a gap in what was read)
        self.offsets_moved: list[str] = []

    def owned(self) -> list[Queue]:
        """The queues consumed here now (released ones excluded)."""
        with self.lock:
            return sorted(q for q, st in self._owned.items() if not st.released)

    def get(self, q: Queue) -> QueueState | None:
        """The state of a queue owned here and not released, else None."""
        with self.lock:
            st = self._owned.get(q)
        return None if st is None or st.released else st

    def of_broker(self, broker: str) -> dict[Queue, QueueState]:
        """Every queue of `broker` held here, released ones included (their pull thread drops them)."""
        with self.lock:
            return {q: st for q, st in self._owned.items() if q[0] == broker}

    def changes(self, mine: set[Queue]) -> tuple[list[Queue], list[Queue]]:
        """(released, added): what to give up and what to take to own exactly `mine`."""
        with self.lock:
            released = [q for q, st in self._owned.items() if q not in mine and not st.released]
            added = [q for q in mine if q not in self._owned or self._owned[q].released]
        return released, added

    def add(self, q: Queue, offset: int) -> None:
        """Own `q`, pulling from `offset` (the group's committed offset, or the queue's first)."""
        self.accepted_below(q, offset)
        with self.lock:
            self._owned[q] = QueueState(offset, offset)

    def release(self, queues: list[Queue]) -> None:
        """Mark queues as moved to another member: their pull thread commits and drops them."""
        with self.lock:
            for q in queues:
                self._owned[q].released = True

    def drop(self, q: Queue, st: QueueState) -> None:
        """Forget a released queue, unless it was taken again meanwhile (a new state)."""
        with self.lock:
            if self._owned.get(q) is st:
                del self._owned[q]

    def take_all(self) -> dict[Queue, QueueState]:
        """Every queue held, now owned here no longer (the consumer stops)."""
        with self.lock:
            owned, self._owned = self._owned, {}
        return owned

    def reset(self, offsets: dict[Queue, int]) -> int:
        """Pull each named queue owned here from the given offset next, and commit it; how many moved."""
        moved = 0
        with self.lock:
            for q, offset in offsets.items():
                st = self._owned.get(q)
                if st is None or st.released:
                    continue
                # A new state: the answer to a pull still in flight for the old offset is dropped.
                self._owned[q] = QueueState(offset, -1)
                moved += 1
        return moved

    def accepted_below(self, q: Queue, offset: int) -> None:
        """Every message of `q` below `offset` was accepted by the callback."""
        with self.lock:
            if offset > self._stored.get(q, -1):
                self._stored[q] = offset

    def stored_offsets(self) -> dict[str, int]:
        """Per queue (`broker:queue id`), the offset below which every message was accepted."""
        with self.lock:
            return {f"{b}:{qid}": o for (b, qid), o in self._stored.items()}

    def caught_up_ms(self) -> int | None:
        """The earliest wall-clock ms before which each owned queue was read to its end (None: none owned)."""
        with self.lock:
            marks = [st.caught_up_ms for st in self._owned.values() if not st.released]
        return min(marks) if marks else None

    def reports(self, topic: str) -> list[QueueReport]:
        """Each owned queue's offsets and times, as admin tools ask for them."""
        with self.lock:
            return [QueueReport(topic, q[0], q[1], st.offset, max(st.committed, 0), st.last_pull_ms,
                                st.last_consume_ms) for q, st in self._owned.items() if not st.released]
