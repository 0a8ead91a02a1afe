"""The dispatcher: takes due entries from the dispatch queue, sends them, and records what happened.

Its threads (`max_in_flight` of the sink, default one; the queue wakes more than one only for a
backlog) each loop: `DispatchQueue.await_turn()`, then one pass, then `end_turn()`. A pass takes a
batch (ready, retries that are due, then catch-up backlog; each entry with its record's location),
reads the records from disk, and
- without a shaper, sends them through the Sink at once;
- with one, adds them to per-topic held queues and sends what the shaper grants, highest share
  first; past `_MAX_HELD` held messages, due entries stay in the queue as arrays;
then writes each outcome to its segment's dispatch log (delivered, corrupt, dead-lettered), counts
the terminal ones per segment into the queue (`DispatchQueue.count_done`: the timer takes them on
its own thread), and records lateness. A failed send goes back to the queue with its location,
exponential backoff and jitter; after `max_attempts` it goes to the dead-letter sink (if that fails
too, it keeps retrying): outcomes, retries and dead letters are `timewheel._outcomes`. The
dispatcher never calls into the timer; at a low rate the timer runs a pass on its own thread
(`send_if_idle`). What a crash, a takeover or a failed send left ambiguous is looked up before
`_deliver` sends it (`timewheel._recovery`).

A send is two stages, `_send` (read the records: `timewheel._read_batch`) then `_deliver` (one
send batch through the sink, then the outcomes). The dispatcher's lock guards the held queues and
its counters; it is never held while calling the Sink or the store (the shaper and the queue are).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import replace
from typing import Mapping, cast

import numpy as np

from storage import CANCELLED, CORRUPT, DELIVERED, ScheduleStore, StorageWriteError
from timewheel._arrays import all_true, rows_by_topic
from timewheel._due import DueEntries
from timewheel._held import Batch, HeldQueues
from timewheel._outcomes import DispatchCounters, Outcomes
from timewheel.clock import Clock
from timewheel.config import EngineConfig
from timewheel.dispatch_queue import DispatchQueue, Turn
from timewheel.gate import DeliveryGate
from timewheel.lateness import LatenessRecorder
from timewheel.message import DeadLetterSink, RecordSink, Shaper, Sink
from timewheel._read_batch import read_bytes, read_messages
from timewheel._recovery import FOUND_NOTE, Recovery
from timewheel._sink_send import SinkAnswer, sink_send
from timewheel._threads import guarded
from timewheel._withdrawn import record_put_back

log = logging.getLogger("timewheel.dispatcher")
_MAX_HELD = 200_000  # due messages read and held by the shaper before the rest wait as arrays
#: A pass over `_INLINE_SLOW_MS` (a slow broker, a first connection) ends passes on the timer's thread
#: (`send_if_idle`), which pops nothing while it waits for the broker: they start again once
#: `_INLINE_RESUME_FAST` passes in a row were fast, and not before `_INLINE_PAUSE_FACTOR` times the
#: slow one's time went by. A broker that keeps stalling keeps them off.
_INLINE_SLOW_MS = 20
_INLINE_PAUSE_FACTOR, _INLINE_RESUME_FAST = 10, 20


class Dispatcher:
    """Sends due entries through the Sink (and the Shaper), retries, dead-letters, records outcomes."""

    def __init__(self, config: EngineConfig, store: ScheduleStore, queue: DispatchQueue,
                 sink: Sink, clock: Clock, lateness: LatenessRecorder, *, shaper: Shaper | None = None,
                 dead_letter_sink: DeadLetterSink | None = None, seed: int | None = None,
                 counters: DispatchCounters | None = None, gate: DeliveryGate | None = None,
                 recovery: Recovery | None = None) -> None:
        """`counters`: to count on from (an engine started again keeps its totals); `gate`: a replica's
        lease (`timewheel.gate`), None when this engine alone delivers what it stores; `recovery`: the
        look-up of ambiguous entries before they are sent again (`timewheel._recovery`)."""
        self.config = config
        self.store = store
        self.queue = queue
        self.sink = sink
        self.failures: dict[str, str] = {}  # thread name -> the error that ended it
        self.shaper = shaper
        self.clock = clock
        self.lateness = lateness
        self.gate = gate
        self.recovery = recovery
        self.counters = counters or DispatchCounters()
        self._held = HeldQueues()
        # a sink that sends stored records as they are spares a Message per delivered message
        self._record_sink = cast(RecordSink, sink) if callable(getattr(sink, "send_records", None)) else None
        self._lock = threading.Lock()  # the held queues, the counters
        self.outcomes = Outcomes(config, store, queue, self.counters, self._lock, dead_letter_sink, seed)
        self._threads: list[threading.Thread] = []
        self.failed = False  # a pass failed (fail-stop): no thread takes anything more
        # `send_if_idle` sends nothing before then, nor until this many passes in a row were fast
        self._inline_paused_until = 0
        self._fast_passes = _INLINE_RESUME_FAST

    @property
    def dead_letter_sink(self) -> DeadLetterSink | None:
        """Where messages go after their last attempt (None: they keep retrying)."""
        return self.outcomes.dead_letter_sink

    @dead_letter_sink.setter
    def dead_letter_sink(self, sink: DeadLetterSink | None) -> None:
        self.outcomes.dead_letter_sink = sink

    # ---- the threads ----------------------------------------------------------------------------

    def threads(self) -> list[threading.Thread]:
        """The dispatch threads while started."""
        return list(self._threads)

    def start(self, threads: int) -> None:
        """Start `threads` dispatch threads."""
        self._threads = [threading.Thread(target=guarded(self._run, log, self.failures), name=f"timewheel-dispatch-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def join(self) -> None:
        """Wait for the threads to end (close the queue first)."""
        for t in self._threads:
            t.join()
        self._threads = []

    def _run(self) -> None:
        while not self.failed:
            held_full, held_wake = self._held_state(self.clock.now_ms())
            turn = self.queue.await_turn(held_full, held_wake)
            if turn is Turn.CLOSED:
                return
            if turn is Turn.LOOK_AGAIN:  # what came due may wait for company or a send
                continue
            start = self.clock.now_ms()
            try:
                handled = self.dispatch_pass()
            finally:
                self.queue.end_turn()
            self._timed(start, handled)

    def _held_state(self, now: int) -> tuple[bool, int | None]:
        """Whether the shaper holds enough to stop reading, and when it may grant what it holds."""
        if self.shaper is None:
            return False, None
        with self._lock:
            size = self._held.size
        if not size:
            return False, None
        ng = self.shaper.next_grant_ms(now)
        return size >= _MAX_HELD, now + 1 if ng is None else ng

    def next_wakeup_ms(self, now: int) -> int | None:
        """When a pass has something to do next (now if it has), for a caller that drives by hand."""
        held_full, held_wake = self._held_state(now)
        candidates = [t for t in (self.queue.next_send_ms(now, held_full), held_wake) if t is not None]
        return min(candidates) if candidates else None

    def counts(self) -> DispatchCounters:
        """A copy of the counters."""
        with self._lock:
            return replace(self.counters)

    def held_size(self) -> int:
        """Due messages the shaper holds back."""
        with self._lock:
            return self._held.size

    def send_if_idle(self) -> bool:
        """One pass on the caller's thread (the timer's, after it popped) when a small batch would go
        now and no dispatch thread is on it (`DispatchQueue.turn_now`); whether it ran.

        Not with a shaper rule in force or messages held (those passes may wait for grants), nor after
        a slow pass until the passes are fast again (`_INLINE_SLOW_MS`). A pass that fails raises here
        as on a dispatch thread (fail-stop: what it took is back in the queue).
        """
        if self.failed or self._fast_passes < _INLINE_RESUME_FAST:
            return False
        shaper = self.shaper
        if shaper is not None and (self._held.size or not shaper.passes_through()):
            return False
        start = self.clock.now_ms()
        if start < self._inline_paused_until or not self.queue.turn_now():
            return False
        try:
            handled = self.dispatch_pass()
        finally:
            self.queue.end_turn()
        self.counters.timer_thread_passes += 1  # only the timer's thread counts it: no lock
        self._timed(start, handled)
        return True

    def _timed(self, start: int, handled: int) -> None:
        """Count a pass begun at `start` that handled `handled` entries fast or slow (whether the
        timer's thread may send: `send_if_idle`)."""
        if not handled:
            # A pass that sent nothing says nothing of the broker: between the stalls of a broker
            # that stalls every few seconds, empty passes would let the timer's thread back in.
            return
        now = self.clock.now_ms()
        took = now - start
        if took <= _INLINE_SLOW_MS:
            self._fast_passes += 1  # unlocked: a count off by one under a race only shifts when they resume
            return
        if self._fast_passes >= _INLINE_RESUME_FAST:
            log.info("a send took %d ms: the timer's thread leaves the sends to the dispatch threads until they "
                     "are fast again", took)
        self._fast_passes = 0
        self._inline_paused_until = now + took * _INLINE_PAUSE_FACTOR

    # ---- one pass -------------------------------------------------------------------------------

    def dispatch_pass(self) -> int:
        """Send one batch: ready first, then retries that are due, then catch-up backlog; or, with
        nothing to read, what the shaper grants. Returns how many entries it handled."""
        back: DueEntries | None = None
        try:
            held_full, _ = self._held_state(self.clock.now_ms())
            # a gate's pass claims what it took only once it may send (`_through_gate`): until then a
            # late cancel records it (`DispatchQueue.withdraw`)
            taken = None if held_full else self.queue.take(self.config.send_batch_size, claim=self.gate is None)
            if taken is None:
                return self._deliver_granted() if self.shaper is not None and self.held_size() else 0
            back, n = taken
            self._record_withdrawn()
            entries = back if self.gate is None else self._through_gate(self.gate, back)
            if len(entries.due):
                self._send(entries)
                if self.gate is not None:  # unsent, back in the queue, and cancelled late on its way
                    record_put_back(self.queue, self.store, self.clock.now_ms(), entries.refs)
            return n
        except BaseException:
            # Fail-stop: what was taken goes back (the watermark stays before it; a restart or the next
            # holder sends it: duplicates at worst, never a loss), `failed` freezes the watermark, and the
            # error ends the thread, which the engine reports (not ready; the service exits for its supervisor).
            if back is not None:
                self._put_back(back)
            self.failed = True
            log.critical("a dispatch pass failed; what it took is back in the queue and this engine stops "
                         "dispatching", exc_info=True)
            raise
        finally:
            self.queue.clear_in_hand()

    def _put_back(self, e: DueEntries) -> None:
        """Queue entries a failed pass had in hand again (before `clear_in_hand`: always in sight)."""
        self.queue.retry(np.full(len(e.due), self.clock.now_ms() + 1000, np.int64), e)

    def _record_withdrawn(self) -> None:
        """Record as cancelled the entries withdrawn after they came due that this thread dropped."""
        dropped = self.queue.drain_withdrawn()
        if dropped is None:
            return
        self.outcomes.record(Batch([], *dropped), self.clock.now_ms(), CANCELLED, dropped.attempts)

    def release_held(self, refs: np.ndarray) -> None:
        """Queue again, unsent, what the shaper holds among `refs` (cancelled after they came due, on a
        replica that may not send): `DispatchQueue.withdraw` then finds them waiting and records them."""
        if self.shaper is None:
            return
        with self._lock:  # back in the queue before the lock goes: the watermark sees them in one or the other
            out = self._held.take_refs(refs)
            if out is not None:
                self._hold(out, counted=False)

    def earliest_held_due(self) -> int | None:
        """Earliest due time of what the shaper holds (None: nothing)."""
        with self._lock:
            return self._held.earliest_due()

    def _through_gate(self, gate: DeliveryGate, e: DueEntries) -> DueEntries:
        """Record what another replica delivered (due by its watermark) and hold the rest while this
        replica may not send; return what may go on to be sent. What it holds is back in the queue
        before it claims the rest (`DispatchQueue.claim`): a late cancel records each, here or there."""
        elsewhere = e.due <= gate.delivered_elsewhere_up_to()
        if elsewhere.any():
            # due by the holder's watermark: delivered there only if the holder had stored it (its origin)
            cand = np.flatnonzero(elsewhere)
            origins = self.store.read_origins(e.segs[cand], e.parts[cand], e.offsets[cand])
            by_peer = np.asarray(gate.delivered_elsewhere(e.due[cand], origins, self.store.queues.names()), bool)
            elsewhere[cand[~by_peer]] = False
        held = 0
        # A standby reads nothing it could not send: what is left waits whole, unread. Whether a batch
        # that was read may go out is the sink's to decide (`coordination.FencedSink`), right before
        # the send and again at the write.
        if not elsewhere.all() and not gate.may_send():
            held = int((~elsewhere).sum())
            self._hold(e.select(~elsewhere), counted=False)
            e, elsewhere = e.select(elsewhere), elsewhere[elsewhere]
        if self.recovery is not None:  # after may_send: a takeover that let this pass send widens its look-ups
            self.recovery.observe_takeover(int(getattr(gate, "took_over_ms", 0)))
        keep = self.queue.claim(e)  # what a late cancel recorded since the take is left out
        self._record_withdrawn()  # and what it left withdrawn (its record failed) is this thread's to record
        peer = int((elsewhere & keep).sum())
        if peer:
            # attempts 0: delivered, by the replica that held the lease; this one never sent it
            self.outcomes.record(Batch([], *e.select(elsewhere & keep)), self.clock.now_ms(), DELIVERED,
                                 np.zeros(peer, np.int64))
        if peer or held:
            gate.count(peer, held)
        return e.select(~elsewhere & keep)

    def _hold(self, e: DueEntries, *, counted: bool = True) -> None:
        """Queue entries again without counting an attempt: this replica may not send them now
        (`counted`: tell the gate how many, unless the caller does)."""
        gate = self.gate
        hold_ms = gate.hold_ms if gate is not None else self.config.retry_base_ms
        self.queue.retry(np.full(len(e.due), self.clock.now_ms() + hold_ms, np.int64), e)
        if gate is not None and counted:
            gate.count(0, len(e.due))

    def _send(self, e: DueEntries) -> None:
        """Read the due records and send them (through the shaper's queues when there is one)."""
        # the index's due times go along: a record whose own (CRC-checked) due time differs goes at its own
        read = read_bytes if self._record_sink is not None else read_messages
        batch, found = read(self.store, *e)
        now = self.clock.now_ms()
        if found:
            c = self._reschedule_misdated(found, e)
            if len(c):
                self.outcomes.record(Batch([], *e.select(c)), now, CORRUPT, e.attempts[c])
                with self._lock:
                    self.counters.corrupt += len(c)
        if not len(batch):
            return
        if self.shaper is None or (not self._held.size and self.shaper.passes_through()):  # no rule: no queues
            self._deliver(batch)
            return
        with self._lock:
            self._held.add(batch, now)
        self._deliver_granted()

    def _reschedule_misdated(self, corrupt: list[tuple[int, int | None]], e: DueEntries) -> np.ndarray:
        """Queue again, at the record's own due time, each row whose index entry disagrees with its
        intact record (the index has no CRC, the record has); returns the rows really corrupt."""
        rows = np.array([r for r, _ in corrupt], np.int64)
        record_due = np.array([-1 if d is None else d for _, d in corrupt], np.int64)
        m = record_due >= 0
        if m.any():
            log.warning("%d index entries disagree with their intact records: rescheduled at the records' own "
                        "due times", int(m.sum()))
            self.queue.retry(record_due[m], e.select(rows[m])._replace(due=record_due[m]))
        return rows[~m]

    def _deliver_granted(self) -> int:
        """Send what the shaper grants now from the held queues, highest share first.

        Tokens keep coming while a send takes time, so this would go on as long as a throttled
        topic has a backlog: it returns after a send once due messages wait to be read instead,
        so that those of other topics reach the held queues (and the shaper) without waiting.
        """
        shaper = self.shaper
        assert shaper is not None
        sent = 0
        while True:
            now = self.clock.now_ms()
            with self._lock:
                if sent and self._held.size < _MAX_HELD and self.queue.sendable():
                    return sent
                backlog = self._held.sizes()
                if not backlog:
                    return sent
                grants = shaper.grant(backlog, now)
                batch, held_since = self._held.take(grants, self.config.send_batch_size)
                if batch is not None and len(batch.due):  # out of the held queues: the watermark sees it here
                    self.queue.note_in_hand(batch.entries())
                taken = Counter(batch.topic_list()) if batch is not None else Counter()
                for topic, n in grants.items():
                    if n > taken.get(topic, 0):  # not taken (the batch was full): the tokens go back
                        shaper.release(topic, n - taken.get(topic, 0))
            if batch is None:
                return sent
            try:
                self._deliver(batch, held_since)
                if self.gate is not None:  # as `dispatch_pass`'s
                    record_put_back(self.queue, self.store, self.clock.now_ms(), batch.entries().refs)
            except BaseException:
                self._put_back(batch.entries())  # granted maybe passes ago: held nowhere else now
                raise
            sent += len(batch)

    def _deliver(self, b: Batch, held_since: np.ndarray | None = None) -> None:
        """Send one batch through the sink and record every outcome; rows the sink held (a fence:
        `coordination.FencedSink` decides it) go back to the queue without spending an attempt."""
        if self.recovery is not None and b.raw is not None:  # look ambiguous rows up first (timewheel._recovery)
            b, held_since = self._resolved(self.recovery, b, held_since)
            if not len(b):
                return
            self.recovery.note_sending(b.due)
        answers: np.ndarray | None = None
        errors: list[str | None] | None = None
        held: np.ndarray | None = None
        by_topic: Mapping[str, list[int]] | None = None
        try:
            delivered, answers, errors, held, by_topic = self._sink_send(b)
        except Exception as e:
            log.exception("sink failed a batch of %d", len(b))
            delivered, errors = np.zeros(len(b), bool), [f"{type(e).__name__}: {e}"] * len(b)
        if held is not None and held.all():  # fenced before it went: nothing was sent
            self._hold(b.entries())
            if self.shaper is not None:
                for topic, n in Counter(b.topic_list()).items():
                    self.shaper.release(topic, n)
            return
        sent_at = self.clock.now_ms()
        all_ok = all_true(delivered)
        if self.shaper is not None:
            for topic, idx in (by_topic if by_topic is not None else rows_by_topic(b.topic_list())).items():
                ok = len(idx) if all_ok else int(delivered[idx].sum())
                fenced = 0 if held is None else int(held[idx].sum())  # held on the way: no send failed
                waited = 0.0 if held_since is None else float((sent_at - held_since[idx]).sum())
                self.shaper.record(topic, ok, len(idx) - ok - fenced, waited, sent_at)
                if fenced:
                    self.shaper.release(topic, fenced)
        good = b if all_ok else b.select(delivered)
        if len(good.due):
            try:
                self.outcomes.record(good, sent_at, DELIVERED, good.attempts + 1,
                             answers if answers is None or all_ok else answers[delivered])
            except StorageWriteError:
                # Delivered, but the dispatch log could not say so (disk full?): after a restart
                # these are sent again. Counted, and the engine stops: it cannot record outcomes.
                with self._lock:
                    self.counters.dispatch_log_errors += len(good.due)
                raise
            late = sent_at - good.due
            self.lateness.observe(np.maximum(late, 0, out=late))
            with self._lock:
                self.counters.delivered += len(good.due)
        if all_ok and held is None:  # the usual answer: nothing held, nothing failed
            return
        if held is not None and held.any():
            # the lease ran out while the batch was on its way: held for whoever holds the lease,
            # not an attempt that failed
            self._hold(b.select(held).entries())
        failed_rows = ~delivered if held is None else ~delivered & ~held
        if failed_rows.any():
            failed_errors = [errors[i] for i in np.flatnonzero(failed_rows).tolist()] if errors else None
            self.outcomes.fail(b.select(failed_rows), sent_at, failed_errors)

    def _resolved(self, recovery: Recovery, b: Batch, held_since: np.ndarray | None) -> tuple[Batch, np.ndarray | None]:
        """What is left of `b` to send once its ambiguous rows waited or were looked up."""
        now = self.clock.now_ms()
        keep = recovery.resolve(b, now, self.queue.retry,
                                lambda f, answers: self.outcomes.record(f, now, DELIVERED, f.attempts + 1, answers, FOUND_NOTE),
                                lambda u, errors: self.outcomes.fail(u, now, errors))
        if keep.all():
            return b, held_since
        if self.shaper is not None and held_since is not None:  # granted but not sent now: the tokens go back
            for topic, n in Counter(b.select(~keep).topic_list()).items():
                self.shaper.release(topic, n)
        return b.select(keep), None if held_since is None else held_since[keep]

    def _sink_send(self, b: Batch) -> SinkAnswer:
        """One send batch through the sink (`timewheel._sink_send`; raises if the sink fails whole)."""
        return sink_send(self.sink, self._record_sink, b)
