"""Zero duplicates, the engine's half: after a crash between a send and its record, after a takeover
and after a failed send, each ambiguous entry is looked up before it is sent again; found ones are
recorded delivered and not sent, unknown ones wait (an attempt each), only missing ones go."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pytest

from coordination import FencedSink
from storage import DELIVERED, RETRIED, RecordBytes, ScheduleStore, no_answers, read_dispatch_log
from tests.timewheel.conftest import T0, drive
from tests.timewheel.test_gate import ScriptedGate
from timewheel import CopyCheck, Engine, EngineConfig, ManualClock, Message, SendResults
from timewheel._recovery import FOUND_NOTE, SENT_MARK


class Target:
    """What the target topic holds: every stored copy, by message id."""

    def __init__(self) -> None:
        self.copies: dict[str, int] = {}

    def store(self, msg_id: str) -> None:
        self.copies[msg_id] = self.copies.get(msg_id, 0) + 1


class StoringSink:
    """A record sink that stores on the target; `crash_after` sends, it raises after storing (a
    process killed between the send and its record)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.crash_after: int | None = None
        self.calls = 0

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: object = None) -> list[bool]:
        self.calls += 1
        for i in range(len(records)):
            self.target.store(records.record(i).msg_id)
        if self.crash_after is not None and self.calls >= self.crash_after:
            raise SystemExit("killed after the write")
        return SendResults([True] * len(records), no_answers(len(records)))

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        raise AssertionError("stored records only")


class Finder:
    """A copy finder over the target; `unreachable` makes every answer unknown."""

    quiet_ms = 2000
    clock_skew_ms = 500

    def __init__(self, target: Target) -> None:
        self.target = target
        self.unreachable = False
        self.asked: list[tuple[int, int, int]] = []  # (rows, sent_from, written_before)

    def find_copies(self, records: RecordBytes, sent_from_ms: int, written_before_ms: int) -> CopyCheck:
        self.asked.append((len(records), sent_from_ms, written_before_ms))
        n = len(records)
        if self.unreachable:
            return CopyCheck(np.zeros(n, bool), np.ones(n, bool), None, ["broker-b: unreachable"] * n)
        found = np.array([records.record(i).msg_id in self.target.copies for i in range(n)], bool)
        answers = no_answers(n)
        answers["queue_offset"][found] = 7
        return CopyCheck(found, np.zeros(n, bool), answers, None)


def _engine(path: Path, sink: StoringSink, clock: ManualClock, finder: Finder | None,
            gate: ScriptedGate | None = None) -> Engine:
    return Engine(EngineConfig(path, send_batch_size=10), sink, clock, seed=1, gate=gate,
                  copy_finder=finder).start(background=False)


def _rows(path: Path) -> list[tuple[int, int, str]]:
    """(due, outcome, note) of every dispatch-log row."""
    store = ScheduleStore(path)
    try:
        out = []
        for seg in store.layout.list_segments():
            log = read_dispatch_log(store.layout.dispatch_log(seg))
            out += [(int(r["due_ms"]), int(r["outcome"]), log.notes[k] if k >= 0 else "")
                    for r, k in zip(log.entries, log.note.tolist())]
        return sorted(out)
    finally:
        store.close()


def test_after_a_crash_between_send_and_record_the_copies_are_found_and_not_sent_again(
        tmp_path: Path, clock: ManualClock) -> None:
    target = Target()
    sink = StoringSink(target)
    sink.crash_after = 2  # the second batch is stored, then the process dies before recording it
    e = _engine(tmp_path / "d", sink, clock, Finder(target))
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i // 10 * 100) for i in range(40)])
    with pytest.raises(SystemExit):
        drive(e, clock, T0 + 2_000)
    e.stop()
    assert len(target.copies) == 20 and set(target.copies.values()) == {1}

    finder = Finder(target)
    sink2 = StoringSink(target)
    restart_at = clock.now_ms()
    e2 = _engine(tmp_path / "d", sink2, clock, finder)
    drive(e2, clock, restart_at + finder.quiet_ms - 1)
    assert finder.asked == [] and set(target.copies) < set(ids)  # nothing ambiguous goes before the quiet period
    drive(e2, clock, restart_at + 10_000)
    counts = e2.recovery.snapshot() if e2.recovery else {}
    e2.stop()
    assert set(target.copies) == set(ids) and set(target.copies.values()) == {1}  # each exactly once
    assert counts["found"] == 10 and counts["missing"] == 20 and counts["episodes"] == 1
    # the found ones are recorded delivered with the note, the window began before their due times
    found = [r for r in _rows(tmp_path / "d") if r[2] == FOUND_NOTE]
    assert len(found) == 10 and all(o == DELIVERED for _, o, _ in found)
    assert min(f for _, f, _ in finder.asked) == T0 + 1100 - finder.clock_skew_ms  # the first unrecorded batch


def test_a_step_back_of_the_clock_during_the_quiet_period_does_not_lengthen_it(tmp_path: Path) -> None:
    """The quiet period's end was a wall-clock instant: an hour's step back right after a restart (a
    clock set right by NTP after the engine started) held every ambiguous entry an hour more."""
    from tests.timewheel.test_clock_steps import SteppingClock

    clock = SteppingClock(T0)
    target = Target()
    sink = StoringSink(target)
    sink.crash_after = 2
    e = _engine(tmp_path / "d", sink, clock, Finder(target))
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i // 10 * 100) for i in range(40)])
    with pytest.raises(SystemExit):
        drive(e, clock, T0 + 2_000)
    e.stop()

    finder = Finder(target)
    restart_at = clock.now_ms()
    e2 = _engine(tmp_path / "d", StoringSink(target), clock, finder)
    drive(e2, clock, restart_at + 500)  # the ambiguous entries wait for the quiet period
    assert finder.asked == []
    back = clock.now_ms() - 3_600_000
    clock.step_back_to(back)  # an hour back
    drive(e2, clock, back + finder.quiet_ms + 10_000)
    counts = e2.recovery.snapshot() if e2.recovery else {}
    e2.stop()
    assert finder.asked, "the look-ups waited out the step"
    assert set(target.copies) == set(ids) and set(target.copies.values()) == {1}  # each exactly once
    assert counts["found"] == 10 and counts["missing"] == 20


def test_the_sent_mark_bounds_the_ambiguous_set_so_a_late_backlog_is_not_looked_up(
        tmp_path: Path, clock: ManualClock) -> None:
    target = Target()
    e = _engine(tmp_path / "d", StoringSink(target), clock, Finder(target))
    e.schedule([Message("T", b"early", T0 + 1000)])
    drive(e, clock, T0 + 1_500)
    mark = e.store.meta.get_document(SENT_MARK) if e.store else None
    e.stop()
    assert mark == T0 + 1000 + 1000  # persisted a second ahead of what was handed to the sink
    late = Engine(EngineConfig(tmp_path / "d"), StoringSink(target), clock).start(background=False)
    late.schedule([Message("T", b"later", T0 + 60_000)])
    late.stop()
    clock.set(T0 + 120_000)  # down for two minutes; the backlog came due meanwhile
    finder = Finder(target)
    e3 = _engine(tmp_path / "d", StoringSink(target), clock, finder)
    drive(e3, clock, T0 + 130_000)
    e3.stop()
    assert finder.asked == [] and set(target.copies.values()) == {1}


def test_an_unknown_answer_spends_an_attempt_and_is_looked_up_again_until_the_broker_answers(
        tmp_path: Path, clock: ManualClock) -> None:
    target = Target()
    sink = StoringSink(target)
    sink.crash_after = 1
    e = _engine(tmp_path / "d", sink, clock, Finder(target))
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000) for i in range(5)])
    with pytest.raises(SystemExit):
        drive(e, clock, T0 + 1_500)
    e.stop()
    finder = Finder(target)
    finder.unreachable = True
    e2 = _engine(tmp_path / "d", StoringSink(target), clock, finder)
    drive(e2, clock, clock.now_ms() + 4_000)
    assert len(finder.asked) >= 1 and e2.recovery and e2.recovery.counters.unknown >= 5
    # never sent by this run: asked about what was written before the quiet period ended, each time
    # (a broker trusted only a while after the writes is trusted once that while is over)
    assert {w for _, _, w in finder.asked} == {e2.recovery.quiet_until_ms}
    finder.unreachable = False
    drive(e2, clock, clock.now_ms() + 60_000)
    e2.stop()
    assert set(target.copies) == set(ids) and set(target.copies.values()) == {1}
    outcomes = [o for _, o, _ in _rows(tmp_path / "d")]
    assert outcomes.count(RETRIED) >= 5 and outcomes.count(DELIVERED) == 5


def test_after_a_takeover_what_is_due_up_to_it_is_looked_up_and_the_rest_is_sent_on_time(
        tmp_path: Path, clock: ManualClock) -> None:
    target = Target()
    gate = ScriptedGate()
    finder = Finder(target)
    sink = StoringSink(target)
    e = _engine(tmp_path / "d", sink, clock, finder, gate)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 100) for i in range(60)])  # due 1.0..6.9 s
    for i in range(0, 30, 2):  # the previous holder sent every other one due up to 3.9 s, never recorded here
        target.store(ids[i])
    drive(e, clock, T0 + 4_000)
    gate.open = True
    gate.took_over_ms = T0 + 4_000
    drive(e, clock, T0 + 20_000)
    counts = e.recovery.snapshot() if e.recovery else {}
    e.stop()
    assert set(target.copies) == set(ids) and set(target.copies.values()) == {1}
    assert counts["found"] == 15 and counts["episodes"] == 1
    # looked up: due by the takeover plus the skew (4.5 s); due later: sent on time, no look-up
    assert counts["looked_up"] == 36


def test_without_a_finder_nothing_is_looked_up_and_a_crash_sends_copies_again(tmp_path: Path,
                                                                              clock: ManualClock) -> None:
    target = Target()
    sink = StoringSink(target)
    sink.crash_after = 1
    e = _engine(tmp_path / "d", sink, clock, None)
    e.schedule([Message("T", str(i).encode(), T0 + 1000) for i in range(5)])
    with pytest.raises(SystemExit):
        drive(e, clock, T0 + 1_500)
    e.stop()
    e2 = _engine(tmp_path / "d", StoringSink(target), clock, None)
    drive(e2, clock, clock.now_ms() + 5_000)
    e2.stop()
    assert set(target.copies.values()) == {2}  # at-least-once: the negative control


class WrittenTarget(Target):
    """A target that also keeps when each copy was written (by the engine's clock)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self.clock = clock
        self.written: dict[str, list[int]] = {}

    def store(self, msg_id: str) -> None:
        super().store(msg_id)
        self.written.setdefault(msg_id, []).append(self.clock.now_ms())


class ProvenOnlyFinder(Finder):
    """The least a finder must see: only the copies written before `written_before_ms` (an index that
    lags the writes, as a busy broker's does, shows what a barrier proved and nothing newer)."""

    target: WrittenTarget

    def find_copies(self, records: RecordBytes, sent_from_ms: int, written_before_ms: int) -> CopyCheck:
        self.asked.append((len(records), sent_from_ms, written_before_ms))
        n = len(records)
        found = np.array([any(t < written_before_ms for t in self.target.written.get(records.record(i).msg_id, ()))
                          for i in range(n)], bool)
        return CopyCheck(found, np.zeros(n, bool), no_answers(n), None)


class TimingOutSink(StoringSink):
    """Stores every record a few ms after the call, then answers the first `time_outs` calls failed: a
    request that timed out although the broker stored it."""

    def __init__(self, target: WrittenTarget, clock: ManualClock, time_outs: int) -> None:
        super().__init__(target)
        self.clock = clock
        self.time_outs = time_outs

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: object = None) -> list[bool]:
        self.clock.advance(5)  # on its way to the broker
        super().send_records(records, extra, fence)
        n = len(records)
        if self.time_outs:
            self.time_outs -= 1
            return SendResults([False] * n, errors=["RequestTimeoutError: no answer in time"] * n)
        return SendResults([True] * n, no_answers(n))


class DyingSink(StoringSink):
    """The process dies as it hands a batch over, before anything reaches the broker."""

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: object = None) -> list[bool]:
        raise SystemExit("killed before the write")


def test_a_restarts_ambiguous_message_whose_send_times_out_is_looked_up_past_that_send_not_sent_twice(
        tmp_path: Path, clock: ManualClock) -> None:
    """After a restart a message due before the sent mark is looked up, found missing and sent; that
    send times out although the broker stored it. Its next look-up must cover the copy this run wrote
    (a barrier from now, as for any message with an attempt spent), not only what the previous run
    wrote before the quiet period ended: else a lagging index says missing and it goes out twice."""
    target = WrittenTarget(clock)
    e = _engine(tmp_path / "d", DyingSink(target), clock, Finder(target))
    [mid] = e.schedule([Message("T", b"x", T0 + 1000)])
    with pytest.raises(SystemExit):
        drive(e, clock, T0 + 1_500)
    e.stop()
    assert target.copies == {}  # due at or before the sent mark, so ambiguous after the restart

    finder = ProvenOnlyFinder(target)
    e2 = _engine(tmp_path / "d", TimingOutSink(target, clock, time_outs=1), clock, finder)
    drive(e2, clock, clock.now_ms() + 60_000)
    counts = e2.recovery.snapshot() if e2.recovery else {}
    e2.stop()
    assert target.copies == {mid: 1}, f"sent {target.copies.get(mid)} times; look-ups: {finder.asked}"
    assert counts["found"] == 1 and counts["missing"] == 1
    first, second = (w for _, _, w in finder.asked)
    assert first == counts["quiet_until_ms"] < target.written[mid][0] < second
    assert [o for _, o, _ in _rows(tmp_path / "d")] == [DELIVERED, RETRIED]


class TakingOverGate(ScriptedGate):
    """A standby that becomes the holder while a dispatch pass runs: between the pass's read of the
    watermark and its look at `may_send`."""

    take_over_at: int | None = None

    def delivered_elsewhere_up_to(self) -> int:
        if self.take_over_at is not None:
            self.took_over_ms, self.open, self.take_over_at = self.take_over_at, True, None
        return super().delivered_elsewhere_up_to()


def test_a_takeover_during_a_dispatch_pass_still_looks_up_what_the_last_holder_may_have_sent(
        tmp_path: Path, clock: ManualClock) -> None:
    # the pass read the takeover time before the takeover and may_send after it: it sent the last
    # holder's batch in flight again without a look-up
    target = Target()
    gate = TakingOverGate()
    finder = Finder(target)
    sink = StoringSink(target)
    e = _engine(tmp_path / "d", sink, clock, finder, gate)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 100) for i in range(10)])
    for i in range(10):  # the previous holder sent all of them, and paused before its next mark
        target.store(ids[i])
    drive(e, clock, T0 + 2_900)
    gate.take_over_at = T0 + 2_900
    drive(e, clock, T0 + 20_000)
    e.stop()
    assert set(target.copies.values()) == {1}, {m: n for m, n in target.copies.items() if n > 1}


class Toggle:
    """The replica's fence, opened and closed by the test."""

    open = True

    def __call__(self) -> bool:
        return self.open


class LeaseLostOnTheWaySink(StoringSink):
    """Stores the batch, then the fence closes while the answer is awaited and the request times out:
    the broker has the copies, this replica's fence is down when the failure comes back."""

    def __init__(self, target: Target, fence: Toggle) -> None:
        super().__init__(target)
        self.fence = fence
        self.time_outs = 1

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: object = None) -> list[bool]:
        results = super().send_records(records, extra, fence)
        if not self.time_outs:
            return results
        self.time_outs -= 1
        self.fence.open = False  # the lease deadline passed while the request was on its way
        n = len(records)
        return SendResults([False] * n, errors=["RequestTimeoutError: no answer in time"] * n)


def test_a_send_that_timed_out_as_the_fence_closed_is_looked_up_before_the_fence_opens_it_again(
        tmp_path: Path, clock: ManualClock) -> None:
    # the fence held every failed row of a batch it closed after: a request that was written and timed
    # out went back without an attempt, skipped the look-up, and went out a second time once the
    # same replica's fence opened again in the same epoch
    target, fence = Target(), Toggle()
    finder = Finder(target)
    sink = FencedSink(LeaseLostOnTheWaySink(target, fence), fence)
    e = Engine(EngineConfig(tmp_path / "d", send_batch_size=10), sink, clock, seed=1, copy_finder=finder).start(
        background=False)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000) for i in range(3)])
    drive(e, clock, T0 + 1_500)
    assert target.copies == {m: 1 for m in ids} and not fence.open
    drive(e, clock, T0 + 5_000)  # fenced: nothing goes
    fence.open = True  # a confirmation came: the same replica, the same epoch
    drive(e, clock, T0 + 30_000)
    counts = e.recovery.snapshot() if e.recovery else {}
    e.stop()
    assert target.copies == {m: 1 for m in ids}, f"look-ups: {finder.asked}"
    assert counts["found"] == 3 and len(finder.asked) >= 1
