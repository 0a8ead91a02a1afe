"""The engine: wires the store, the disk tier, the wheel and a Sink.

Two threads when started in the background:
- the timer thread owns the wheel and the loader: it takes newly stored records, loads the current
  segment and preloads the next one, drains past segments (catch-up), and pops what is due at the
  exact millisecond into the ready queue;
- the dispatch thread reads due records, sends them through the Sink in batches, records outcomes
  in the dispatch log, and retries failures with backoff until they go to the dead-letter path;
  a Sink with `max_in_flight` > 1 gets that many dispatch threads, sending side by side when a
  full batch or a catch-up backlog is waiting (a few messages wait for the send in flight instead);
  a Sink with `linger_ms` lets a small batch wait that long after its oldest was due for company.
`step()` runs one pass of both on the caller's thread, for tests driven by a ManualClock.
"""
from __future__ import annotations

import logging
import random
import sys
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from hdrh.histogram import HdrHistogram

from storage import (CANCELLED, CORRUPT, DEAD_LETTERED, DELIVERED, CorruptRecordError, DelayTooLongError,
                     InvalidRecordError, ScheduleStore, StorageWriteError, dispatch_entries)
from timewheel._arrays import counts, groups
from timewheel.clock import Clock, SystemClock
from timewheel.config import EngineConfig
from timewheel.errors import EngineStateError, InvalidMessageError
from timewheel.loader import SegmentLoader
from timewheel.message import DeadLetterSink, Message, Shaper, Sink
from timewheel.lateness import LatenessBuckets, hdr_percentiles
from timewheel.wheel import BEYOND, EXPIRED, TimeWheel

log = logging.getLogger("timewheel.engine")
_EMPTY_I64 = np.empty(0, np.int64)
_EMPTY_U64 = np.empty(0, np.uint64)
_MAX_HELD = 200_000  # due messages read and held by the shaper before the rest wait as arrays
_MAX_WAIT_S = 0.05  # the timer thread's longest sleep: new work it was not woken for waits this long
_INBOUND_WAKE_MS = 2 * int(_MAX_WAIT_S * 1000)
# Due messages wait at most this long for the send in flight before going in a send of their own.
_BESIDE_AFTER_MS = 20


class _Due:
    """Due entries waiting for dispatch, as chunks of (due, refs, attempts) arrays."""

    def __init__(self) -> None:
        self.chunks: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque()
        self.size = 0

    def push(self, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray | None = None) -> None:
        if len(due):
            self.chunks.append((due, refs, np.zeros(len(due), np.int16) if attempts is None else attempts))
            self.size += len(due)

    def first_due(self) -> int:
        """Due time of the oldest entry (the queue must not be empty)."""
        return int(self.chunks[0][0][0])

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Up to n of the oldest entries, across chunks (the timer pushes one small chunk a tick)."""
        if not self.chunks:
            return None
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
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


class _Retries:
    """Failed sends waiting for their next attempt: parallel arrays, no object per message."""

    def __init__(self) -> None:
        self.next_ms = _EMPTY_I64
        self.due = _EMPTY_I64
        self.refs = _EMPTY_U64
        self.attempts = np.empty(0, np.int16)

    def __len__(self) -> int:
        return len(self.due)

    def add(self, next_ms: np.ndarray, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray) -> None:
        self.next_ms = np.concatenate((self.next_ms, next_ms))
        self.due = np.concatenate((self.due, due))
        self.refs = np.concatenate((self.refs, refs))
        self.attempts = np.concatenate((self.attempts, attempts))

    def pop_ready(self, now_ms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sel = self.next_ms <= now_ms
        if not sel.any():
            return _EMPTY_I64, _EMPTY_U64, np.empty(0, np.int16)
        out = self.due[sel], self.refs[sel], self.attempts[sel]
        keep = ~sel
        self.next_ms, self.due, self.refs, self.attempts = (self.next_ms[keep], self.due[keep], self.refs[keep],
                                                            self.attempts[keep])
        return out

    def next_ms_min(self) -> int | None:
        return int(self.next_ms.min()) if len(self.next_ms) else None


@dataclass(slots=True)
class _Batch:
    """Due messages read for sending, with their arrays aligned: where each lives and its tries."""

    messages: list[Message]
    due: np.ndarray
    refs: np.ndarray
    attempts: np.ndarray
    segs: np.ndarray
    parts: np.ndarray
    offsets: np.ndarray

    def select(self, mask: np.ndarray) -> "_Batch":
        """The sub-batch where mask is True."""
        idx = np.flatnonzero(mask)
        return _Batch([self.messages[i] for i in idx.tolist()] if self.messages else [], self.due[idx],
                      self.refs[idx], self.attempts[idx], self.segs[idx], self.parts[idx], self.offsets[idx])


class _Held:
    """Due messages the shaper holds back: a FIFO per topic (they are due, so already read)."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[tuple[_Batch, int, int]]] = {}  # topic -> (batch, row, held since)
        self.size = 0

    def add(self, b: _Batch, now: int) -> None:
        for i, m in enumerate(b.messages):
            self.queues.setdefault(m.topic, deque()).append((b, i, now))
        self.size += len(b.messages)

    def sizes(self) -> dict[str, int]:
        return {t: len(q) for t, q in self.queues.items() if q}

    def take(self, grants: dict[str, int], limit: int) -> tuple[_Batch | None, np.ndarray]:
        """Up to `limit` messages as granted per topic, oldest first; and how long each waited."""
        rows: list[tuple[_Batch, int, int]] = []
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
        out = _Batch([b.messages[i] for b, i in zip(src, idx)],
                     np.array([b.due[i] for b, i in zip(src, idx)], np.int64),
                     np.array([b.refs[i] for b, i in zip(src, idx)], np.uint64),
                     np.array([b.attempts[i] for b, i in zip(src, idx)], np.int16),
                     np.array([b.segs[i] for b, i in zip(src, idx)], np.int64),
                     np.array([b.parts[i] for b, i in zip(src, idx)], np.uint16),
                     np.array([b.offsets[i] for b, i in zip(src, idx)], np.uint32))
        return out, np.array([r[2] for r in rows], np.int64)


class Engine:
    """Stores delayed messages and sends each to its Sink at its due millisecond."""

    def __init__(self, config: EngineConfig, sink: Sink, clock: Clock | None = None,
                 dead_letter_sink: DeadLetterSink | None = None, *, shaper: Shaper | None = None,
                 seed: int | None = None) -> None:
        self.config = config
        self.sink = sink
        self.shaper = shaper
        self._held = _Held()
        self.dead_letter_sink = dead_letter_sink
        self.clock: Clock = clock or SystemClock()
        self._rng = random.Random(seed)
        self.store: ScheduleStore | None = None
        self._loader: SegmentLoader | None = None
        self._wheel: TimeWheel | None = None
        self._lock = threading.Lock()  # guards inbound, ready/backlog, cancels, counters
        self._wake_timer = threading.Event()
        self._stopping = threading.Event()
        # New records arrive from the store's commit (under its write lock, so in offset order):
        # this lock guards only the inbound list and is never held while taking another lock.
        self._inbound_lock = threading.Lock()
        self._dispatch_cv = threading.Condition(self._lock)
        self._lingering = False  # a dispatch thread waits for a small batch to fill (sink linger)
        self._passes = 0  # dispatch passes (sends) in progress
        self._inbound: list[np.ndarray] = []
        self._ready = _Due()
        self._backlog = _Due()
        self._deferred = _Due()  # overdue entries of segments loaded while older ones still wait
        self._retries = _Retries()
        self._catch_up: deque[int] = deque()
        self._cancelled_refs = np.empty(0, np.uint64)
        self._pending_removals: list[np.ndarray] = []
        self._threads: list[threading.Thread] = []
        self._running = False
        self._started = False
        self._next_rescan = 0
        self._sealed_before = 0
        self.lateness = HdrHistogram(1, 3_600_000_000, 3)
        self.lateness_buckets = LatenessBuckets()
        self.counters = {k: 0 for k in ("scheduled", "duplicates", "delivered", "cancelled", "dead_lettered",
                                        "retries", "corrupt", "send_failures", "catch_up_segments",
                                        "dispatch_log_errors")}

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self, *, background: bool = True) -> "Engine":
        """Open the store (recovering it), queue past segments for catch-up, and start the threads.

        With background=False no thread is started: the caller drives the engine with `step()`.
        """
        if self._started:
            raise EngineStateError("the engine is already started")
        cfg = self.config
        self.store = ScheduleStore(cfg.data_dir, segment_minutes=cfg.segment_minutes, flush=cfg.flush,
                                   max_delay_ms=cfg.max_delay_ms)
        for f in self.store.recovery.findings:
            log.warning("recovery: %s", f)
        self._loader = SegmentLoader(self.store)
        self.store.commit_listeners.append(self._on_commit)
        now = self.clock.now_ms()
        slots = -(-(2 * cfg.segment_ms + cfg.preload_seconds * 1000) // cfg.tick_ms) + 2
        self._wheel = TimeWheel(cfg.tick_ms, slots, now)
        current = self.store.layout.segment_start(now)
        done = self.store.meta.done_segments()
        self._catch_up.extend(s for s in self.store.layout.list_segments() if s < current and s not in done)
        self._started = True
        self._running = True
        self._stopping.clear()
        if background:
            # Releasing at the due millisecond needs the timer thread to get the GIL within a
            # millisecond; Python's default switch interval (5 ms) would make it wait behind the
            # dispatch thread and the RocketMQ client's callbacks. This is process-wide.
            if sys.getswitchinterval() > 0.001:
                sys.setswitchinterval(0.0005)
            dispatchers = max(1, int(getattr(self.sink, "max_in_flight", 1)))
            self._threads = [threading.Thread(target=self._timer_loop, name="timewheel-timer", daemon=True),
                             *(threading.Thread(target=self._dispatch_loop, name=f"timewheel-dispatch-{i}", daemon=True)
                               for i in range(dispatchers)),
                             threading.Thread(target=self._housekeeping_loop, name="timewheel-housekeeping",
                                              daemon=True)]
            for t in self._threads:
                t.start()
        return self

    def stop(self) -> None:
        """Stop the threads, record what was sent, checkpoint and close the store."""
        if not self._started:
            return
        with self._lock:
            self._running = False
            self._stopping.set()
            self._wake_timer.set()
            self._dispatch_cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
        assert self.store is not None
        self.store.close()
        self._started = False

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the API --------------------------------------------------------------------------------

    def schedule(self, messages: Sequence[Message]) -> list[str]:
        """Store messages durably (under the flush policy) and return their ids.

        Ids are generated where a message has none; a repeated id is stored once. Raises
        InvalidMessageError (nothing stored) if any message breaks the contract.
        """
        store = self._require_started()
        now = self.clock.now_ms()
        ids = []
        records = []
        for i, m in enumerate(messages):
            self._validate(m, i, now)
            mid = m.msg_id or uuid.uuid4().hex
            ids.append(mid)
            records.append(m.to_record(mid))
        try:
            result = store.append(records, now)
        except DelayTooLongError as e:
            raise InvalidMessageError(str(e)) from e
        except InvalidRecordError as e:
            raise InvalidMessageError(str(e)) from e
        fresh = int(result.new.sum())
        with self._lock:
            self.counters["scheduled"] += fresh
            self.counters["duplicates"] += len(records) - fresh
        return ids

    def _on_commit(self, locations: np.ndarray) -> None:
        """Store callback, under its write lock: newly stored records, in commit order."""
        with self._inbound_lock:
            self._inbound.append(locations)
        # The timer looks at least every _MAX_WAIT_S anyway: wake it only for what falls due
        # before then, so heavy ingest of later messages does not cost a timer pass per commit.
        if int(locations["due_ms"].min()) <= self.clock.now_ms() + _INBOUND_WAKE_MS:
            self._wake_timer.set()

    def _validate(self, m: Message, i: int, now: int) -> None:
        if not isinstance(m, Message):
            raise InvalidMessageError(f"expected a timewheel.Message, got {type(m).__name__}", index=i)
        if not m.topic or not isinstance(m.topic, str):
            raise InvalidMessageError("a message needs a target topic", index=i)
        if not isinstance(m.deliver_at_ms, int) or isinstance(m.deliver_at_ms, bool) or m.deliver_at_ms < 0:
            raise InvalidMessageError(f"deliver_at_ms must be a non-negative int of epoch ms, not "
                                      f"{m.deliver_at_ms!r}", index=i)
        if m.deliver_at_ms - now > self.config.max_delay_ms:
            raise InvalidMessageError(f"due in {m.deliver_at_ms - now} ms, past the maximum delay of "
                                      f"{self.config.max_delay_ms} ms", index=i)
        if not isinstance(m.body, (bytes, bytearray)):
            raise InvalidMessageError(f"body must be bytes, not {type(m.body).__name__}", index=i)
        if len(m.body) > self.config.max_body_bytes:
            raise InvalidMessageError(f"body of {len(m.body)} bytes exceeds max_body_bytes="
                                      f"{self.config.max_body_bytes}", index=i)

    def cancel(self, msg_id: str | None = None, key: str | None = None) -> int:
        """Cancel a message by id, or every message under a business key; returns how many.

        Honoured for messages not yet due (at least one tick ahead is guaranteed); a message already
        due, delivered or cancelled is not counted.
        """
        store = self._require_started()
        if (msg_id is None) == (key is None):
            raise ValueError("give exactly one of msg_id or key")
        if msg_id is not None:
            # an id as a RocketMQ producer knows it (UNIQ_KEY) names the engine ids made from it
            ids = [msg_id] if store.meta.known([msg_id])[0] else store.meta.ids_with_prefix(msg_id + ":")
        else:
            ids = store.meta.ids_for_key(key)  # type: ignore[arg-type]
        ids = [i for i in ids if not store.meta.is_cancelled(i)]
        if not ids:
            return 0
        now = self.clock.now_ms()
        count = 0
        by_seg: dict[int, list[tuple[int, int, int]]] = {}
        taken: list[str] = []
        with self._lock:
            for mid, loc in zip(ids, store.meta.locations(ids)):
                if loc is None:
                    continue
                try:
                    rec = store.read_record(loc.segment_ms, loc.part, loc.offset)
                except CorruptRecordError:
                    continue
                if rec.due_ms <= now:
                    continue  # already due: it is being, or has been, delivered
                by_seg.setdefault(loc.segment_ms, []).append((loc.part, loc.offset, rec.due_ms))
                taken.append(mid)
            assert self._loader is not None and self._wheel is not None
            for seg, items in by_seg.items():
                arr = np.array(items, dtype=np.int64)
                store.record_dispatch(seg, dispatch_entries(arr[:, 0], arr[:, 1], arr[:, 2], now, CANCELLED, 0), now)
                count += len(items)
                if seg in self._loader.loaded:
                    refs = self._loader.refs(seg, arr[:, 0].astype(np.uint16), arr[:, 1].astype(np.uint32))
                    self._cancelled_refs = np.union1d(self._cancelled_refs, refs)
                    self._pending_removals.append(refs)
                    self._loader.note_done(np.full(len(items), seg))
            self.counters["cancelled"] += count
        self._wake_timer.set()
        store.meta.mark_cancelled(taken, now)
        return count

    def stats(self) -> dict[str, object]:
        """Counters, sizes and lateness percentiles (ms) of this engine since it started."""
        with self._lock:
            out: dict[str, object] = dict(self.counters)
            out["ready"] = self._ready.size
            out["backlog"] = self._backlog.size
            out["retrying"] = len(self._retries)
            out["catch_up_pending_segments"] = len(self._catch_up)
            out["held_by_shaping"] = self._held.size
        if self.store is not None:
            out["storage_corrupt_records"] = self.store.corrupt_records_found
        if self.shaper is not None:
            out["shaping"] = self.shaper.stats()
        if self._wheel is not None:
            out["wheel_entries"] = len(self._wheel)
            out["wheel_bytes"] = self._wheel.nbytes
        if self._loader is not None:
            out["loaded_segments"] = {str(k): v.outstanding for k, v in self._loader.loaded.items()}
        h = self.lateness  # read racily, off the lock: a scrape must not hold up the timer
        p50, p99, p999 = hdr_percentiles(h, (50, 99, 99.9))
        out["lateness_ms"] = {"p50": p50 / 1000, "p99": p99 / 1000, "p999": p999 / 1000,
                              "max": h.get_max_value() / 1000, "count": h.get_total_count()}
        return out

    # ---- driving --------------------------------------------------------------------------------

    def step(self) -> int:
        """One pass at the clock's current time: timer work, then dispatch everything due.

        For tests driven by a ManualClock (start(background=False)); returns messages sent.
        """
        self._require_started()
        now = self.clock.now_ms()
        with self._lock:
            self._timer_pass(now)
        sent = 0
        while True:
            n = self._dispatch_pass()
            if n == 0:
                return sent
            sent += n

    def next_wakeup_ms(self) -> int | None:
        """The next time something is due (wheel, retries, preload, segment end), or None."""
        with self._lock:
            return self._next_wakeup(self.clock.now_ms(), for_dispatch=True)

    # ---- timer side -----------------------------------------------------------------------------

    def _timer_loop(self) -> None:
        while True:
            self._wake_timer.clear()
            with self._lock:
                if not self._running:
                    return
                now = self.clock.now_ms()
                try:
                    self._timer_pass(now)
                except Exception:  # keep serving; the next pass retries what failed
                    log.exception("timer pass failed")
                wake = self._next_wakeup(self.clock.now_ms())
                # A small batch waits for a dispatcher lingering (it wakes at its own time) or for
                # the send in flight to end: waking a dispatcher at every due millisecond to find
                # that out only costs CPU.
                lingered = (self._lingering or self._passes) and self._ready.size < self.config.send_batch_size
                if (self._ready.size and not lingered) or self._backlog.size:
                    self._dispatch_cv.notify()
                if not self._running:
                    return
            timeout = self._seconds_until(wake)
            if timeout > 0:
                self._wake_timer.wait(timeout)

    def _seconds_until(self, wake_ms: int | None) -> float:
        """How long to wait for `wake_ms`, at most _MAX_WAIT_S (new work wakes the thread earlier)."""
        if wake_ms is None:
            return _MAX_WAIT_S
        if isinstance(self.clock, SystemClock):  # aim at the millisecond's first nanosecond
            return min(_MAX_WAIT_S, max(0.0, (wake_ms * 1_000_000 - time.time_ns()) / 1e9))
        return min(_MAX_WAIT_S, max(0.0, (wake_ms - self.clock.now_ms()) / 1000))

    def _housekeeping_loop(self) -> None:
        """Checkpoints and retention, off the timer and dispatch threads so they never stall them."""
        assert self.store is not None
        next_checkpoint = time.monotonic() + self.config.checkpoint_seconds
        while not self._stopping.is_set():
            self._stopping.wait(max(0.0, min(1.0, next_checkpoint - time.monotonic())))
            if self._stopping.is_set():
                return
            if time.monotonic() < next_checkpoint:
                continue
            next_checkpoint = time.monotonic() + self.config.checkpoint_seconds
            try:
                self.store.checkpoint()
                if self.config.retention_hours > 0:
                    self.store.retire(self.clock.now_ms(), int(self.config.retention_hours * 3_600_000))
            except Exception:
                log.exception("checkpoint failed; retrying in %ss", self.config.checkpoint_seconds)

    def _timer_pass(self, now: int) -> None:
        loader, wheel, store = self._loader, self._wheel, self.store
        assert loader is not None and wheel is not None and store is not None
        seg_ms = self.config.segment_ms
        current = now - now % seg_ms
        for seg in (current, current + seg_ms):
            if seg not in loader.loaded and (seg == current or now >= seg - self.config.preload_seconds * 1000):
                if seg in self._catch_up:
                    self._catch_up.remove(seg)
                self._add(*loader.load(seg), now)
        with self._inbound_lock:
            inbound, self._inbound = self._inbound, []
        if inbound:
            self._take_inbound(inbound, now)
        if now >= self._next_rescan:
            self._next_rescan = now + int(self.config.rescan_seconds * 1000)
            for seg in list(loader.loaded):
                self._add(*loader.refresh(seg), now)
        if self._pending_removals:
            refs = np.concatenate(self._pending_removals)
            self._pending_removals = []
            wheel.remove(refs)
        due, refs = wheel.pop_due(now)
        self._ready.push(due, refs)
        if self._catch_up and self._backlog.size < self.config.catch_up_chunk:
            seg = self._catch_up.popleft()
            if seg not in loader.loaded:
                due, refs = loader.load(seg)
                order = np.argsort(due, kind="stable")
                self._backlog.push(due[order], refs[order])
                self.counters["catch_up_segments"] += 1
        if not self._catch_up and self._deferred.size:
            while (chunk := self._deferred.take(1 << 62)) is not None:
                self._backlog.push(*chunk)
        self._finish_segments(now)

    def _add(self, due: np.ndarray, refs: np.ndarray, now: int, *, overdue_to_backlog: bool = True) -> None:
        """Put loaded entries in the wheel. Those already due go to the catch-up backlog, behind
        older segments still waiting (oldest first), or to the ready queue for late arrivals."""
        if not len(due):
            return
        assert self._wheel is not None
        status = self._wheel.add(due, refs)
        late = status == EXPIRED
        if late.any():
            order = np.argsort(due[late], kind="stable")
            target = self._ready if not overdue_to_backlog else self._deferred if self._catch_up else self._backlog
            target.push(due[late][order], refs[late][order])
        if (status == BEYOND).any():  # the wheel spans two segments and the preload: cannot happen
            raise AssertionError("a loaded entry lies beyond the wheel's horizon")

    def _take_inbound(self, inbound: list[np.ndarray], now: int) -> None:
        loader = self._loader
        assert loader is not None
        locs = np.concatenate(inbound)
        current = now - now % self.config.segment_ms
        for seg in np.unique(locs["segment_ms"]).tolist():
            mine = locs[locs["segment_ms"] == seg]
            if seg not in loader.loaded:
                if seg <= current:  # due already, in a past segment: load it (this record included)
                    if seg in self._catch_up:
                        self._catch_up.remove(seg)
                    self._add(*loader.load(seg), now)
                continue  # a future segment stays on disk until its preload
            mine = loader.not_covered(seg, mine)
            if not len(mine):
                continue
            self._add(mine["due_ms"].astype(np.int64), loader.refs(seg, mine["part"], mine["offset"]), now,
                      overdue_to_backlog=False)

    def _finish_segments(self, now: int) -> None:
        """Mark segments that are over and fully dispatched as done, and let them go."""
        loader, store = self._loader, self.store
        assert loader is not None and store is not None
        seg_ms = self.config.segment_ms
        current = now - now % seg_ms
        for seg, state in list(loader.loaded.items()):
            if seg < current and state.outstanding <= 0 and not self._ready.size and not self._backlog.size \
                    and not self._deferred.size and not len(self._retries):
                store.meta.mark_segment_done(seg)
                loader.unload(seg)
        if current != self._sealed_before:  # once per segment: it takes the store's write lock
            self._sealed_before = current
            store.seal_live_parts(current)

    def _next_wakeup(self, now: int, *, for_dispatch: bool = False) -> int | None:
        """When the timer has work next; with for_dispatch, also now while sends wait (step() does both).

        The timer thread leaves waiting sends to the dispatch thread it notified: waking for them
        would spin it against the dispatcher for the GIL.
        """
        assert self._wheel is not None
        seg_ms = self.config.segment_ms
        candidates = [now - now % seg_ms + seg_ms - self.config.preload_seconds * 1000]
        if candidates[0] <= now:
            candidates[0] = now - now % seg_ms + seg_ms
        nd = self._wheel.next_due_ms()
        if nd is not None:
            candidates.append(nd)
        nr = self._retries.next_ms_min()
        if nr is not None:
            candidates.append(nr)
        if self.shaper is not None and self._held.size:
            ng = self.shaper.next_grant_ms(now)
            candidates.append(now + 1 if ng is None else ng)
        assert self._loader is not None
        sends_waiting = for_dispatch and (self._ready.size or self._backlog.size) and not self._held_full()
        # catch-up moves on only when the backlog has room: the dispatcher wakes the timer then
        catch_up_can_move = bool(self._catch_up) and self._backlog.size < self.config.catch_up_chunk
        if (self._inbound or sends_waiting or (self._deferred.size and not self._catch_up) or self._pending_removals
                or catch_up_can_move or now - now % seg_ms not in self._loader.loaded):
            candidates.append(now)
        return max(now, min(candidates))

    # ---- dispatch side --------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        linger_ms = max(0, int(getattr(self.sink, "linger_ms", 0)))
        while True:
            with self._lock:
                if not self._running:
                    return
                if not (self._ready.size or self._backlog.size) or self._held_full():
                    wake = self._retries.next_ms_min()
                    if self.shaper is not None and self._held.size:
                        ng = self.shaper.next_grant_ms(self.clock.now_ms())
                        ng = self.clock.now_ms() + 1 if ng is None else ng
                        wake = ng if wake is None else min(wake, ng)
                    timeout = self._seconds_until(wake)
                    if timeout > 0 and not self._retry_ready():
                        self._dispatch_cv.wait(timeout)
                        continue  # woken: look again (what came due may wait for company or a send)
                elif not self._backlog.size and self._ready.size < self.config.send_batch_size:
                    waited_ms = self.clock.now_ms() - self._ready.first_due()
                    if self._passes and waited_ms < _BESIDE_AFTER_MS:
                        # A send is in flight and what is ready fits one request: it goes with the
                        # next, when that send is answered. A second small request beside it gains
                        # little and costs a round trip's CPU under the GIL (bench.rocketmq_e2e, 5k/s:
                        # p99 24 ms with four concurrent senders, 15 ms with one; 2k/s: ~140 against
                        # ~100 µs of CPU per message). A full batch or a backlog still goes at once,
                        # and so does a small one once a slow send (a broker timing out) held it long.
                        self._dispatch_cv.wait((_BESIDE_AFTER_MS - waited_ms) / 1000)
                        continue
                    # A sink whose every send costs a round trip asks for company: wait (at most
                    # its linger after the oldest was due) for more to come due and go together.
                    wait_ms = self._ready.first_due() + linger_ms - self.clock.now_ms() if linger_ms else 0
                    if wait_ms > 0:
                        if self._lingering:  # another thread waits for this batch's company already
                            self._dispatch_cv.wait(_MAX_WAIT_S)
                            continue
                        self._lingering = True  # the timer leaves it alone until a batch is full
                        try:
                            self._dispatch_cv.wait(wait_ms / 1000)
                        finally:
                            self._lingering = False
                        continue
                self._passes += 1
            try:
                self._dispatch_pass()
            except Exception:
                log.exception("dispatch pass failed")
                time.sleep(0.1)
            finally:
                with self._lock:
                    self._passes -= 1  # this thread looks again at once: what came due meanwhile goes next

    def _held_full(self) -> bool:
        return self.shaper is not None and self._held.size >= _MAX_HELD

    def _retry_ready(self) -> bool:
        nr = self._retries.next_ms_min()
        return nr is not None and nr <= self.clock.now_ms()

    def _dispatch_pass(self) -> int:
        """Send one batch: ready first, then retries that are due, then catch-up backlog."""
        n = self.config.send_batch_size
        with self._lock:
            batch = self._ready.take(n)
            if batch is None:
                due, refs, att = self._retries.pop_ready(self.clock.now_ms())
                if len(due):
                    self._ready.push(due, refs, att)
                    batch = self._ready.take(n)
            if batch is None:
                batch = self._backlog.take(n)
                if batch is not None and self._catch_up and self._backlog.size < self.config.catch_up_chunk:
                    self._wake_timer.set()  # room for the next past segment
            if batch is None or self._held_full():
                if batch is not None:  # the shaper holds plenty: leave these as arrays for now
                    self._ready.chunks.appendleft(batch)
                    self._ready.size += len(batch[0])
                batch = None
            if batch is None:
                held = self.shaper is not None and self._held.size
            elif self._ready.size or self._backlog.size:
                self._dispatch_cv.notify()  # more to send: another dispatch thread may take it
        if batch is None:
            return self._deliver_granted() if held else 0
        with self._lock:
            due, refs, attempts = batch
            if len(self._cancelled_refs):
                keep = ~np.isin(refs, self._cancelled_refs)
                due, refs, attempts = due[keep], refs[keep], attempts[keep]
        if len(due):
            self._send(due, refs, attempts)
        return len(batch[0])

    def _send(self, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray) -> None:
        """Read the due records and send them (through the shaper's queues when there is one)."""
        loader, store = self._loader, self.store
        assert loader is not None and store is not None
        segs, parts, offsets = loader.locate(refs)
        messages: list[Message] = []
        ok_idx: list[int] = []
        corrupt: list[int] = []
        from_record = Message.from_record
        for i, (rec, att) in enumerate(zip(store.read_records(segs.tolist(), parts.tolist(), offsets.tolist(),
                                                             due.tolist()),
                                           attempts.tolist())):
            if isinstance(rec, CorruptRecordError):
                log.error("corrupt record skipped, never served: %s", rec)
                corrupt.append(i)
                continue
            messages.append(from_record(rec, att + 1))
            ok_idx.append(i)
        now = self.clock.now_ms()
        if corrupt:
            c = np.asarray(corrupt)
            self._record(_Batch([], due[c], refs[c], attempts[c], segs[c], parts[c], offsets[c]), now, CORRUPT,
                         attempts[c])
            with self._lock:
                self.counters["corrupt"] += len(corrupt)
        if not messages:
            return
        k = np.asarray(ok_idx)
        batch = _Batch(messages, due[k], refs[k], attempts[k], segs[k], parts[k], offsets[k])
        if self.shaper is None:
            self._deliver(batch)
            return
        with self._lock:
            self._held.add(batch, now)
        self._deliver_granted()

    def _deliver_granted(self) -> int:
        """Send what the shaper grants now from the held queues, highest share first.

        Tokens keep coming while a send takes time, so this would go on as long as a throttled
        topic has a backlog: it returns after a send once due messages wait to be read instead,
        so that those of other topics reach the held queues (and the shaper) without waiting.
        """
        assert self.shaper is not None
        sent = 0
        while True:
            now = self.clock.now_ms()
            with self._lock:
                if sent and not self._held_full() and (self._ready.size or self._backlog.size or self._retry_ready()):
                    return sent
                backlog = self._held.sizes()
                if not backlog:
                    return sent
                grants = self.shaper.grant(backlog, now)
                batch, held_since = self._held.take(grants, self.config.send_batch_size)
                taken = Counter(m.topic for m in batch.messages) if batch is not None else Counter()
                for topic, n in grants.items():
                    if n > taken.get(topic, 0):  # not taken (the batch was full): the tokens go back
                        self.shaper.release(topic, n - taken.get(topic, 0))
            if batch is None:
                return sent
            self._deliver(batch, held_since)
            sent += len(batch.messages)

    def _deliver(self, b: _Batch, held_since: np.ndarray | None = None) -> None:
        """Send one batch through the sink and record every outcome."""
        try:
            results = self.sink.send_batch(b.messages)
            if len(results) != len(b.messages):
                raise RuntimeError(f"sink answered {len(results)} results for {len(b.messages)} messages")
            delivered = np.asarray(results, bool)
        except Exception:
            log.exception("sink failed a batch of %d", len(b.messages))
            delivered = np.zeros(len(b.messages), bool)
        sent_at = self.clock.now_ms()
        if self.shaper is not None:
            topics: dict[str, list[int]] = {}
            for i, m in enumerate(b.messages):
                topics.setdefault(m.topic, []).append(i)
            for topic, idx in topics.items():
                ok = int(delivered[idx].sum())
                waited = 0.0 if held_since is None else float((sent_at - held_since[idx]).sum())
                self.shaper.record(topic, ok, len(idx) - ok, waited, sent_at)
        good = b.select(delivered)
        if len(good.due):
            try:
                self._record(good, sent_at, DELIVERED, good.attempts + 1)
            except StorageWriteError:
                # Delivered, but the dispatch log could not say so (disk full?): after a restart
                # these would be sent again. Count it; it is an operator's alarm.
                log.exception("delivered %d messages but could not record it", len(good.due))
                with self._lock:
                    self.counters["dispatch_log_errors"] += len(good.due)
            late = np.maximum(sent_at - good.due, 0)
            observations = counts(late)
            with self._lock:
                self.lateness_buckets.observe(late)
                for v, c in observations:
                    self.lateness.record_value(v * 1000, c)  # microseconds; ms resolution
                self.counters["delivered"] += len(good.due)
        if not delivered.all():
            self._fail(b.select(~delivered), sent_at)

    def _fail(self, bad: _Batch, now: int) -> None:
        tries = bad.attempts + 1
        final = tries >= self.config.max_attempts
        with self._lock:
            self.counters["send_failures"] += len(bad.due)
        if final.any():
            dead = bad.select(final)
            if self.dead_letter_sink is not None:
                try:
                    self.dead_letter_sink.dead_letter(dead.messages,
                                                      f"not delivered after {self.config.max_attempts} attempts")
                except Exception:  # the dead-letter path is down too: keep retrying instead of losing it
                    log.exception("dead-letter sink failed; the messages stay in the retry queue")
                    final[:] = False
            if final.any():
                self._record(dead, now, DEAD_LETTERED, tries[final])
                with self._lock:
                    self.counters["dead_lettered"] += int(final.sum())
        retry = ~final
        if retry.any():
            t = tries[retry].astype(np.int64)
            backoff = np.minimum(self.config.retry_base_ms * (2 ** np.minimum(t - 1, 30)), self.config.retry_max_ms)
            jitter = np.array([self._rng.uniform(0.8, 1.2) for _ in range(len(t))])
            with self._lock:
                self._retries.add(now + (backoff * jitter).astype(np.int64), bad.due[retry], bad.refs[retry],
                                  tries[retry].astype(np.int16))
                self.counters["retries"] += int(retry.sum())

    def _record(self, b: _Batch, now: int, outcome: int, attempts: np.ndarray) -> None:
        """Write outcomes (attempts aligned with the batch) to each segment's dispatch log, then
        count them off the loader."""
        store, loader = self.store, self._loader
        assert store is not None and loader is not None
        for seg, m in groups(b.segs):
            store.record_dispatch(seg, dispatch_entries(b.parts[m], b.offsets[m], b.due[m], now, outcome, attempts[m]),
                                  now)
        with self._lock:
            loader.note_done(b.segs)

    def _require_started(self) -> ScheduleStore:
        if not self._started or self.store is None:
            raise EngineStateError("the engine is not started: call start() first")
        return self.store
