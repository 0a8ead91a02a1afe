"""The timer driver: owns time, the wheel and the loaded segments; hands due entries to the queue.

It is to the engine what Kafka's SystemTimer and its reaper are to a TimingWheel: the wheel is a
pure data structure (`timewheel.wheel`), and this driver reads the clock, advances the wheel and
pushes what is due into the `DispatchQueue`. It never reads the dispatchers' state: it pushes,
nudges, and leaves the decision to send to the queue's policy.

One pass (`run_pass`, under the driver's lock) does, in order:
0. count off the loaded segments the terminal outcomes the dispatchers recorded (they hand the
   counts back through the queue, `DispatchQueue.take_done`: they never take this driver's lock);
1. load the current segment, and the next one `preload_seconds` before it begins (after a pause of
   the timer, segments that passed meanwhile unseen join the catch-up, and the wheel turns to now
   first if what is loaded would reach past its horizon);
2. take the records the store committed since the last pass (its commit listener appends their
   locations to an inbound list, under a lock of its own) and add those of loaded segments;
3. every `rescan_seconds`, pick up parts other writers (Spark backfill) published: in loaded
   segments, and in past segments marked done (a slice of them per rescan), which such a part makes
   pending again (`storage.reopen`): they are loaded as a late record's segment is;
4. remove cancelled entries from the wheel;
5. pop what is due into the queue, each entry with its record's location (segment, part, offset)
   so that a dispatcher reads it without asking the driver;
6. catch-up: while the queue's backlog has room, load the next past segment not fully dispatched
   (oldest first) into it; overdue entries of segments loaded meanwhile wait behind (deferred);
7. mark over and fully dispatched segments done (with the parts they were read from), and seal live
   parts once per segment.

A pass that fails (a segment that cannot be loaded, a disk that refuses a seal) stops the timer
thread with the error: the engine reports it dead and the service exits for its supervisor. A pass
is not retried in place, because it is not all or nothing: a load is (`SegmentLoader.load` marks a
segment loaded only once it was read), but records taken from the store's commits or off the wheel
are no longer anywhere in memory if the pass fails after taking them, and a segment wrongly found
fully dispatched would be marked done. Everything due is in the store, and a start reads it again;
until then `failed` freezes the delivered-up-to watermark (`timewheel.watermark.Watermarks`).

The timer thread runs a pass, sends what it popped itself when the queue gives it the turn at once
(`send_now`: a small batch at a low rate, no dispatch thread sending; `DispatchQueue.turn_now`) or
else nudges the queue, and sleeps until `next_wakeup_ms` (at most 50 ms;
a commit of a message due within 100 ms, a cancel, or room in the backlog wake it earlier). With a
sink that lingers (`DispatchQueue.linger_ms`), it pops in steps of that linger: the wheel's next
entry is popped a linger after it was due, with all that came due meanwhile, which is when the
queue would have sent it anyway; each send then carries a fuller batch, for fewer timer passes.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from typing import Callable

import numpy as np

from storage import CANCELLED, ScheduleStore, dispatch_entries, reopen_segments
from timewheel._arrays import same
from timewheel._due import DueChunks, DueEntries
from timewheel._memory import release_free_memory
from timewheel._past_segments import reopened, unseen
from timewheel.clock import Clock, seconds_until
from timewheel.config import EngineConfig
from timewheel.dispatch_queue import DispatchQueue
from timewheel.loader import SegmentLoader
from timewheel.wheel import BEYOND, EXPIRED, TimeWheel
from timewheel._threads import guarded
from timewheel._withdrawn import held_by_timer, record_cancelled, record_claimed

log = logging.getLogger("timewheel.timer")
_MAX_WAIT_S = 0.05  # the timer thread's longest sleep: new work it was not woken for waits this long
_INBOUND_WAKE_MS = 2 * int(_MAX_WAIT_S * 1000)
# Cancelled entries leave the wheel in batches, at most this long after the first of them, or
# once this many wait: a removal scans every held entry (3.5 ms with a million loaded), so a
# stream of cancels removed pass by pass would take the timer's every millisecond. Meanwhile the
# dispatch queue keeps them from being sent (`DispatchQueue.cancel`), and they cost only memory.
_REMOVAL_DELAY_MS = 1000
_REMOVAL_BATCH = 4096


class TimerDriver:
    """Drives the wheel and the segment loader with the clock; produces due entries into a queue."""

    def __init__(self, config: EngineConfig, store: ScheduleStore, clock: Clock, queue: DispatchQueue,
                 wake: threading.Event | None = None, send_now: Callable[[], bool] | None = None,
                 release_held: Callable[[np.ndarray], None] = lambda refs: None) -> None:
        """`wake`: the event that makes the timer thread run a pass (the queue sets it for catch-up);
        `send_now`: after a pass, sends what it popped on this thread if that should go now and no
        dispatch thread is on it, and says whether it did (`Dispatcher.send_if_idle`); else, and
        without it, the queue is nudged for a dispatch thread; `release_held`: queues again what the
        shaper holds among refs withdrawn (`Dispatcher.release_held`)."""
        self._send_now, self._release_held = send_now, release_held
        self.config = config
        self.store = store
        self.clock = clock
        self.queue = queue
        self.loader = SegmentLoader(store)
        self._lock = threading.Lock()  # the wheel, the loader, catch-up, deferred, removals
        self._wake = wake or threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        # New records arrive from the store's commit (under its write lock, so in offset order):
        # this lock guards only the inbound list and is never held while taking another lock.
        self._inbound_lock = threading.Lock()
        self._inbound: list[np.ndarray] = []
        self._inbound_min_due: int | None = None  # earliest due time in the inbound list
        self._released_ms = -1  # every entry due by then has left the wheel (at the last pass)
        self._deferred = DueChunks()  # overdue entries of segments loaded while older ones still wait
        self._catch_up: deque[int] = deque()
        self._pending_removals: list[np.ndarray] = []
        self._removals_due = 0  # when the pending removals are applied at the latest
        self._removals_waiting = 0  # refs in the pending removals
        self._next_rescan = 0
        self._done_to_check: deque[int] = deque()  # done segments the next rescans look into
        self._sealed_before = 0
        self.catch_up_segments = 0  # past segments drained so far
        #: thread name -> the error that ended it
        self.failures: dict[str, str] = {}
        self._clock_step_warned = (0, 0)  # (wheel turn, ms behind it) when a clock step back was last logged
        # a pass failed: what it took off the inbound list or the wheel may be in no list the
        # watermark reads, so the watermark freezes (`timewheel.watermark.Watermarks`)
        self.failed = False
        now = clock.now_ms()
        seg_ms = config.segment_ms
        slots = -(-(2 * seg_ms + config.preload_seconds * 1000) // config.tick_ms) + 2
        self.wheel = TimeWheel(config.tick_ms, slots, now)
        current = store.layout.segment_start(now)
        self._current_before = current  # the current segment at the last pass
        past = [s for s in store.layout.list_segments() if s < current]
        done = store.meta.done_segments()
        # a done segment that a part published since (while stopped, say) makes pending again is not done
        done.difference_update(reopen_segments(store.layout, store.meta, [s for s in past if s in done]))
        self._catch_up.extend(s for s in past if s not in done)
        store.commit_listeners.append(self._on_commit)

    # ---- the thread -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer thread."""
        self._running = True
        self._thread = threading.Thread(target=guarded(self._run, log, self.failures),
                                        name="timewheel-timer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the timer thread (a pass in progress finishes)."""
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def threads(self) -> list[threading.Thread]:
        """The timer thread while started."""
        return [self._thread] if self._thread is not None else []

    def wake(self) -> None:
        """Make the timer thread run a pass now."""
        self._wake.set()

    def _run(self) -> None:
        while self._running:
            self._wake.clear()
            with self._lock:
                # a failed pass ends the thread (`guarded` logs it; module docstring: why not retried)
                self._pass(self.clock.now_ms())
                wake = self._next_wakeup(self.clock.now_ms())
            # outside the lock: a send takes a round trip, and cancels and status take the lock meanwhile
            if self._send_now is None or not self._send_now():
                self.queue.nudge()
            timeout = seconds_until(self.clock, wake, _MAX_WAIT_S)
            if timeout > 0 and self._running:
                self._wake.wait(timeout)

    # ---- what the engine calls ------------------------------------------------------------------

    def run_pass(self, now: int) -> None:
        """One pass at `now` on the caller's thread (the engine's `step()`)."""
        with self._lock:
            self._pass(now)

    def next_wakeup_ms(self, now: int) -> int:
        """When the timer has work next (now if it has some already)."""
        with self._lock:
            return self._next_wakeup(now)

    def cancel(self, by_segment: dict[int, np.ndarray], now: int) -> None:
        """Record cancels (rows of part, offset, due per segment) and keep the entries from being sent.

        Under the lock, so that a segment loading at the same time sees the cancel in its dispatch log
        or has its entries removed here.
        """
        with self._lock:
            for seg, arr in by_segment.items():
                self._cancel_rows(seg, arr, now)
            removals_now = self._removals_waiting >= _REMOVAL_BATCH
        if removals_now:
            self._wake.set()

    def withdraw(self, by_segment: dict[int, np.ndarray], now: int) -> None:
        """Keep entries already due from being sent (rows of part, offset, due per segment), each recorded
        CANCELLED now, once, and counted off its segment once (`timewheel._withdrawn` says by whom)."""
        with self._lock:
            for seg, arr in by_segment.items():
                if seg not in self.loader.loaded:  # under this lock: its load (the catch-up's) reads this outcome
                    record_cancelled(self.store, seg, arr, now)
                    continue
                refs = self.loader.refs(seg, arr[:, 0].astype(np.uint16), arr[:, 1].astype(np.uint32))
                mine = held_by_timer(refs, arr[:, 2], self.wheel.time_ms, self._deferred)
                if not mine.all():  # first: applied again after a failed write, the queue records none twice
                    self._release_held(refs[~mine])  # what the shaper holds: into the queue, to record there
                    claimed = self.queue.withdraw(refs[~mine], functools.partial(record_claimed, self.store, now))
                    self.loader.note_done({seg: claimed})
                if mine.any():  # none of them reached the queue yet: cancelled as if not due
                    self._cancel_rows(seg, arr[mine], now)
            removals_now = self._removals_waiting >= _REMOVAL_BATCH
        if removals_now:
            self._wake.set()

    def _cancel_rows(self, seg: int, arr: np.ndarray, now: int) -> None:
        """Record rows cancelled; those of a loaded segment are kept from being sent and counted off."""
        self.store.record_dispatch(seg, dispatch_entries(arr[:, 0], arr[:, 1], arr[:, 2], now, CANCELLED, 0), now)
        if seg in self.loader.loaded:
            refs = self.loader.refs(seg, arr[:, 0].astype(np.uint16), arr[:, 1].astype(np.uint32))
            self.queue.cancel(refs)
            if not self._pending_removals:
                self._removals_due = now + _REMOVAL_DELAY_MS
            self._pending_removals.append(refs)
            self._removals_waiting += len(refs)
            self.loader.note_done({seg: len(arr)})

    def catch_up_again(self, segments: list[int]) -> None:
        """Past segments to read again whole, as a catch-up (retired, then made again by a part
        published into them: `Housekeeper`); one loaded already is rescanned as it is."""
        with self._lock:
            now = self.clock.now_ms()
            current = now - now % self.config.segment_ms
            new = [s for s in segments if s < current and s not in self.loader.loaded]
            if new:
                self._catch_up = deque(sorted({*self._catch_up, *new}))
        self._wake.set()

    def released_up_to(self) -> int:
        """Every entry due at or before this has left the timer for the dispatch queue (-1: none yet).

        Past segments still waiting for catch-up, deferred entries and records committed since the
        last pass hold it back to just before their earliest due time.
        """
        with self._lock:
            bound = self._released_ms
            if self._catch_up:
                bound = min(bound, min(self._catch_up) - 1)
            if self._deferred.size:
                bound = min(bound, min(int(c.due.min()) for c in self._deferred.chunks) - 1)
            with self._inbound_lock:
                if self._inbound_min_due is not None:
                    bound = min(bound, self._inbound_min_due - 1)
        return bound

    def snapshot(self) -> tuple[int, int, int, dict[str, int]]:
        """(catch-up segments pending, wheel entries, wheel bytes, outstanding per loaded segment)."""
        with self._lock:
            self.loader.note_done(self.queue.take_done())
            return (len(self._catch_up), len(self.wheel), self.wheel.nbytes,
                    {str(k): v.outstanding for k, v in self.loader.loaded.items()})

    # ---- the pass -------------------------------------------------------------------------------

    def _on_commit(self, locations: np.ndarray) -> None:
        """Store callback, under its write lock: newly stored records, in commit order."""
        first = int(locations["due_ms"].min())
        with self._inbound_lock:
            self._inbound.append(locations)
            self._inbound_min_due = first if self._inbound_min_due is None else min(self._inbound_min_due, first)
        # The timer looks at least every _MAX_WAIT_S anyway: wake it only for what falls due
        # before then, so heavy ingest of later messages does not cost a timer pass per commit.
        if first <= self.clock.now_ms() + _INBOUND_WAKE_MS:
            self._wake.set()

    def _pass(self, now: int) -> None:
        try:
            self._pass_once(now)
        except BaseException:
            self.failed = True  # set under the driver's lock: no watermark reads the state it left first
            raise

    def _pass_once(self, now: int) -> None:
        if (missed := self.store.commit_listener_failure) is not None:
            # records this driver was never told of: a pass would go on without them (and could mark
            # their segment done), so the timer stops; the next start loads them from the store
            raise RuntimeError(f"the timer stops: {missed}; a restart loads them from the store")
        loader, wheel, queue = self.loader, self.wheel, self.queue
        loader.note_done(queue.take_done())
        seg_ms = self.config.segment_ms
        current = now - now % seg_ms
        before, self._current_before = self._current_before, current
        # a segment that passed with no pass in it (a pause): no load below nor a start's listing takes it
        if current > before and (current - before > seg_ms or before not in loader.loaded):
            # past now, they are loaded as a start loads them
            if passed := unseen(self.store, loader.loaded, before, current):
                self._catch_up = deque(sorted({*self._catch_up, *passed}))
        loads = [seg for seg in (current, current + seg_ms) if seg not in loader.loaded
                 and (seg == current or now >= seg - self.config.preload_seconds * 1000)]
        if loads and loads[-1] + seg_ms > wheel.horizon_ms:
            # no pass for longer than the wheel spans past its turn (a paused process, a clock
            # stepped forward): turned to now, it spans the segments loaded below
            queue.push_ready(self._entries(*wheel.pop_due(now)))
        for seg in loads:
            if seg in self._catch_up:
                self._catch_up.remove(seg)
            self._add(*loader.load(seg), now)
        if loads:  # the load's temporaries are freed: let the process shrink to what the wheel holds
            release_free_memory()
        with self._inbound_lock:
            inbound, self._inbound = self._inbound, []
            self._inbound_min_due = None
        if inbound:
            self._take_inbound(inbound, now)
        if now >= self._next_rescan:
            self._next_rescan = now + int(self.config.rescan_seconds * 1000)
            for seg in list(loader.loaded):
                self._add(*loader.refresh(seg), now)
            # their marks are cleared: a start loads them too
            again = reopened(self.store, self._done_to_check, loader.loaded, current)
            if again:  # caught up as any past segment is: oldest first, while the backlog has room
                self._catch_up = deque(sorted({*self._catch_up, *again}))
        if self._pending_removals and (now >= self._removals_due or self._removals_waiting >= _REMOVAL_BATCH):
            refs = np.concatenate(self._pending_removals)
            self._pending_removals, self._removals_waiting = [], 0
            wheel.remove(refs)
        queue.push_ready(self._entries(*wheel.pop_due(now)))
        # a segment not yet past (the clock went back since it was queued) is loaded as current, not caught up
        if self._catch_up and self._catch_up[0] < current and queue.backlog_has_room():
            seg = self._catch_up.popleft()
            if seg not in loader.loaded:
                due, refs = loader.load(seg)
                order = np.argsort(due, kind="stable")
                queue.push_backlog(self._entries(due[order], refs[order]))
                self.catch_up_segments += 1
                del due, refs, order
                release_free_memory()
        if not self._catch_up and (deferred := self._deferred.take_all()) is not None:
            queue.push_backlog(deferred)
        queue.expect_catch_up(bool(self._catch_up))
        self._released_ms = now
        self._finish_segments(now)

    def _add(self, due: np.ndarray, refs: np.ndarray, now: int, *, overdue_to_backlog: bool = True) -> None:
        """Put loaded entries in the wheel. Those already due go to the catch-up backlog, behind
        older segments still waiting (oldest first), or to the ready queue for late arrivals."""
        if not len(due):
            return
        status = self.wheel.add(due, refs)
        late = status == EXPIRED
        if late.any() and int(due[late].max()) > now:
            # behind the wheel's turn, yet not due by the clock: the wall clock went back (an NTP
            # step, a VM restored) past the turn. Sent now they would go early; they wait for
            # their due time in the queue instead, as a retry does.
            early = late & (due > now)
            self.queue.hold_until_due(self._entries(due[early], refs[early]))
            late &= ~early
            turn, behind = self.wheel.time_ms, self.wheel.time_ms - now
            # once a step: while the clock is behind, the wheel stays at its turn and every commit
            # lands here again, less behind each time; more behind is a further step back
            if turn != self._clock_step_warned[0] or behind > self._clock_step_warned[1] + 1000:
                self._clock_step_warned = (turn, behind)
                log.warning("the clock is %d ms behind the timer's last turn (it went back): entries not due "
                            "yet by it wait for their due time (shown as retrying until then; %d now, more "
                            "until the clock is past the turn or steps back again are not logged)",
                            behind, int(early.sum()))
        if late.any():
            order = np.argsort(due[late], kind="stable")
            entries = self._entries(due[late][order], refs[late][order])
            if not overdue_to_backlog:
                self.queue.push_ready(entries)
            elif self._catch_up:
                self._deferred.push(entries)
            else:
                self.queue.push_backlog(entries)
        if (status == BEYOND).any():  # the wheel spans two segments and the preload: cannot happen
            raise AssertionError("a loaded entry lies beyond the wheel's horizon")

    def _entries(self, due: np.ndarray, refs: np.ndarray) -> DueEntries:
        """Due entries with their records' locations, for the queue (no attempt yet)."""
        if not len(due):
            return DueEntries.empty()
        return DueEntries(due, refs, np.zeros(len(due), np.int16), *self.loader.locate(refs))

    def _take_inbound(self, inbound: list[np.ndarray], now: int) -> None:
        loader = self.loader
        locs = inbound[0] if len(inbound) == 1 else np.concatenate(inbound)
        current = now - now % self.config.segment_ms
        segs = locs["segment_ms"]
        first = int(segs[0])
        one = same(segs)  # one segment: the usual commit, no sort
        for seg in [first] if one else np.unique(segs).tolist():
            mine = locs if one else locs[segs == seg]
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
        seg_ms = self.config.segment_ms
        current = now - now % seg_ms
        for seg, state in list(self.loader.loaded.items()):
            # no entry of a past segment left in the queue (what is due now may wait there: a
            # standby replica holds it for as long as another replica holds the lease)
            if (seg < current and state.outstanding <= 0 and not self._deferred.size
                    and (self.queue.earliest_due() or current) >= current):
                # not while a record stored in it since this pass began (late) waits in the inbound
                # list: a start never loads a done segment, and it would not be sent
                if not self.store.mark_segment_done(seg, functools.partial(self._none_inbound, seg),
                                                    list(state.loaded_end)):
                    continue
                # none of its entries can reach the queue again: its cancels need not be remembered
                self.queue.forget(functools.partial(self.loader.in_segment, segment_ms=seg))
                self.loader.unload(seg)
        if current != self._sealed_before:  # once per segment: it takes the store's write lock
            self._sealed_before = current
            self.store.seal_live_parts(current)

    def _none_inbound(self, segment_ms: int) -> bool:
        """Whether no record of this segment waits in the inbound list."""
        with self._inbound_lock:
            return not any((locs["segment_ms"] == segment_ms).any() for locs in self._inbound)

    def _next_wakeup(self, now: int) -> int:
        seg_ms = self.config.segment_ms
        start = now - now % seg_ms
        preload = start + seg_ms - self.config.preload_seconds * 1000
        candidates = [preload if preload > now else start + seg_ms]
        nd = self.wheel.next_due_ms()
        if nd is not None:
            # a linger after the next entry was due: it goes then with what came due meanwhile
            candidates.append(nd + self.queue.linger_ms)
        # catch-up moves on only when the backlog has room: taking from it wakes the timer then
        catch_up_can_move = bool(self._catch_up) and self.queue.backlog_has_room()
        if self._pending_removals:
            candidates.append(self._removals_due if self._removals_waiting < _REMOVAL_BATCH else now)
        if (self._inbound or (self._deferred.size and not self._catch_up)
                or catch_up_can_move or start not in self.loader.loaded):
            candidates.append(now)
        return max(now, min(candidates))
