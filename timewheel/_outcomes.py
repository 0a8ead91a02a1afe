"""What a dispatcher writes once a send is settled: outcomes in the dispatch log, retries, dead letters.

Every outcome of a send goes to its segment's dispatch log (`record`); the terminal ones are counted
for the timer through the queue. A failed attempt (`fail`) is recorded RETRIED with its error and
queued again with exponential backoff and jitter, or, after `max_attempts`, handed to the dead-letter
sink and recorded DEAD_LETTERED; if the dead-letter sink fails too, it keeps retrying (never lost).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np

from storage import DEAD_LETTERED, RETRIED, ScheduleStore, dispatch_entries
from timewheel._arrays import by_note, error_notes, groups
from timewheel._held import Batch
from timewheel.config import EngineConfig
from timewheel.dispatch_queue import DispatchQueue
from timewheel.errors import NotSendingNowError
from timewheel.failure_log import RepeatedFailureLog
from timewheel.message import DeadLetterSink

_MAX_ATTEMPTS_COUNTED = int(np.iinfo(np.int16).max)
log = logging.getLogger("timewheel.dispatcher")


@dataclass
class DispatchCounters:
    """What the dispatcher counted (mutable, under its lock)."""

    delivered: int = 0
    dead_lettered: int = 0
    retries: int = 0
    corrupt: int = 0
    send_failures: int = 0
    dispatch_log_errors: int = 0
    timer_thread_passes: int = 0  # dispatch passes the timer's thread ran itself (`Dispatcher.send_if_idle`)


class Outcomes:
    """Records a dispatcher's outcomes, and retries or dead-letters what failed."""

    def __init__(self, config: EngineConfig, store: ScheduleStore, queue: DispatchQueue, counters: DispatchCounters,
                 lock: threading.Lock, dead_letter_sink: DeadLetterSink | None, seed: int | None) -> None:
        """`counters` are counted under `lock` (the dispatcher's, shared)."""
        self._config = config
        self._store = store
        self._queue = queue
        self._counters = counters
        self._lock = lock
        self.dead_letter_sink = dead_letter_sink
        self._rng = np.random.default_rng(seed)
        # a dead-letter path that stays down fails every retry of every batch: its traceback once a minute
        self._dead_letter_failures = RepeatedFailureLog(log, level=logging.ERROR)

    def fail(self, bad: Batch, now: int, errors: list[str | None] | None = None) -> None:
        """Queue failed messages for another attempt with backoff, or dead-letter them after the last;
        each failed attempt is recorded with its error (`errors`, aligned, when the sink said)."""
        # int64 here, saturated when queued: a message the dead-letter path keeps refusing retries for
        # as long as it takes, and its count must not wrap around int16 meanwhile
        tries = bad.attempts.astype(np.int64) + 1
        final = tries >= self._config.max_attempts
        with self._lock:
            self._counters.send_failures += len(bad.due)
        why = error_notes(errors, len(bad.due))
        if final.any():
            dead = bad.select(final)
            reason = f"not delivered after {self._config.max_attempts} attempts"
            if self.dead_letter_sink is not None:
                try:
                    self.dead_letter_sink.dead_letter(dead.messages, reason)
                    if (run := self._dead_letter_failures.end()) is not None:
                        log.info("the dead-letter sink takes messages again after %d failed over %.0f s", *run)
                except Exception as e:  # the dead-letter path is down too: keep retrying instead of losing it
                    if isinstance(e, NotSendingNowError):  # intended: kept for another attempt; no traceback to read
                        log.warning("dead-letter sink: %s", e)
                    else:
                        self._dead_letter_failures.failed(e, "dead-letter sink failed; the messages stay in the "
                                                          "retry queue")
                    also = f"; dead letter failed too: {type(e).__name__}: {e}"  # only theirs: the rest were not due one
                    why = [f"{w}{also}" if last else w for w, last in zip(why, final.tolist())]
                    final[:] = False
            if final.any():
                for note, rows in by_note([why[i] for i in np.flatnonzero(final).tolist()]):
                    self.record(dead.select(rows), now, DEAD_LETTERED, tries[final][rows],
                                 note=f"{reason}; last error: {note}")
                with self._lock:
                    self._counters.dead_lettered += int(final.sum())
        retry = ~final
        if retry.any():
            t = tries[retry].astype(np.int64)
            backoff = np.minimum(self._config.retry_base_ms * (2 ** np.minimum(t - 1, 30)), self._config.retry_max_ms)
            with self._lock:
                jitter = self._rng.uniform(0.8, 1.2, len(t))  # one draw for the batch: a broker down retries many
                self._counters.retries += int(retry.sum())
            again = bad.select(retry)
            for note, rows in by_note([why[i] for i in np.flatnonzero(retry).tolist()]):
                self.record(again.select(rows), now, RETRIED, tries[retry][rows], note=note, terminal=False)
            self._queue.retry(now + (backoff * jitter).astype(np.int64), again.entries()._replace(
                attempts=np.minimum(tries[retry], _MAX_ATTEMPTS_COUNTED).astype(np.int16)))

    def record(self, b: Batch, now: int, outcome: int, attempts: np.ndarray, answers: np.ndarray | None = None,
                note: str = "", terminal: bool = True) -> None:
        """Write outcomes (attempts and the broker's `answers` aligned with the batch, one `note` for
        all) to each segment's dispatch log; terminal ones are counted for the timer (through the queue)."""
        for seg, m in groups(b.segs):
            parts = b.parts[m]
            self._store.record_dispatch(seg, dispatch_entries(parts, b.offsets[m], b.due[m], now, outcome,
                                                             attempts[m]), now,
                                       answers[m] if answers is not None else None, note)
            if terminal:
                self._queue.count_done(seg, len(parts))
