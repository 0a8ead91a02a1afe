"""The dispatch queue: where the timer thread hands due entries to the dispatch threads.

It is the one meeting point of the engine's threads, with its own Condition, as the reaper of
Kafka's SystemTimer hands expired tasks to its executor:
- the timer pushes due entries (`push_ready`; past segments' entries with `push_backlog`), each
  with its record's location (`DueEntries`: a dispatcher never asks the timer where a record is),
  and then calls `nudge()`; it never looks at what the dispatchers are doing;
- a dispatch thread calls `await_turn()`, which waits until sending is worth it and counts the
  thread as sending, then `take()`s a batch, sends it, and calls `end_turn()`; failed sends come
  back with `retry()` (location and all) and are taken again once their backoff is over;
- outcomes go back the other way: a dispatch thread counts the terminal outcomes it recorded per
  segment (`count_done()`), and the timer takes the counts on its own thread (`take_done()`);
- `cancel()` marks refs that must not be sent even if they are already here; `withdraw()` does the
  same for entries cancelled after they came due: those here, or taken by a pass that has not
  `claim()`ed them yet (a gate's pass claims only once it may send), are recorded cancelled at once,
  under the lock; any other (being sent) by the dispatcher whose `take()` or `claim()` drops it
  (`drain_withdrawn()`), so none gets two outcomes (`timewheel._withdrawn`). Both are remembered
  (`timewheel._ref_set.RefSet`: a take tests its batch by binary search, however many are held)
  until the timer lets their segment go (`forget()`).

The dispatch policy lives here, because only here are both sides visible under one lock:
- one thread sends unless there is a backlog: a second goes beside a send in flight only when a
  full batch waits (`take()` wakes another only when more than one full batch was there), up to
  the sink's `max_in_flight` threads;
- a small batch waits for the send in flight (at most `BESIDE_AFTER_MS` after its oldest entry was
  due; a small catch-up backlog, already late, waits for it whole): it goes with the next request
  instead of in a second small one beside it;
- with a sink's `linger_ms`, one thread waits that long after the oldest entry was due, for
  company; the others and `nudge()` leave it alone until the batch is full;
- under load the linger grows with the due rate (`linger_ms`, the property): from the sink's
  `linger_ms` when quiet to its `linger_max_ms` at `FULL_LINGER_RATE` due a second or more. A send
  costs about 180 µs of the engine's CPU whatever it carries (bench/RESULTS_HOTPATHS.md), so at
  10,000 due a second a 2 ms linger spends more on sends than on messages (20 µs a message in
  `bench.capacity`, 12 with 6 ms, and the p99 no worse: less CPU, less waiting for the GIL); at
  1,000 a second the sends cost little and the lateness stays at the short linger (none by
  default: each message goes when due).

At a low rate (no linger: below the rate at which it starts to grow) the timer thread sends what it
popped itself when no dispatch thread is sending or lingering (`turn_now()`, then the dispatcher's
pass on the timer's thread): a small batch would go at once anyway, and handing it to a sleeping
dispatch thread adds a wait for that thread to wake and take the GIL (at 1,000 a second the p999
fell from 19-38 ms to 11-15 with the same CPU; bench/RESULTS_HOTPATHS.md, run 16). A backlog, a
full batch, a linger or a send in flight wake the dispatch threads as before.

Example: four dispatch threads, a sink answering in 5 ms, 2,000 messages due a second. Thread A
takes the entries due so far and sends them. During its 5 ms ten more come due; the timer pushes
them and nudges, but a send is in flight and they fit one request, so no thread is woken. When A's
send returns, A looks again at once and takes the ten. The 2,000 go in about 200 sends, one at a
time, instead of several hundred small ones side by side. Ten thousand due at one millisecond are
ten full batches: each `take()` that leaves more behind wakes another thread, and they go four at
a time.
"""
from __future__ import annotations

import enum
import threading
from typing import Callable

import numpy as np

from timewheel._due import DueChunks, DueEntries, earliest_apart
from timewheel._ref_set import RefSet
from timewheel._retry_waits import RetryWaits
from timewheel._withdrawn import waiting_among
from timewheel.clock import Clock, seconds_until

# Due messages wait at most this long for the send in flight before going in a send of their own.
BESIDE_AFTER_MS = 20
#: due entries a second at which the linger reaches the sink's `linger_max_ms`
FULL_LINGER_RATE = 10_000
#: how long the due rate is counted over before the linger follows it
RATE_WINDOW_MS = 500
#: longest wait of a dispatch thread: what it was not woken for waits at most this long; IDLE_WAIT_S with
#: nothing waiting, retrying or held (what brings work wakes it: `nudge`, `hold_until_due`, `cancel`, `close`)
MAX_WAIT_S, IDLE_WAIT_S = 0.05, 1.0


def linger_for_rate(due_per_s: float, floor_ms: int, max_ms: int) -> int:
    """The send linger at `due_per_s`: from `floor_ms` when quiet to `max_ms` at `FULL_LINGER_RATE`."""
    return floor_ms + int((max_ms - floor_ms) * min(1.0, due_per_s / FULL_LINGER_RATE))

class Turn(enum.Enum):
    """What `await_turn` decided."""

    SEND = "send"  # run a dispatch pass now, then end_turn()
    LOOK_AGAIN = "look again"  # waited (or was woken): call await_turn again
    CLOSED = "closed"  # the queue is closed: the thread ends


class DispatchQueue:
    """Due entries waiting for a sender: ready now, catch-up backlog, retries; and when to send."""

    def __init__(self, clock: Clock, *, batch_size: int, catch_up_chunk: int, linger_ms: int = 0,
                 linger_max_ms: int | None = None, wake_timer: Callable[[], None] = lambda: None) -> None:
        """`linger_ms`: a small batch's wait for company when quiet; `linger_max_ms` (default: the
        same): the longest it grows to under load."""
        self._clock = clock
        self._batch_size = batch_size
        self._catch_up_chunk = catch_up_chunk
        self._linger_floor = max(0, linger_ms)
        self._linger_max = max(self._linger_floor, linger_ms if linger_max_ms is None else linger_max_ms)
        self._linger_ms = self._linger_floor
        self._rate_since = clock.now_ms()
        self._rate_count = 0  # entries pushed ready since _rate_since
        self._wake_timer = wake_timer
        self._cv = threading.Condition(threading.Lock())
        self._ready = DueChunks()
        self._backlog = DueChunks()
        self._retries = RetryWaits(self._rate_since)  # backoffs, and holds until due (timewheel/_retry_waits.py)
        self._cancelled = RefSet()
        self._withdrawn = RefSet()  # cancelled after due: dropped at take, recorded by the taker
        self._dropped: dict[int, list[DueEntries]] = {}  # per dispatch thread, withdrawn entries it dropped
        self._done: dict[int, int] = {}  # terminal outcomes recorded per segment, for the timer to take
        self._sending = 0  # dispatch passes in progress
        # what each dispatch thread took and has not finished with (the delivered-up-to watermark
        # must not pass it unless it names it)
        self._in_hand: dict[int, list[DueEntries]] = {}
        self._unclaimed: dict[int, list[DueEntries]] = {}  # taken with claim=False, not claimed yet
        self._lingering = False  # a dispatch thread waits for a small batch to fill
        self._catch_up_waiting = False  # the timer has past segments to add once the backlog has room
        self._closed = False

    @property
    def linger_ms(self) -> int:
        """How long a small batch waits for company after its oldest entry was due now: the sink's
        linger, grown with the due rate up to its `linger_max_ms` (module docstring)."""
        if self._linger_ms != self._linger_floor and self._clock.now_ms() - self._rate_since > 2 * RATE_WINDOW_MS:
            return self._linger_floor  # nothing came due for a while: quiet again
        return self._linger_ms

    def _count_due(self, n: int) -> None:
        """Count entries come due; once a window is over, set the linger from the rate it saw."""
        self._rate_count += n
        now = self._now()
        elapsed = now - self._rate_since
        if elapsed < RATE_WINDOW_MS:
            return
        self._linger_ms = linger_for_rate(self._rate_count * 1000 / elapsed, self._linger_floor, self._linger_max)
        self._rate_since, self._rate_count = now, 0

    # ---- the timer's side -----------------------------------------------------------------------

    def push_ready(self, entries: DueEntries) -> None:
        """Entries due now (call `nudge()` once the pass is over)."""
        if len(entries.due):
            with self._cv:
                self._ready.push(entries)
                if self._linger_max != self._linger_floor:
                    self._count_due(len(entries.due))

    def push_backlog(self, entries: DueEntries) -> None:
        """Overdue entries of past segments, oldest first: sent after what is due now and retries."""
        if len(entries.due):
            with self._cv:
                self._backlog.push(entries)

    def take_done(self) -> dict[int, int]:
        """Terminal outcomes recorded per segment since the last call (the timer's loader counts them off)."""
        with self._cv:
            done, self._done = self._done, {}
        return done

    def expect_catch_up(self, waiting: bool) -> None:
        """Whether the timer holds more past segments: then taking from the backlog wakes it."""
        with self._cv:
            self._catch_up_waiting = waiting

    def backlog_has_room(self) -> bool:
        """Whether another past segment may join the backlog."""
        with self._cv:
            return self._backlog.size < self._catch_up_chunk

    def idle(self) -> bool:
        """Nothing waits to be sent or retried."""
        with self._cv:
            return not (self._ready.size or self._backlog.size or len(self._retries))

    def nudge(self) -> None:
        """Wake a dispatch thread if what waits should go now (policy in the module docstring)."""
        with self._cv:
            small = self._ready.size + self._backlog.size < self._batch_size
            if self._backlog.size and not (self._sending and small):
                self._cv.notify()
            elif self._ready.size and not ((self._lingering or self._sending) and small):
                self._cv.notify()

    def cancel(self, refs: np.ndarray) -> None:
        """Never hand out these refs (cancelled; they may already be due and waiting here)."""
        with self._cv:
            self._cancelled.add(refs)

    def withdraw(self, refs: np.ndarray, record: Callable[[DueEntries], None], *, again: bool = False) -> int:
        """Never hand out these refs, though already due (cancelled late on a replica that sent none of
        them). Those waiting here or in a pass's hands unclaimed are recorded now by `record`, under this
        lock (no `take()` or `claim()` gets in between, and none hands them out after), and how many is
        returned, for their segment's count; the thread whose `take()` or `claim()` meets any other (a
        pass claimed it: it may be on its way to the sink) records it (`drain_withdrawn()`). Should
        `record` fail, every one is still withdrawn, for its taker. `again`: only those of `refs`
        withdrawn already (a pass put them back here unsent: `timewheel._withdrawn.record_put_back`)."""
        with self._cv:
            if again:  # a pass's batch back unsent: usually nothing of it withdrawn, then no look at what waits
                refs = refs[self._withdrawn.contains(refs)] if self._withdrawn else refs[:0]
                if not len(refs):
                    return 0
            if self._cancelled:
                refs = refs[~self._cancelled.contains(refs)]  # recorded cancelled already
            self._withdrawn.add(refs)
            unclaimed = [c for taken in self._unclaimed.values() for c in taken]
            here = waiting_among(refs, [*self._ready.chunks, *self._backlog.chunks, self._retries.entries, *unclaimed])
            if len(here.due):
                record(here)
                self._withdrawn.discard(here.refs)
                self._cancelled.add(here.refs)
            return len(here.due)

    def forget(self, where: Callable[[np.ndarray], np.ndarray]) -> int:
        """Let go of the cancelled and withdrawn refs for which `where(refs)` (a mask) is True: the
        timer calls it for a segment it lets go, none of whose entries can come here again; returns
        how many went. Without it both sets would only grow, and every `take()` test against them."""
        with self._cv:
            return self._cancelled.forget(where) + self._withdrawn.forget(where)

    def cancelled_held(self) -> int:
        """Cancelled and withdrawn refs remembered (until their segment is let go)."""
        with self._cv:
            return len(self._cancelled) + len(self._withdrawn)

    def drain_withdrawn(self) -> DueEntries | None:
        """The withdrawn entries the calling thread's `take()`s dropped since it last asked."""
        tid = threading.get_ident()
        if tid not in self._dropped:  # only this thread's take() adds its key: no lock for the usual answer
            return None
        with self._cv:
            got = self._dropped.pop(tid, None)
        return DueEntries.concat(got) if got else None

    def close(self) -> None:
        """Wake every dispatch thread to end."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ---- the dispatchers' side ------------------------------------------------------------------

    def await_turn(self, held_full: bool = False, held_wake_ms: int | None = None) -> Turn:
        """Wait at most once, until a pass is worth running; SEND counts the caller as sending.

        `held_full`: the caller's shaper holds so much that nothing more should be read now;
        `held_wake_ms`: when the shaper may grant what it holds (None: it holds nothing).
        """
        with self._cv:
            if self._closed:
                return Turn.CLOSED
            now = self._now()
            waiting = self._ready.size + self._backlog.size
            if not waiting or held_full:
                # nothing to read: wait for the timer, the next retry or the shaper's next grant
                wake = self._retries.next_ms_min()
                if held_wake_ms is not None:
                    wake = held_wake_ms if wake is None else min(wake, held_wake_ms)
                timeout = seconds_until(self._clock, wake, MAX_WAIT_S if wake is not None else IDLE_WAIT_S)
                if timeout > 0 and not self._retries.ready_by(now):
                    self._cv.wait(timeout)
                    return Turn.LOOK_AGAIN
            elif waiting < self._batch_size:
                if self._sending and not self._ready.size:
                    # a small catch-up backlog, late already: the thread sending takes it next
                    self._cv.wait(MAX_WAIT_S)
                    return Turn.LOOK_AGAIN
                waited_ms = now - self._ready.first_due() if self._ready.size else 0
                if self._sending and waited_ms < BESIDE_AFTER_MS:
                    # A send is in flight and what is ready fits one request: it goes with the
                    # next, when that send is answered. A second small request beside it gains
                    # little and costs a round trip's CPU under the GIL (bench.rocketmq_e2e, 5k/s:
                    # p99 24 ms with four concurrent senders, 15 ms with one; 2k/s: ~140 against
                    # ~100 µs of CPU per message). A full batch or a backlog still goes at once,
                    # and so does a small one once a slow send (a broker timing out) held it long.
                    self._cv.wait((BESIDE_AFTER_MS - waited_ms) / 1000)
                    return Turn.LOOK_AGAIN
                # A sink whose every send costs a round trip asks for company: wait (at most its
                # linger after the oldest was due) for more to come due and go together.
                linger = self.linger_ms
                wait_ms = (self._ready.first_due() + linger - now if linger and not self._backlog.size else 0)
                if wait_ms > 0:
                    if self._lingering:  # another thread waits for this batch's company already
                        self._cv.wait(MAX_WAIT_S)
                        return Turn.LOOK_AGAIN
                    self._lingering = True  # nudge() leaves it alone until a batch is full
                    try:
                        self._cv.wait(wait_ms / 1000)
                    finally:
                        self._lingering = False
                    return Turn.LOOK_AGAIN
            self._sending += 1
            return Turn.SEND

    def turn_now(self) -> bool:
        """A turn for the caller, without waiting, when a small ready batch would go now and no dispatch
        thread is on it: nothing sending or lingering, no linger, no backlog (the timer's own send at a
        low rate; module docstring). True counts the caller as sending: `end_turn()` after its pass."""
        with self._cv:
            if (self._closed or not self._ready.size or self._backlog.size or self._sending or self._lingering
                    or self._ready.size >= self._batch_size or self.linger_ms):
                return False
            self._sending += 1
            return True

    def end_turn(self) -> None:
        """A pass is over (the thread looks again at once: what came due meanwhile goes next)."""
        with self._cv:
            self._sending -= 1

    def take(self, n: int, claim: bool = True) -> tuple[DueEntries, int] | None:
        """Up to n entries to send: ready first, then retries that are due, then backlog.

        Returns the entries not cancelled, and how many were taken (cancelled ones included); None
        when nothing waits. `claim=False`: a late cancel still records them (`withdraw`) until the
        caller `claim()`s them.
        """
        with self._cv:
            batch = self._ready.take(n)
            if batch is None and len(self._retries):
                retried = self._retries.pop_ready(self._now())
                if retried is not None:
                    self._ready.push(retried)
                    batch = self._ready.take(n)
            if batch is None:
                batch = self._backlog.take(n)
                if batch is not None and self._catch_up_waiting and self._backlog.size < self._catch_up_chunk:
                    self._wake_timer()  # room for the next past segment
            if batch is None:
                return None
            if self._ready.size + self._backlog.size >= self._batch_size:
                self._cv.notify()  # a full batch more: another dispatch thread may send it beside this one
            taken = len(batch.due)
            if taken:
                self._note_in_hand(batch)
            if self._cancelled or self._withdrawn:
                batch = batch.select(self._screen(batch))
            if not claim and len(batch.due):
                self._unclaimed.setdefault(threading.get_ident(), []).append(batch)
            return batch, taken

    def claim(self, entries: DueEntries) -> np.ndarray:
        """The calling thread will send or record `entries`, of what it took with `claim=False`: from
        now on a late cancel leaves them to it (`withdraw`). Whatever else it took must be back here
        by then. A mask: those still its own (not recorded cancelled meanwhile, nor dropped for it to
        record: `drain_withdrawn()`)."""
        with self._cv:
            self._unclaimed.pop(threading.get_ident(), None)
            return self._screen(entries)

    def _screen(self, e: DueEntries) -> np.ndarray:
        """A mask: which of `e` may be handed out; the withdrawn are dropped for the calling thread to
        record (`drain_withdrawn()`), and withdrawn no more (under the lock)."""
        keep = ~self._cancelled.contains(e.refs) if self._cancelled else np.ones(len(e.due), bool)
        if self._withdrawn:
            w = self._withdrawn.contains(e.refs) & keep
            if w.any():
                self._dropped.setdefault(threading.get_ident(), []).append(e.select(w))
                self._withdrawn.discard(e.refs[w])
                keep &= ~w
        return keep

    def note_in_hand(self, entries: DueEntries) -> None:
        """The calling thread holds `entries` outside the queue until `clear_in_hand()`."""
        with self._cv:
            self._note_in_hand(entries)

    def _note_in_hand(self, entries: DueEntries) -> None:
        self._in_hand.setdefault(threading.get_ident(), []).append(entries)

    def clear_in_hand(self) -> None:
        """The calling thread finished with what it took (recorded, retried or held again)."""
        with self._cv:
            self._in_hand.pop(threading.get_ident(), None)
            self._unclaimed.pop(threading.get_ident(), None)

    def earliest_due(self) -> int | None:
        """Earliest due time of any entry here or in a dispatch thread's hands (None: nothing)."""
        with self._cv:
            mins = [int(e.due.min()) for e in self._waiting() if len(e.due)]
            retry_min = self._retries.due_min()
            if retry_min is not None:
                mins.append(retry_min)
            return min(mins) if mins else None

    def earliest_due_apart(self, limit: int, stragglers_before_ms: int | None = None) -> tuple[int | None, DueEntries]:
        """`earliest_due`, with up to `limit` of the earliest entries set apart: (the earliest due
        time of everything else, those entries by due time), read under one lock.

        Set apart are entries waiting for a retry and, with `stragglers_before_ms`, entries ready,
        in the backlog or in a dispatch thread's hands that were due before it (a message that
        arrived already past due waits there like any other, and would hold the watermark at its
        due time meanwhile).
        """
        with self._cv:
            return earliest_apart(self._waiting(), self._retries.entries if len(self._retries) else None, limit,
                                  stragglers_before_ms)

    def _waiting(self) -> list[DueEntries]:
        """Every chunk of entries not yet done but the retries: ready, backlog, in hand (under the lock)."""
        out = [c for q in (self._ready, self._backlog) for c in q.chunks]
        for held in self._in_hand.values():
            out.extend(held)
        return out

    def retry(self, next_ms: np.ndarray, entries: DueEntries) -> None:
        """Failed entries, to be taken again from `next_ms` on (their location goes with them): now
        plus a backoff, which a step back of the clock does not lengthen; one at its own due time
        waits for that wall-clock instant, as `hold_until_due`'s do."""
        with self._cv:
            self._retries.add(next_ms, entries, self._now())

    def hold_until_due(self, entries: DueEntries) -> None:
        """Entries not due yet that the timer cannot keep (its wheel turned past them: the clock went
        back), taken from their due time on by the wall clock; the waiting threads look again."""
        with self._cv:
            self._retries.hold_until_due(entries)
            self._cv.notify_all()

    def count_done(self, segment_ms: int, n: int) -> None:
        """`n` terminal outcomes of entries of a segment were recorded (the timer takes the counts)."""
        with self._cv:
            self._done[segment_ms] = self._done.get(segment_ms, 0) + n

    def sendable(self) -> bool:
        """Something could be taken now."""
        with self._cv:
            return bool(self._ready.size or self._backlog.size) or self._retries.ready_by(self._now())

    def next_send_ms(self, now: int, held_full: bool) -> int | None:
        """When something can be taken next (now if it can), for a caller that drives by hand."""
        with self._cv:
            nr = self._retries.next_ms_min()
            if (self._ready.size or self._backlog.size) and not held_full:
                return now
            return nr

    def sizes(self) -> tuple[int, int, int]:
        """(ready, backlog, retrying) entries."""
        with self._cv:
            return self._ready.size, self._backlog.size, len(self._retries)

    def _now(self) -> int:
        """The clock, read under the lock: readings in order, so the retries see a step back."""
        now = self._clock.now_ms()
        self._retries.observe(now)
        return now

