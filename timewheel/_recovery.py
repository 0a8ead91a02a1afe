"""The due entries a crash, a takeover or a failed send left ambiguous, looked up before they are sent again.

Delivery records an outcome only once the broker answered, so an entry can lack a record although
its target already holds a copy:
- after a crash between a send and its record: the entries due at or before what the previous run
  had handed to its sink. That bound (`SENT_MARK`) is persisted in the meta store before a send
  moves it, a second ahead each time, so it costs a write a second, not one per send;
- after a takeover: what the previous holder may have sent, due up to the takeover (the gate
  records what is due by its watermark; `DeliveryGate.took_over_ms`), widened by the clock skew;
- after a failed send: a timed-out request may still have been stored, so every entry with an
  attempt spent.

Such an entry waits out a quiet period after the restart or takeover (a dead predecessor's last
writes land; its end moves back with a step back of the clock, which would otherwise lengthen the
wait by the step), then the `CopyFinder` looks it up on its target: one found is recorded delivered,
with where the copy is and a note, and not sent; one the finder cannot tell about (a broker
unreachable) counts a failed attempt, so it waits with backoff and is dead-lettered after the last
(waiting, never guessing); only the missing ones are sent.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from storage import RecordBytes
from timewheel._due import DueEntries
from timewheel._held import Batch
from timewheel._ref_set import RefSet
from timewheel.message import CopyCheck, CopyFinder

__all__ = ["FOUND_NOTE", "SENT_MARK", "Recovery", "RecoveryCounters"]

#: the dispatch-log note of an entry found already stored on its target
FOUND_NOTE = "a copy was already stored on the target (found by a look-up after a restart, takeover or failed send): not sent again"

#: meta-store document: entries due at or before it may have been handed to the sink by an earlier run
SENT_MARK = "dispatch.sent_up_to"
_MARK_STEP_MS = 1000
#: a reading this far behind the latest is a step back of the clock; less is dispatch threads whose
#: readings arrive out of order, which must not shorten the quiet period
_STEP_BACK_MS = 1000


class _Documents(Protocol):
    def get_document(self, name: str) -> Any | None: ...

    def put_document(self, name: str, value: Any) -> None: ...


@dataclass
class RecoveryCounters:
    """What the look-ups before sending again did, since this engine started."""

    episodes: int = 0  # restarts after sends and takeovers that left entries to resolve
    looked_up: int = 0
    found: int = 0  # already stored on the target: recorded delivered, not sent again
    missing: int = 0  # no broker holds it: sent
    unknown: int = 0  # some broker could not say: an attempt counted, looked up again later
    held_quiet: int = 0  # entries that waited for the quiet period
    resolve_ms_max: int = 0  # the slowest look-up call (barrier included)
    resolve_ms_total: int = 0


class Recovery:
    """Which entries are ambiguous, and their look-up (thread-safe: every dispatch thread asks)."""

    def __init__(self, finder: CopyFinder, documents: _Documents, now_ms: int) -> None:
        """Read the previous run's sent mark from `documents` (the meta store)."""
        self.finder = finder
        self._documents = documents
        mark = documents.get_document(SENT_MARK)
        self.horizon_ms = int(mark) if isinstance(mark, int) else -1
        self._persisted = self.horizon_ms
        self.quiet_until_ms = now_ms + finder.quiet_ms if self.horizon_ms >= 0 else 0
        self._latest_ms = now_ms  # the latest clock reading seen since the last step back
        self._took_over_seen = 0
        self._lock = threading.Lock()
        # episode entries a look-up found missing: this run sends them, so a later attempt's copy is its own
        self._sent_here = RefSet()
        self.counters = RecoveryCounters(episodes=1 if self.horizon_ms >= 0 else 0)

    def observe_takeover(self, took_over_ms: int) -> None:
        """This replica became the holder at `took_over_ms`: what is due up to then may have copies."""
        if not took_over_ms or took_over_ms == self._took_over_seen:
            return
        with self._lock:
            self._took_over_seen = took_over_ms
            self.horizon_ms = max(self.horizon_ms, took_over_ms + self.finder.clock_skew_ms)
            self.quiet_until_ms = max(self.quiet_until_ms, took_over_ms + self.finder.quiet_ms)
            self.counters.episodes += 1

    def ambiguous(self, due: np.ndarray, attempts: np.ndarray) -> np.ndarray:
        """Per entry, whether its target may hold a copy already."""
        return (due <= self.horizon_ms) | (attempts > 0)

    def note_sending(self, due: np.ndarray) -> None:
        """Before a send: persist that entries up to its latest due time may have copies."""
        top = int(due.max())
        if top <= self._persisted:
            return
        with self._lock:
            if top > self._persisted:
                mark = top + _MARK_STEP_MS
                self._documents.put_document(SENT_MARK, mark)
                self._persisted = mark

    def _follow_steps_back(self, now_ms: int) -> None:
        """Move the quiet period's end back with a step back of the clock (an hour back would make
        ambiguous entries wait an hour more); a step forward ends it early, as it ends any wait."""
        with self._lock:
            if now_ms < self._latest_ms - _STEP_BACK_MS:
                self.quiet_until_ms = max(0, self.quiet_until_ms - (self._latest_ms - now_ms))
                self._latest_ms = now_ms
            else:
                self._latest_ms = max(self._latest_ms, now_ms)

    def note_quiet(self, n: int) -> None:
        """`n` entries were put back to wait for the quiet period."""
        with self._lock:
            self.counters.held_quiet += n

    def check(self, records: RecordBytes, due: np.ndarray, attempts: np.ndarray, now_ms: int,
              refs: np.ndarray | None = None) -> CopyCheck:
        """Look the ambiguous `records` (wheel `refs`, when known) up (after the quiet period); counted."""
        # a copy is sent at or after its due time by some replica's clock
        sent_from = int(due.min()) - self.finder.clock_skew_ms
        episode = due <= self.horizon_ms
        with self._lock:
            sent_here = episode if refs is None else episode & self._sent_here.contains(refs)
        # episode entries were written before the quiet period ended, unless this run sent them too; a
        # retried one's last attempt may have been a moment ago, so its answer needs a barrier from now
        retried = bool(((attempts > 0) & (~episode | sent_here)).any())
        written_before = now_ms if retried else min(now_ms, self.quiet_until_ms)
        started = time.monotonic()
        out = self.finder.find_copies(records, sent_from, written_before)
        took = int((time.monotonic() - started) * 1000)
        found = np.asarray(out.found, bool)
        unknown = np.asarray(out.unknown, bool) & ~found
        if len(found) != len(records) or len(unknown) != len(records):
            raise RuntimeError(f"the copy finder answered {len(found)} rows for {len(records)} records")
        with self._lock:
            if refs is not None:
                self._sent_here.add(refs[episode & ~found & ~unknown])
            c = self.counters
            c.looked_up += len(records)
            c.found += int(found.sum())
            c.unknown += int(unknown.sum())
            c.missing += int((~found & ~unknown).sum())
            c.resolve_ms_max = max(c.resolve_ms_max, took)
            c.resolve_ms_total += took
        return CopyCheck(found, unknown, out.answers, out.errors)

    def resolve(self, b: Batch, now_ms: int, wait: Callable[[np.ndarray, DueEntries], None],
                found: Callable[[Batch, np.ndarray | None], None],
                unknown: Callable[[Batch, list[str | None] | None], None]) -> np.ndarray:
        """The rows of `b` (stored bytes) to send now. Ambiguous rows wait for the quiet period
        (`wait`: the queue's retry), or are looked up: those `found` are the caller's to record
        delivered (with the copies' answers), the `unknown` ones to fail an attempt."""
        amb = self.ambiguous(b.due, b.attempts)
        if not amb.any():
            return ~amb
        assert b.raw is not None
        a = b.select(amb)
        keep = ~amb
        self._follow_steps_back(now_ms)
        if now_ms < self.quiet_until_ms:
            wait(np.full(len(a), self.quiet_until_ms, np.int64), a.entries())
            self.note_quiet(len(a))
            return keep
        assert a.raw is not None
        check = self.check(a.raw, a.due, a.attempts, now_ms, a.refs)
        if check.found.any():
            found(a.select(check.found), None if check.answers is None else check.answers[check.found])
        if check.unknown.any():
            rows = np.flatnonzero(check.unknown).tolist()
            unknown(a.select(check.unknown), None if check.errors is None else [check.errors[i] for i in rows])
        keep[np.flatnonzero(amb)[~check.found & ~check.unknown]] = True
        return keep

    def snapshot(self) -> dict[str, int]:
        """The counters, with the horizon and the end of the quiet period (epoch ms)."""
        with self._lock:
            c = self.counters
            return {"episodes": c.episodes, "looked_up": c.looked_up, "found": c.found, "missing": c.missing,
                    "unknown": c.unknown, "held_quiet": c.held_quiet, "resolve_ms_max": c.resolve_ms_max,
                    "resolve_ms_total": c.resolve_ms_total, "horizon_ms": self.horizon_ms,
                    "quiet_until_ms": self.quiet_until_ms}
