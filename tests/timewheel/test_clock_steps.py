"""The wall clock stepping back (an NTP step, a VM restored from a snapshot) under a running engine.

Due times are wall-clock instants, so a message stored before the step goes when the clock reaches
its due time again. But the wheel had turned to the old time: a message arriving after the step,
due between the new now and the wheel's turn, was behind the turn and went at once, up to the size
of the step early. Now it waits in the dispatch queue for its due time.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.timewheel.conftest import T0, RecordingSink, drive

MIN = 60_000


class SteppingClock(ManualClock):
    """A manual clock that may also be set back, as a wall clock can be."""

    def step_back_to(self, now_ms: int) -> None:
        with self._lock:
            self._now = now_ms


#: where the engine ran to before the clock steps back
OLD_NOW = T0 + 150 * MIN


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Engine, SteppingClock, RecordingSink]]:
    """An engine driven by hand to OLD_NOW on a clock that can step back."""
    clock = SteppingClock(T0)
    sink = RecordingSink(clock)
    e = Engine(EngineConfig(tmp_path / "data"), sink, clock).start(background=False)
    try:
        drive(e, clock, OLD_NOW)
        yield e, clock, sink
    finally:
        e.stop()


@pytest.mark.parametrize("back_ms", [20 * MIN, 2 * 60 * MIN + 10 * MIN], ids=["20 min", "2 h 10 min"])
def test_a_message_due_after_a_step_back_goes_at_its_due_time_not_at_once(
        running: tuple[Engine, SteppingClock, RecordingSink], back_ms: int) -> None:
    e, clock, sink = running
    [before] = e.schedule([Message("T", b"a", OLD_NOW + 10_000, msg_id=f"{1:032X}:00000001")])
    new_now = OLD_NOW - back_ms
    clock.step_back_to(new_now)
    e.step()
    [after] = e.schedule([Message("T", b"b", new_now + 5_000, msg_id=f"{2:032X}:00000001")])
    e.step()
    assert sink.sent == [], "sent before its due time"
    drive(e, clock, new_now + 4_999)
    assert sink.sent == [], "sent before its due time"
    drive(e, clock, new_now + 5_000)
    assert sink.sent == [(after, new_now + 5_000)]
    drive(e, clock, OLD_NOW + 10_000)
    assert sink.sent == [(after, new_now + 5_000), (before, OLD_NOW + 10_000)]


def test_a_step_back_is_logged_once_not_per_commit(running: tuple[Engine, SteppingClock, RecordingSink],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    e, clock, sink = running
    new_now = OLD_NOW - 20 * MIN
    clock.step_back_to(new_now)
    e.step()
    with caplog.at_level("WARNING", logger="timewheel"):
        for i in range(5):
            e.schedule([Message("T", b"x", new_now + 5_000 + i, msg_id=f"{10 + i:032X}:00000001")])
            e.step()
    steps = [r for r in caplog.records if "behind the timer's last turn" in r.getMessage()]
    assert len(steps) == 1, [r.getMessage() for r in steps]
    further = new_now - 10 * MIN  # a second step back while still behind the same turn: logged again
    clock.step_back_to(further)
    with caplog.at_level("WARNING", logger="timewheel"):
        e.schedule([Message("T", b"y", further + 5_000, msg_id=f"{20:032X}:00000001")])
        e.step()
    steps = [r for r in caplog.records if "behind the timer's last turn" in r.getMessage()]
    assert len(steps) == 2 and f"is {30 * MIN + 1} ms behind" in steps[1].getMessage(), [r.getMessage() for r in steps]
    drive(e, clock, new_now + 5_004)
    assert len(sink.sent) == 6


@pytest.mark.parametrize("back_ms", [60 * MIN, 2 * 60 * MIN + 10 * MIN], ids=["1 h", "2 h 10 min"])
def test_a_retry_after_a_step_back_waits_its_backoff_not_the_step(
        running: tuple[Engine, SteppingClock, RecordingSink], back_ms: int) -> None:
    e, clock, sink = running
    due = OLD_NOW + 10_000
    [msg] = e.schedule([Message("T", b"r", due, msg_id=f"{3:032X}:00000001")])
    sink.fail_next = 1
    drive(e, clock, due)
    assert sink.sent == [] and e.stats().retrying == 1, "the first attempt failed: it waits its backoff"
    new_now = due - back_ms
    clock.step_back_to(new_now)
    e.step()
    # the backoff is retry_base_ms (1 s) with +-20% jitter: over 1.2 s after the failure at the latest
    drive(e, clock, new_now + 1_200)
    assert [m for m, _ in sink.sent] == [msg], "the retry waited for the wall clock to come back, not its backoff"
    [(_, sent_at)] = sink.sent
    assert new_now + 800 <= sent_at <= new_now + 1_200
