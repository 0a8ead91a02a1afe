"""The dispatch queue: what a dispatch thread takes, in which order, and when it is told to wait."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel import ManualClock
from timewheel._due import DueEntries
from timewheel.dispatch_queue import BESIDE_AFTER_MS, FULL_LINGER_RATE, RATE_WINDOW_MS, DispatchQueue, Turn
from tests.timewheel.test_clock_steps import SteppingClock

T0 = 1_800_000_000_000


def _queue(clock: ManualClock, **kw: int) -> tuple[DispatchQueue, list[int]]:
    woken: list[int] = []
    q = DispatchQueue(clock, batch_size=kw.pop("batch_size", 4), catch_up_chunk=kw.pop("catch_up_chunk", 3),
                      wake_timer=lambda: woken.append(clock.now_ms()), **kw)
    return q, woken


def _refs(*r: int) -> np.ndarray:
    return np.array(r, np.uint64)


def _e(due: np.ndarray, refs: np.ndarray, attempts: np.ndarray | None = None) -> DueEntries:
    """Entries located in segment 7, part 1, at offset ref * 10 (so a test can see the location travel)."""
    n = len(due)
    return DueEntries(due, refs, np.zeros(n, np.int16) if attempts is None else attempts, np.full(n, 7, np.int64),
                      np.ones(n, np.uint16), (refs * 10).astype(np.uint32))


def test_take_serves_ready_then_due_retries_then_backlog() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    q.push_backlog(_e(np.array([T0 - 9000], np.int64), _refs(30)))
    q.retry(np.array([T0 + 500], np.int64), _e(np.array([T0 - 100], np.int64), _refs(20), np.array([1], np.int16)))
    q.push_ready(_e(np.array([T0, T0], np.int64), _refs(10, 11)))
    e, n = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [10, 11] and n == 2 and e.attempts.tolist() == [0, 0]
    assert e.segs.tolist() == [7, 7] and e.parts.tolist() == [1, 1] and e.offsets.tolist() == [100, 110]
    e, n = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [30], "a retry waits out its backoff; the backlog goes meanwhile"
    assert q.take(4) is None and q.sizes() == (0, 0, 1) and not q.idle()
    clock.advance(500)
    e, n = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [20] and e.attempts.tolist() == [1] and q.idle()
    assert e.offsets.tolist() == [200], "a retry keeps its location"


def test_cancelled_refs_are_counted_as_taken_but_never_handed_out() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    q.push_ready(_e(np.array([T0] * 3, np.int64), _refs(1, 2, 3)))
    q.cancel(_refs(2))
    taken = q.take(4)
    assert taken is not None
    e, n = taken
    assert e.refs.tolist() == [1, 3] and e.offsets.tolist() == [10, 30] and n == 3


def test_taking_from_the_backlog_wakes_the_timer_only_when_catch_up_waits_for_room() -> None:
    clock = ManualClock(T0)
    q, woken = _queue(clock, catch_up_chunk=3)
    q.push_backlog(_e(np.arange(5, dtype=np.int64), _refs(*range(5))))
    assert not q.backlog_has_room()
    q.take(1)
    assert woken == [], "no past segment waits: nobody to wake"
    q.expect_catch_up(True)
    q.take(1)
    assert woken == [] and not q.backlog_has_room(), "still no room (3 of 3)"
    q.take(1)
    assert woken == [T0] and q.backlog_has_room()


def test_only_a_full_batch_goes_beside_a_send_in_flight() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=2)
    q.push_ready(_e(np.array([T0] * 2, np.int64), _refs(1, 2)))
    assert q.await_turn() is Turn.SEND
    assert q.await_turn() is Turn.SEND, "a full batch does not wait for the send in flight"
    q.take(2)
    q.push_backlog(_e(np.array([T0 - 5000], np.int64), _refs(3)))
    assert q.await_turn() is Turn.LOOK_AGAIN, "a small catch-up backlog waits for a sender to come back"
    q.push_backlog(_e(np.array([T0 - 4000], np.int64), _refs(4)))
    assert q.await_turn() is Turn.SEND, "a full batch of catch-up goes beside the sends in flight"
    q.take(2)
    q.end_turn()
    q.end_turn()
    q.end_turn()
    q.push_backlog(_e(np.array([T0 - 3000], np.int64), _refs(5)))
    assert q.await_turn() is Turn.SEND, "nothing in flight: a small backlog goes at once"


def test_outcomes_counted_by_the_dispatchers_are_taken_once_by_the_timer() -> None:
    q, _ = _queue(ManualClock(T0))
    q.count_done(7, 3)
    q.count_done(8, 1)
    q.count_done(7, 2)
    assert q.take_done() == {7: 5, 8: 1}
    assert q.take_done() == {}


def test_a_small_batch_waits_for_the_send_in_flight_at_most_beside_after_ms() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    q.push_ready(_e(np.array([T0], np.int64), _refs(1)))
    assert q.await_turn() is Turn.SEND  # nothing in flight: it goes
    q.take(4)
    q.push_ready(_e(np.array([T0], np.int64), _refs(2)))
    assert q.await_turn() is Turn.LOOK_AGAIN, "one in flight: the small batch waits to go with the next"
    clock.advance(BESIDE_AFTER_MS)
    assert q.await_turn() is Turn.SEND, "held long enough (a slow send): it goes beside"
    q.end_turn()
    q.end_turn()


def test_a_small_batch_lingers_for_company_until_its_oldest_waited_linger_ms() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, linger_ms=3)
    q.push_ready(_e(np.array([T0], np.int64), _refs(1)))
    assert q.await_turn() is Turn.LOOK_AGAIN
    clock.advance(3)
    assert q.await_turn() is Turn.SEND


def _due_for(q: DispatchQueue, clock: ManualClock, per_s: int, ms: int) -> None:
    """`per_s` entries a second come due for `ms` milliseconds, pushed every millisecond, each taken at once."""
    carry = 0.0
    for _ in range(ms):
        clock.advance(1)
        carry += per_s / 1000
        n, carry = int(carry), carry - int(carry)
        if n:
            q.push_ready(_e(np.full(n, clock.now_ms(), np.int64), _refs(*range(n))))
            q.take(n)


def test_the_linger_grows_with_the_due_rate_and_falls_back_when_quiet() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, linger_ms=2, linger_max_ms=6, batch_size=1000)
    assert q.linger_ms == 2
    _due_for(q, clock, 1000, 2 * RATE_WINDOW_MS)
    assert q.linger_ms == 2, "1,000 a second: less than a millisecond more than the floor"
    _due_for(q, clock, FULL_LINGER_RATE // 2, 2 * RATE_WINDOW_MS)
    assert q.linger_ms == 4, "half the full rate: half way"
    _due_for(q, clock, FULL_LINGER_RATE, 2 * RATE_WINDOW_MS)
    assert q.linger_ms == 6
    _due_for(q, clock, 3 * FULL_LINGER_RATE, 2 * RATE_WINDOW_MS)
    assert q.linger_ms == 6, "never past linger_max_ms"
    q.push_ready(_e(np.array([clock.now_ms()], np.int64), _refs(1)))
    assert q.await_turn() is Turn.LOOK_AGAIN
    clock.advance(5)
    assert q.await_turn() is Turn.LOOK_AGAIN, "under load a small batch waits the longer linger"
    clock.advance(1)
    assert q.await_turn() is Turn.SEND
    q.end_turn()
    q.take(1)
    clock.advance(2 * RATE_WINDOW_MS + 1)
    assert q.linger_ms == 2, "nothing came due for two windows: the short linger at once"
    _due_for(q, clock, 10, RATE_WINDOW_MS)
    assert q.linger_ms == 2


def test_held_messages_stop_reading_and_a_closed_queue_ends_the_threads() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=1)
    q.push_ready(_e(np.array([T0], np.int64), _refs(1)))
    assert q.await_turn(held_full=True, held_wake_ms=T0 + 10) is Turn.LOOK_AGAIN
    assert q.await_turn(held_full=True, held_wake_ms=T0) is Turn.SEND, "the shaper may grant now"
    assert q.next_send_ms(T0, held_full=True) is None and q.next_send_ms(T0, held_full=False) == T0
    q.close()
    assert q.await_turn() is Turn.CLOSED


def test_cancelled_and_withdrawn_refs_are_let_go_when_their_segment_is() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    q.cancel(_refs(1, 2, 3))
    q.withdraw(_refs(4, 5), lambda e: None)  # none waits here: withdrawn for a take to meet
    assert q.cancelled_held() == 5
    assert q.forget(lambda refs: refs <= np.uint64(4)) == 4
    assert q.cancelled_held() == 1
    q.push_ready(_e(np.array([T0] * 3, np.int64), _refs(2, 5, 6)))
    e, n = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [2, 6] and n == 3, "a ref let go is handed out again; one still held is not"


def test_a_withdraw_records_at_once_what_waits_here_and_leaves_the_rest_to_the_take_that_meets_it() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=10)
    q.push_ready(_e(np.array([T0] * 2, np.int64), _refs(1, 2)))
    q.push_backlog(_e(np.array([T0 - 5] * 2, np.int64), _refs(3, 4)))
    q.retry(np.array([T0 + 100], np.int64), _e(np.array([T0 - 9], np.int64), _refs(5)))
    in_hand, n = q.take(1) or (DueEntries.empty(), 0)  # ref 1: a dispatch pass holds it now
    assert in_hand.refs.tolist() == [1] and n == 1
    q.cancel(_refs(4))  # recorded cancelled already
    recorded: list[DueEntries] = []
    assert q.withdraw(_refs(1, 2, 3, 4, 5, 5), recorded.append) == 3
    assert [sorted(e.refs.tolist()) for e in recorded] == [[2, 3, 5]]  # each once, located
    assert recorded[0].offsets.tolist() == [10 * r for r in recorded[0].refs.tolist()]
    q.retry(np.array([T0 + 100], np.int64), in_hand)  # the pass held it again (a standby)
    clock.set(T0 + 100)
    handed: list[int] = []
    taken = 0
    while (got := q.take(10)) is not None:
        handed += got[0].refs.tolist()
        taken += got[1]
    assert handed == [] and taken == 5, "a withdrawn entry is handed out"
    dropped = q.drain_withdrawn()
    assert dropped is not None and dropped.refs.tolist() == [1], "only what this take met is its to record"


def test_a_withdraw_whose_record_fails_leaves_every_entry_withdrawn_for_its_taker() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    q.push_ready(_e(np.array([T0] * 2, np.int64), _refs(1, 2)))

    def full_disk(entries: DueEntries) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        q.withdraw(_refs(1, 2), full_disk)
    e, n = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [] and n == 2
    dropped = q.drain_withdrawn()
    assert dropped is not None and dropped.refs.tolist() == [1, 2]


def test_a_withdraw_records_what_a_pass_took_unclaimed_and_leaves_what_it_claimed_to_the_pass() -> None:
    """A gate's pass takes without claiming and claims only once it may send: a late cancel before the
    claim records the entry at once, and the claim leaves it out; after the claim the entry may be on
    its way to the sink, and only the take that meets it again drops it for its thread to record."""
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=10)
    q.push_ready(_e(np.array([T0] * 4, np.int64), _refs(1, 2, 3, 4)))
    taken, _ = q.take(10, claim=False) or (DueEntries.empty(), 0)
    recorded: list[DueEntries] = []
    assert q.withdraw(_refs(1, 2), recorded.append) == 2
    assert [e.refs.tolist() for e in recorded] == [[1, 2]] and recorded[0].offsets.tolist() == [10, 20]
    assert q.withdraw(_refs(1, 2), recorded.append) == 0  # applied again: recorded already
    keep = q.claim(taken)
    assert taken.refs[keep].tolist() == [3, 4] and q.drain_withdrawn() is None
    assert q.withdraw(_refs(3), recorded.append) == 0  # claimed: maybe on its way to the sink
    assert len(recorded) == 1
    q.retry(np.full(2, T0, np.int64), taken.select(keep))  # the fence held both: back here
    q.clear_in_hand()
    again, n = q.take(10) or (DueEntries.empty(), 0)
    assert again.refs.tolist() == [4] and n == 2
    dropped = q.drain_withdrawn()
    assert dropped is not None and dropped.refs.tolist() == [3]


def test_entries_a_pass_took_unclaimed_and_a_failed_withdraw_left_withdrawn_are_its_own_to_record() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    q.push_ready(_e(np.array([T0] * 2, np.int64), _refs(1, 2)))
    taken, _ = q.take(4, claim=False) or (DueEntries.empty(), 0)

    def full_disk(entries: DueEntries) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        q.withdraw(_refs(1), full_disk)
    assert taken.refs[q.claim(taken)].tolist() == [2]
    dropped = q.drain_withdrawn()
    assert dropped is not None and dropped.refs.tolist() == [1]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=40), st.integers(0, 45), st.integers(1, 3))
def test_the_earliest_retries_set_apart_are_those_a_sort_would_pick(dues: list[int], limit: int,
                                                                     chunks: int) -> None:
    """`earliest_due_apart` partitions instead of sorting: the same bound, and the same entries set
    apart below it (which of several equal to the bound is set apart does not matter: the bound
    keeps every one of them back)."""
    clock = ManualClock(T0)
    q, _ = _queue(clock)
    due = np.array([T0 + d for d in dues], np.int64)
    for part in np.array_split(np.arange(len(due)), chunks):
        if len(part):
            q.retry(due[part] + 5_000, _e(due[part], _refs(*part.tolist())))
    earliest, apart = q.earliest_due_apart(limit)
    order = np.argsort(due, kind="stable")
    bound = int(due[order[limit]]) if len(due) > limit else None
    assert earliest == bound
    assert np.all(np.diff(apart.due) >= 0) and len(apart.due) == min(limit, len(due))
    below = apart.due < bound if bound is not None else np.ones(len(apart.due), bool)
    want = order[:limit] if bound is None else order[:limit][due[order[:limit]] < bound]
    assert sorted(apart.refs[below].tolist()) == sorted(_refs(*want.tolist()).tolist())


def test_the_timer_gets_the_turn_at_once_only_for_a_small_batch_nobody_else_is_on() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=4)
    assert not q.turn_now(), "nothing ready"
    q.push_ready(_e(np.array([T0], np.int64), _refs(1)))
    assert q.turn_now(), "a small ready batch, nobody sending: the caller sends it"
    assert q.await_turn() is Turn.LOOK_AGAIN, "the caller counts as sending: a dispatch thread waits beside it"
    assert not q.turn_now(), "one send at a time"
    q.take(4)
    q.end_turn()
    q.push_ready(_e(np.array([T0] * 4, np.int64), _refs(2, 3, 4, 5)))
    assert not q.turn_now(), "a full batch wakes the dispatch threads, which may send it side by side"
    q.take(4)
    q.push_backlog(_e(np.array([T0 - 9000], np.int64), _refs(6)))
    q.push_ready(_e(np.array([T0], np.int64), _refs(7)))
    assert not q.turn_now(), "a backlog: catch-up stays with the dispatch threads"
    q.take(4)
    q.close()
    q.push_ready(_e(np.array([T0], np.int64), _refs(8)))
    assert not q.turn_now(), "closed"


def test_the_timer_does_not_take_the_turn_while_the_queue_lingers() -> None:
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=100, linger_ms=2)
    q.push_ready(_e(np.array([T0], np.int64), _refs(1)))
    assert not q.turn_now(), "a linger: the batch waits for company on a dispatch thread"
    quiet, _ = _queue(clock, batch_size=100, linger_ms=0, linger_max_ms=6)
    quiet.push_ready(_e(np.array([clock.now_ms()], np.int64), _refs(1)))
    assert quiet.turn_now(), "quiet: no linger, the timer sends"
    busy, _ = _queue(clock, batch_size=100, linger_ms=0, linger_max_ms=6)
    _due_for(busy, clock, FULL_LINGER_RATE, RATE_WINDOW_MS + 1)
    busy.push_ready(_e(np.array([clock.now_ms()], np.int64), _refs(1)))
    assert busy.linger_ms > 0
    assert not busy.turn_now(), "under load the linger grows: the dispatch threads send"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["ready", "backlog", "retry", "hand"])), max_size=40),
       st.integers(0, 45), st.integers(0, 45))
def test_stragglers_anywhere_are_set_apart_with_the_retries(entries: list[tuple[int, str]], limit: int,
                                                            before: int) -> None:
    """With `stragglers_before_ms`, entries due before it that wait ready, in the backlog or in a
    dispatch thread's hands are set apart as retries are: the bound is what a sort of every candidate
    gives, capped by the earliest entry that is no candidate, and the set-apart ones below it are the
    earliest candidates."""
    clock = ManualClock(T0)
    q, _ = _queue(clock, batch_size=1000, catch_up_chunk=1000)
    due = np.array([T0 + d for d, _ in entries], np.int64)
    where = np.array([w for _, w in entries], dtype=object)
    idx = np.arange(len(entries))
    hand = idx[where == "hand"]
    if len(hand):  # taken by this thread and not finished with
        q.push_ready(_e(due[hand], _refs(*hand.tolist())))
        assert q.take(1000) is not None
    for kind, push in (("ready", q.push_ready), ("backlog", q.push_backlog)):
        rows = idx[where == kind]
        if len(rows):
            push(_e(due[rows], _refs(*rows.tolist())))
    rows = idx[where == "retry"]
    if len(rows):
        q.retry(due[rows] + 5_000, _e(due[rows], _refs(*rows.tolist())))
    cut = T0 + before
    candidate = (where == "retry") | (due < cut)
    earliest, apart = q.earliest_due_apart(limit, cut)
    cand = idx[candidate][np.argsort(due[candidate], kind="stable")]
    bounds = [int(due[~candidate].min())] if (~candidate).any() else []
    if len(cand) > limit:
        bounds.append(int(due[cand[limit]]))
    assert earliest == (min(bounds) if bounds else None)
    assert np.all(np.diff(apart.due) >= 0) and len(apart.due) == min(limit, len(cand))
    below = apart.due < earliest if earliest is not None else np.ones(len(apart.due), bool)
    want = cand[:limit] if earliest is None else cand[:limit][due[cand[:limit]] < earliest]
    assert sorted(apart.refs[below].tolist()) == sorted(want.tolist())
    assert q.earliest_due() == (int(due.min()) if len(due) else None)
    q.clear_in_hand()


def test_a_step_back_does_not_lengthen_a_backoff_but_a_hold_until_due_waits_for_the_wall_clock() -> None:
    clock = SteppingClock(T0)
    q, _ = _queue(clock)
    hour = 3_600_000
    q.retry(np.array([T0 + 1000], np.int64), _e(np.array([T0 - 5], np.int64), _refs(1), np.array([1], np.int16)))
    q.hold_until_due(_e(np.array([T0 + 2000], np.int64), _refs(2)))
    # a record rescheduled at its own due time: it waits for that time, as a hold does
    q.retry(np.array([T0 + 3000], np.int64), _e(np.array([T0 + 3000], np.int64), _refs(3)))
    clock.advance(400)
    assert q.take(4) is None  # the queue reads the clock (a waiting dispatch thread does, every 50 ms at most)
    clock.step_back_to(T0 + 400 - hour)
    assert q.take(4) is None
    assert q.next_send_ms(clock.now_ms(), held_full=False) == T0 + 1000 - hour, "the backoff's 600 ms left"
    clock.set(T0 + 1000 - hour)
    e, _ = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [1], "a one-second backoff is one second, however far the clock stepped back"
    assert q.next_send_ms(clock.now_ms(), held_full=False) == T0 + 2000, "due times stay wall-clock instants"
    clock.set(T0 + 2000 - 1)
    assert q.take(4) is None and not q.sendable()
    clock.set(T0 + 3000)
    e, _ = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [2, 3] and q.idle()


def test_steps_back_add_up_and_a_retry_queued_after_one_waits_its_backoff() -> None:
    clock = SteppingClock(T0)
    q, _ = _queue(clock)
    q.retry(np.array([T0 + 5000], np.int64), _e(np.array([T0], np.int64), _refs(1), np.array([1], np.int16)))
    clock.step_back_to(T0 - 60_000)
    assert q.take(4) is None  # the queue reads the clock: the first step is seen
    clock.step_back_to(T0 - 90_000)
    q.retry(np.array([T0 - 90_000 + 1000], np.int64), _e(np.array([T0], np.int64), _refs(2), np.array([1], np.int16)))
    assert q.next_send_ms(clock.now_ms(), held_full=False) == T0 - 90_000 + 1000
    clock.set(T0 - 90_000 + 1000)
    e, _ = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [2]
    clock.set(T0 - 90_000 + 5000)
    e, _ = q.take(4) or (DueEntries.empty(), 0)
    assert e.refs.tolist() == [1] and q.idle()


def test_an_idle_dispatch_thread_waits_to_be_woken_and_one_with_work_ahead_looks_every_max_wait() -> None:
    from timewheel.dispatch_queue import IDLE_WAIT_S, MAX_WAIT_S

    clock = ManualClock(T0)
    q, _ = _queue(clock)
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return False

    q._cv.wait = wait  # type: ignore[method-assign]
    assert q.await_turn() is Turn.LOOK_AGAIN
    assert waits.pop() == IDLE_WAIT_S, "nothing waiting, retrying or held: only a wake-up brings work"
    assert q.await_turn(held_wake_ms=T0 + 5_000) is Turn.LOOK_AGAIN
    assert waits.pop() == MAX_WAIT_S, "the shaper holds messages: it looks again every MAX_WAIT_S"
    q.retry(np.array([T0 + 5_000], np.int64), _e(np.array([T0], np.int64), _refs(1)))
    assert q.await_turn() is Turn.LOOK_AGAIN
    assert waits.pop() == MAX_WAIT_S, "a retry waits: it looks again every MAX_WAIT_S (retry() wakes nobody)"
