"""The timer not running for a while (a paused process, a suspended VM, the wall clock stepped forward).

The timer loads a segment when it is current, or `preload_seconds` before. A pass after a pause
that spans a whole segment never saw that segment current: it is past, so it is caught up as the
past segments found at a start are. A pass after a pause longer than the wheel spans past its turn
loads segments reaching beyond its horizon: the wheel turns to now first.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.timewheel.conftest import T0, MakeEngine, RecordingSink, drive

SEC = 1_000
MIN = 60_000
HOUR = 3_600_000


def settle(e: Engine, clock: ManualClock) -> None:
    """Step at the clock's time until nothing more is due at it (the clock does not move)."""
    for _ in range(1000):
        e.step()
        if e.next_wakeup_ms() != clock.now_ms():
            return
    raise AssertionError(f"the engine spins at {clock.now_ms()}: {e.stats()}")


def test_a_segment_passed_while_the_timer_was_paused_is_sent(make_engine: MakeEngine, clock: ManualClock,
                                                             sink: RecordingSink) -> None:
    e = make_engine()
    [a] = e.schedule([Message("T", b"a", T0 + HOUR + 30 * MIN)])
    e.step()
    clock.set(T0 + 2 * HOUR + 10 * MIN)  # paused through the whole hour of T0 + 1 h
    settle(e, clock)
    assert sink.sent == [(a, T0 + 2 * HOUR + 10 * MIN)]


def test_the_watermark_does_not_pass_a_segment_the_timer_has_not_sent(make_engine: MakeEngine, clock: ManualClock,
                                                                      sink: RecordingSink) -> None:
    e = make_engine()
    due = T0 + HOUR + 30 * MIN
    [a] = e.schedule([Message("T", b"a", due)])
    e.step()
    clock.set(T0 + 2 * HOUR + 10 * MIN)
    sink.busy = True  # nothing can be sent: the message stays undelivered
    e.step()
    assert sink.sent == []
    assert e.delivered_up_to() < due, "the watermark says a message that was never sent is done"
    sink.busy = False
    drive(e, clock, T0 + 3 * HOUR)
    assert [mid for mid, _ in sink.sent] == [a]


def test_a_pause_past_the_wheel_horizon_does_not_stop_the_timer(make_engine: MakeEngine, clock: ManualClock,
                                                                sink: RecordingSink) -> None:
    e = make_engine(preload_seconds=120)
    a, b = e.schedule([Message("T", b"a", T0 + HOUR + 30 * MIN), Message("T", b"b", T0 + 2 * HOUR + 30 * MIN)])
    e.step()
    # paused until the preload of T0 + 2 h: its segment reaches past what the wheel spans from T0
    resumed = T0 + 2 * HOUR - 60 * SEC
    clock.set(resumed)
    settle(e, clock)
    assert sink.sent == [(a, resumed)]
    drive(e, clock, T0 + 3 * HOUR)
    assert sink.sent == [(a, resumed), (b, T0 + 2 * HOUR + 30 * MIN)]


#: due offsets from the step they are scheduled at: on a slot, a segment, the preload, past due, far
_DUE = st.one_of(st.integers(-3 * MIN, 5 * MIN),
                 st.sampled_from([-MIN, -1, 0, 1, 99, 100, 101, 10 * SEC, 50 * SEC, MIN - 1, MIN, MIN + 1,
                                  2 * MIN, 2 * MIN + 30 * SEC, 3 * MIN + 50 * SEC, 5 * MIN]))
#: how far the clock moves between two steps: 0, a ms, a slot, a segment, the wheel's span, more
_JUMP = st.one_of(st.integers(0, 4 * MIN),
                  st.sampled_from([0, 1, 99, 100, 101, MIN - 1, MIN, MIN + 1, 2 * MIN + 10 * SEC,
                                   2 * MIN + 10 * SEC + 200, 2 * MIN + 50 * SEC, 3 * MIN, 7 * MIN]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.tuples(st.just("schedule"), _DUE), st.tuples(st.just("jump"), _JUMP)),
                    min_size=1, max_size=30))
def test_every_message_goes_once_at_the_first_step_at_or_after_its_due_time(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]]) -> None:
    """Steps only at the times the clock jumps to (never at the wake-ups between): whatever the
    timer skipped, each message goes once, at the first step at or after its due time, and the
    watermark never passes one not sent."""
    clock = ManualClock(T0)
    sink = RecordingSink(clock)
    cfg = EngineConfig(tmp_path_factory.mktemp("pause"), tick_ms=100, segment_minutes=1, preload_seconds=10)
    e = Engine(cfg, sink, clock, seed=0).start(background=False)
    due_of: dict[str, int] = {}
    first_step: dict[str, int] = {}  # the earliest time a step could send it: due, or when scheduled
    steps: list[int] = []
    try:
        settle(e, clock)
        for i, (op, n) in enumerate(ops):
            if op == "schedule":
                due = max(0, clock.now_ms() + n)
                [mid] = e.schedule([Message("T", b"x", due, msg_id=f"m{i}")])
                due_of[mid], first_step[mid] = due, max(due, clock.now_ms())
            else:
                clock.advance(n)
            settle(e, clock)
            steps.append(clock.now_ms())
            sent = {m for m, _ in sink.sent}
            mark = e.delivered_up_to()
            assert all(d > mark for m, d in due_of.items() if m not in sent), (mark, due_of, sink.sent)
        clock.advance(8 * MIN)
        settle(e, clock)
        steps.append(clock.now_ms())
    finally:
        e.stop()
    assert sorted(m for m, _ in sink.sent) == sorted(due_of), "lost or sent twice"
    for mid, at in sink.sent:
        assert at == min(t for t in steps if t >= first_step[mid]), (mid, due_of[mid], at, steps)


def test_a_first_pass_long_after_the_start_catches_up_the_segment_it_started_in(tmp_path: Path, clock: ManualClock,
                                                                                sink: RecordingSink) -> None:
    cfg = EngineConfig(tmp_path / "d")
    first = Engine(cfg, sink, clock).start(background=False)
    [a] = first.schedule([Message("T", b"a", T0 + 30 * MIN)])
    first.stop()
    e = Engine(cfg, sink, clock).start(background=False)  # stored before this start: no commit tells of it
    try:
        clock.set(T0 + HOUR + 5 * MIN)  # the first pass, an hour after the start
        settle(e, clock)
        assert sink.sent == [(a, T0 + HOUR + 5 * MIN)]
    finally:
        e.stop()
