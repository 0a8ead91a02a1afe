"""The engine: a facade over a timer driver and a dispatcher that meet at one queue.

    schedule() ─► ScheduleStore ─commit listener─► TimerDriver ─push, nudge─► DispatchQueue
                                                  (wheel, loader)                   │
                                                                  await_turn, take  ▼
                 dispatch log ◄─ outcomes ─ Dispatcher (held queues, Sink, retries, dead letters)

Threads, when started in the background, and what each owns:
- the caller's threads run `schedule()` and `cancel()`: the store appends (its own write lock) and
  calls the timer's commit listener, which only appends to the timer's inbound list;
- the timer thread (`timewheel-timer`, `TimerDriver`) owns the clock reads, the wheel, the
  `SegmentLoader`, catch-up of past segments and cancels' removals from the wheel: it pops what is
  due at the exact millisecond into the `DispatchQueue` and nudges it; at a low rate, when no
  dispatch thread is sending, it runs the dispatcher's pass for what it popped itself
  (`Dispatcher.send_if_idle`, handed to it as a callable: it still reads no dispatcher state);
- the dispatch threads (`timewheel-dispatch-N`, `Dispatcher`; as many as the sink's
  `max_in_flight`, default one, of which more than one sends only while a full batch waits) own the shaper's held queues, the Sink calls, backoff (failed
  entries wait in the queue for their next attempt), dead letters, outcome records and lateness;
- the housekeeping thread (`timewheel-housekeeping`, `Housekeeper`) checkpoints the store and
  retires old segments.

Thread-safety rule: the timer and the dispatchers share only the `DispatchQueue`, which has its own
Condition and holds the dispatch policy (linger, wait for the send in flight unless a full batch
waits or 20 ms went by). The timer never reads a dispatcher's state, and a dispatcher never calls
into the timer: each entry carries its record's location from the timer, and the terminal outcomes
a dispatcher recorded go back as counts per segment through the queue (`count_done`), which the
timer takes on its own thread (`take_done`). Locks are taken in one order: timer, dispatcher, queue
(the timer takes the dispatcher's only through `Dispatcher.release_held`, handed to it as a
callable: a late cancel on a standby moves what the shaper holds back to the queue); the queue calls
out to nobody but the timer's wake-up event.

`start(background=False)` starts no thread: `step()` runs one timer pass and then dispatch passes
until nothing is left, on the caller's thread, for tests driven by a ManualClock.
"""
from __future__ import annotations

import logging
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from hdrh.histogram import HdrHistogram

from storage import (AppendResult, DelayTooLongError, EncodedRecords, InvalidRecordError, Origin,
                     ScheduleStore, TombstoneLog)
from timewheel._admission import check_rows, encode_messages, validate
from timewheel._cancel_stored import cancel_stored
from timewheel.cancels import CancelRequest, Tombstones
from timewheel.clock import Clock, SystemClock
from timewheel.config import EngineConfig
from timewheel._due import DueEntries
from timewheel.dispatch_queue import DispatchQueue
from timewheel.dispatcher import DispatchCounters, Dispatcher
from timewheel.errors import EngineStateError, InvalidMessageError
from timewheel.gate import DeliveredMark, DeliveryGate
from timewheel.housekeeping import Housekeeper
from timewheel.lateness import LatenessBuckets, LatenessRecorder
from timewheel._recovery import Recovery
from timewheel.message import CopyFinder, DeadLetterSink, Message, Shaper, Sink
from timewheel.stats import EngineCounters, EngineStats
from timewheel.timer import TimerDriver
from timewheel.watermark import Watermarks

log = logging.getLogger("timewheel.engine")


@dataclass(slots=True)
class _Running:
    """The parts of a started engine."""

    store: ScheduleStore
    queue: DispatchQueue
    timer: TimerDriver
    dispatcher: Dispatcher
    housekeeper: Housekeeper
    background: bool
    tombstones: Tombstones
    watermarks: Watermarks


class Engine:
    """Stores delayed messages and sends each to its Sink at its due millisecond."""

    def __init__(self, config: EngineConfig, sink: Sink, clock: Clock | None = None,
                 dead_letter_sink: DeadLetterSink | None = None, *, shaper: Shaper | None = None,
                 seed: int | None = None, gate: DeliveryGate | None = None,
                 copy_finder: CopyFinder | None = None) -> None:
        """`gate`: when this engine is one replica of a shard, what lets it send (`timewheel.gate`);
        `copy_finder`: look up what a crash or takeover left ambiguous before sending it again."""
        self.config = config
        self.gate = gate
        self.copy_finder = copy_finder
        self.recovery: Recovery | None = None
        self.sink = sink
        self.shaper = shaper
        self.clock: Clock = clock or SystemClock()
        self.store: ScheduleStore | None = None
        self._dead_letter_sink = dead_letter_sink
        self._seed = seed
        self._lateness = LatenessRecorder()
        self._lock = threading.Lock()  # the API's counters
        self._scheduled = 0
        self._duplicates = 0
        self._cancelled = 0
        self._cancel_requests = 0
        self._cancels_applied = 0
        self._cancelled_on_arrival = 0
        self._cancel_lock = threading.Lock()  # one cancel at a time: each records a record's outcome once
        # totals of the dispatcher and the timer, kept when the engine stops and starts again
        self._dispatch_counters = DispatchCounters()
        self._catch_up_segments_before = 0
        self._evicted_before = 0  # tombstones evicted by earlier runs of this engine
        self._run: _Running | None = None

    @property
    def dead_letter_sink(self) -> DeadLetterSink | None:
        """Where messages go after their last failed attempt (None: they are recorded dead-lettered)."""
        return self._dead_letter_sink

    @dead_letter_sink.setter
    def dead_letter_sink(self, sink: DeadLetterSink | None) -> None:
        self._dead_letter_sink = sink
        if self._run is not None:
            self._run.dispatcher.dead_letter_sink = sink

    @property
    def lateness(self) -> HdrHistogram:
        """Send time minus due time of every delivery, in µs (ms resolution)."""
        return self._lateness.histogram

    @property
    def lateness_buckets(self) -> LatenessBuckets:
        """The same lateness, in Prometheus buckets."""
        return self._lateness.buckets

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self, *, background: bool = True) -> "Engine":
        """Open the store (recovering it), queue past segments for catch-up, and start the threads.

        With background=False no thread is started: the caller drives the engine with `step()`.
        """
        if self._run is not None:
            raise EngineStateError("the engine is already started")
        cfg = self.config
        store = ScheduleStore(cfg.data_dir, segment_minutes=cfg.segment_minutes, flush=cfg.flush,
                              max_delay_ms=cfg.max_delay_ms, meta_cache_bytes=cfg.meta_cache_mb << 20)
        try:  # the store holds descriptors nothing else would close if the rest fails to start
            for f in store.recovery.findings:
                log.warning("recovery: %s", f)
            timer_wake = threading.Event()  # the queue sets it when the catch-up backlog has room
            queue = DispatchQueue(self.clock, batch_size=cfg.send_batch_size, catch_up_chunk=cfg.catch_up_chunk,
                                  linger_ms=int(getattr(self.sink, "linger_ms", 0)),
                                  linger_max_ms=getattr(self.sink, "linger_max_ms", None), wake_timer=timer_wake.set)
            if self.copy_finder is not None:
                self.recovery = Recovery(self.copy_finder, store.meta, self.clock.now_ms())
            dispatcher = Dispatcher(cfg, store, queue, self.sink, self.clock, self._lateness, shaper=self.shaper,
                                    dead_letter_sink=self._dead_letter_sink, seed=self._seed,
                                    counters=self._dispatch_counters, gate=self.gate, recovery=self.recovery)
            timer = TimerDriver(cfg, store, self.clock, queue, timer_wake, send_now=dispatcher.send_if_idle,
                                release_held=dispatcher.release_held)
            tombstones = Tombstones(TombstoneLog(cfg.data_dir, sync=cfg.flush == "sync"), cfg.tombstone_retention_ms,
                                    cfg.max_tombstones)
            tombstones.load(self.clock.now_ms())
        except BaseException:
            store.close()
            raise
        self.store = store
        self._run = _Running(store, queue, timer, dispatcher, Housekeeper(cfg, store, self.clock, tombstones,
                                                                                 timer.catch_up_again),
                             background, tombstones, Watermarks(timer, queue, dispatcher, store))
        if background:
            # Releasing at the due millisecond needs the timer thread to get the GIL within a
            # millisecond; Python's default switch interval (5 ms) would make it wait behind the
            # dispatch thread and the RocketMQ client's callbacks. This is process-wide.
            if sys.getswitchinterval() > 0.001:
                sys.setswitchinterval(0.0005)
            timer.start()
            dispatcher.start(max(1, int(getattr(self.sink, "max_in_flight", 1))))
            self._run.housekeeper.start()
        return self

    def stop(self) -> None:
        """Stop the threads (sends in progress finish and are recorded), checkpoint and close the store."""
        run = self._run
        if run is None:
            return
        if run.background:
            run.queue.close()
            run.timer.stop()
            run.dispatcher.join()
            run.housekeeper.stop()
        try:
            run.store.close()  # a failed last checkpoint is raised: its ingest log is replayed at the next start
        finally:
            run.tombstones.close()
            self._catch_up_segments_before += run.timer.catch_up_segments
            self._evicted_before += run.tombstones.evicted
            self._run = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the API --------------------------------------------------------------------------------

    def schedule(self, messages: Sequence[Message], origins: Sequence[Origin] | None = None) -> list[str]:
        """Store messages durably (under the flush policy) and return their ids.

        `origins`, aligned with `messages`: where each came from on the delay topic, `(queue name,
        offset)` (replica sets decide by it what the lease holder had stored; docs/HA.md).

        Ids are generated where a message has none; a repeated id is stored once; a message a
        tombstone cancels (a cancel that came first) is accepted and not stored. Raises
        InvalidMessageError (nothing stored) if any message breaks the contract.
        """
        run = self._require_started()
        now = self.clock.now_ms()
        ids = []
        records = []
        for i, m in enumerate(messages):
            self._validate(m, i, now)
            mid = m.msg_id or uuid.uuid4().hex
            ids.append(mid)
            records.append(m.to_record(mid))

        def append(cancelled: list[int]) -> AppendResult | None:
            recs, origs = records, origins
            if cancelled:
                gone = set(cancelled)
                recs = [r for i, r in enumerate(records) if i not in gone]
                origs = [o for i, o in enumerate(origins) if i not in gone] if origins is not None else None
            return run.store.append(recs, now, origs) if recs else None

        self._store_screened(run, ids, [m.msg_id for m in messages], [m.keys for m in messages], now, append)
        return ids

    def encode_messages(self, messages: Sequence[Message], origins: Sequence[Origin] | None = None
                        ) -> tuple[EncodedRecords, list[InvalidMessageError | None]]:
        """The records `schedule` would store for `messages`, encoded now, for `schedule_encoded`
        (beside rows encoded elsewhere, in one commit); per message, why it is refused, or None."""
        self._require_started()
        return encode_messages(messages, origins, self.clock.now_ms(), self.config)

    def schedule_encoded(self, rows: EncodedRecords) -> list[str]:
        """`schedule` for records already encoded (`storage.EncodedRecords`: ingest's one pass over
        a pull answer, `encode_messages`): the engine's limits checked on the columns, tombstones
        screened, one store commit, the same counters. Raises InvalidMessageError with the first
        offending row's index (nothing stored)."""
        run = self._require_started()
        now = self.clock.now_ms()
        check_rows(rows, now, self.config)

        def append(cancelled: list[int]) -> AppendResult | None:
            kept = rows.without(cancelled) if cancelled else rows
            return run.store.append_encoded(kept, now) if len(kept) else None

        self._store_screened(run, rows.msg_ids, rows.msg_ids, rows.keys, now, append)
        return list(rows.msg_ids)

    def _store_screened(self, run: _Running, ids: Sequence[str], named: Sequence[str | None],
                        keys: Sequence[Sequence[str]], now: int,
                        append: Callable[[list[int]], AppendResult | None]) -> None:
        """Store rows (ids, the ids they were named by, their keys) less what a tombstone cancels:
        `append` gets the positions cancelled. Counts them, and cancels what a cancel that came
        meanwhile names."""
        tombstones = run.tombstones
        generation = tombstones.generation
        cancelled = tombstones.screen_rows(named, keys, now)
        try:
            result = append(cancelled)
        except (DelayTooLongError, InvalidRecordError) as e:
            raise InvalidMessageError(str(e)) from e
        fresh = int(result.new.sum()) if result is not None else 0
        with self._lock:
            self._scheduled += fresh
            self._duplicates += len(ids) - len(cancelled) - fresh
            self._cancelled_on_arrival += len(cancelled)
        if cancelled:
            # A copy an earlier try of this batch stored, which a cancel that came meanwhile names
            # (the check below cancelled it, or failed to, and the batch came back): cancelled now.
            meta, again = run.store.meta, [ids[i] for i in cancelled]
            for mid, known in zip(again, meta.known(again)):
                if known and not meta.is_cancelled(mid):
                    self.cancel(msg_id=mid)
        if tombstones.generation != generation:
            # a cancel arrived while these were screened and stored: it may have looked for them
            # before they were in the store, so they are checked again now that they are
            late = tombstones.screen_rows(named, keys, now)
            for i in late:
                self.cancel(msg_id=ids[i])

    def apply_cancels(self, requests: Sequence[CancelRequest]) -> int:
        """Apply cancels that came as control messages: each is kept as a tombstone (on disk
        before this returns) for messages that arrive later, and cancels what is stored now.

        Idempotent: a cancel seen again (it is sent to every queue) costs a look-up and changes
        nothing. Returns how many stored messages were cancelled.
        """
        run = self._require_started()
        now = self.clock.now_ms()
        # Held first, so that a message stored meanwhile is either screened out or found below;
        # saved last, so that a tombstone on disk always means its cancel was applied.
        todo = run.tombstones.add(requests, now)
        with self._lock:
            self._cancel_requests += len(requests)
            self._cancels_applied += len(todo)
        with self._cancel_lock:  # one batch: one dispatch-log frame per segment, however many cancels
            cancelled = self._cancel_locked(run, [(r.msg_id, r.key) for r in todo]) if todo else 0
        run.tombstones.save(now, todo)  # only these: each was applied whole just now
        return cancelled

    def _validate(self, m: Message, i: int, now: int) -> None:
        validate(m, i, now, self.config)

    def cancel(self, msg_id: str | None = None, key: str | None = None) -> int:
        """Cancel a message by id, or every message under a business key; returns how many.

        Honoured for messages not yet due (at least one tick ahead is guaranteed); a message already
        due, delivered or cancelled is not counted.
        """
        run = self._require_started()
        if (msg_id is None) == (key is None):
            raise ValueError("give exactly one of msg_id or key")
        with self._cancel_lock:
            return self._cancel_locked(run, [(msg_id, key)])

    def _cancel_locked(self, run: _Running, named: Sequence[tuple[str | None, str | None]]) -> int:
        """Cancel what each (msg_id, key) names, one dispatch-log frame per segment; how many were cancelled."""
        gate = self.gate
        return cancel_stored(run.store, run.timer, self.clock, named,
                             lambda: gate is not None and not gate.may_send(), self._count_cancelled)

    def _count_cancelled(self, n: int) -> None:
        with self._lock:
            self._cancelled += n

    def dead_threads(self) -> list[str]:
        """Names of the engine's threads that ended while it runs (an error escaped their loop).

        Empty while healthy; an engine with a dead thread delivers nothing more of what that thread
        owned, so the service reports itself not ready and exits for its supervisor to restart it
        (nothing acknowledged is lost: it is all in the store).
        """
        run = self._run
        if run is None or not run.background:
            return []
        threads = [*run.timer.threads(), *run.dispatcher.threads(), *run.housekeeper.threads()]
        return [t.name for t in threads if not t.is_alive()]

    def thread_failures(self) -> dict[str, str]:
        """Of the threads `dead_threads` names, the error that ended each (`Type: message`)."""
        run = self._run
        if run is None:
            return {}
        return {**run.timer.failures, **run.dispatcher.failures, **run.housekeeper.failures}

    def checkpoint_failure(self) -> str | None:
        """Why the last checkpoint failed (None while they succeed): the service is not ready meanwhile."""
        run = self._run
        return run.housekeeper.failure if run is not None else None

    def stats(self) -> EngineStats:
        """Counters, queue sizes, memory and lateness percentiles (ms) of this engine since it started."""
        with self._lock:
            scheduled, duplicates, cancelled = self._scheduled, self._duplicates, self._cancelled
            cancel_requests, applied = self._cancel_requests, self._cancels_applied
            on_arrival = self._cancelled_on_arrival
        run = self._run
        c = run.dispatcher.counts() if run is not None else self._dispatch_counters  # no thread counts then
        catch_up_segments = self._catch_up_segments_before + (run.timer.catch_up_segments if run is not None else 0)
        evicted = self._evicted_before + (run.tombstones.evicted if run is not None else 0)
        counters = EngineCounters(scheduled, duplicates, c.delivered, cancelled, c.dead_lettered, c.retries, c.corrupt,
                                  c.send_failures, catch_up_segments, c.dispatch_log_errors, cancel_requests,
                                  applied, on_arrival, evicted, c.timer_thread_passes)
        if run is None:
            return EngineStats(counters, lateness_ms=self._lateness.summary())
        ready, backlog, retrying = run.queue.sizes()
        catch_up, wheel_entries, wheel_bytes, loaded = run.timer.snapshot()
        return EngineStats(counters, ready, backlog, retrying, catch_up, run.dispatcher.held_size(),
                           run.store.corrupt_records_found, self.shaper.stats() if self.shaper else None,
                           wheel_entries, wheel_bytes, loaded, self._lateness.summary(), len(run.tombstones),
                           run.queue.cancelled_held(), run.store.meta.memory_bytes(),
                           run.store.origins.corrupt_rows,
                           run.store.recovery.origin_rows_lost + run.store.writer.origin_rows_lost)

    def delivered_up_to(self) -> int:
        """Every message due at or before this (epoch ms) has its outcome recorded: the watermark a
        replica holding the shard's lease publishes (-1 before the first timer pass)."""
        run = self._require_started()
        return run.watermarks.up_to()

    def delivered_up_to_except(self, limit: int) -> DeliveredMark:
        """`delivered_up_to` passing up to `limit` entries waiting for a retry, listed by origin: what
        a replica holding the shard's lease publishes (`timewheel.watermark`; `frozen` once delivery failed)."""
        run = self._require_started()

        def origins_of(entries: DueEntries) -> list[tuple[str, int] | None]:
            rows = run.store.read_origins(entries.segs, entries.parts, entries.offsets)
            names = run.store.queues.names()
            return [(names[q], int(o)) if 0 <= q < len(names) else None
                    for q, o in zip(rows["queue"].tolist(), rows["offset"].tolist())]

        return run.watermarks.up_to_except(limit, origins_of)

    # ---- driving by hand ------------------------------------------------------------------------

    def step(self) -> int:
        """One pass at the clock's current time: timer work, then dispatch everything due.

        For tests driven by a ManualClock (start(background=False)); returns messages handled.
        """
        run = self._require_started()
        run.timer.run_pass(self.clock.now_ms())
        sent = 0
        while n := run.dispatcher.dispatch_pass():
            sent += n
        return sent

    def next_wakeup_ms(self) -> int | None:
        """The next time something is due (wheel, sends, retries, shaper grants, preload, segment end)."""
        run = self._require_started()
        now = self.clock.now_ms()
        timer = run.timer.next_wakeup_ms(now)
        dispatch = run.dispatcher.next_wakeup_ms(now)
        return max(now, timer if dispatch is None else min(timer, dispatch))

    def _require_started(self) -> _Running:
        if self._run is None:
            raise EngineStateError("the engine is not started: call start() first")
        return self._run
