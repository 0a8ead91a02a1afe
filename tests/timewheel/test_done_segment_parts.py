"""A part published into a segment already marked done (a backfill that finished after the hour
ended, or ran while the engine was stopped) is loaded and sent, by the running timer and at a start;
so is one published into a segment retention retired meanwhile (the segment is made again)."""
from __future__ import annotations

from pathlib import Path

from storage import PartStager, Record, SegmentLayout
from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.timewheel.conftest import T0, RecordingSink, drive

HOUR = 3_600_000


def _publish(layout: SegmentLayout, records: list[Record], enqueue_ms: int) -> None:
    """Stage sealed parts of `records` as the backfill writer does and publish them."""
    staging = layout.root / "_staging" / "job"
    staging.mkdir(parents=True, exist_ok=True)
    stager = PartStager(staging, "t0", layout.segment_ms, enqueue_ms)
    for r in records:
        stager.add(r)
    for p in stager.finish():
        layout.publish_part(p.segment_ms, p.log, p.index)


def _backfilled(n: int, due_ms: int, prefix: str = "bf") -> list[Record]:
    return [Record(f"{prefix}{i}", "T", b"x", due_ms + i) for i in range(n)]


def _engine_with_done_segment(data: Path, clock: ManualClock, sink: RecordingSink) -> tuple[Engine, str]:
    """An engine whose timer sent the one message of segment T0 and marked it done."""
    e = Engine(EngineConfig(data), sink, clock).start(background=False)
    [first] = e.schedule([Message("T", b"a", T0 + 1000, msg_id=f"{1:032X}:00000001")])
    drive(e, clock, T0 + HOUR + 60_000)
    run = e._run
    assert run is not None and e.store is not None
    assert T0 in e.store.meta.done_segments() and T0 not in run.timer.loader.loaded
    return e, first


def test_a_part_published_into_a_done_segment_is_sent_by_the_running_timer(tmp_path: Path,
                                                                           clock: ManualClock) -> None:
    sink = RecordingSink(clock)
    e, first = _engine_with_done_segment(tmp_path / "data", clock, sink)
    try:
        assert e.store is not None
        _publish(e.store.layout, _backfilled(3, T0 + HOUR - 10_000), clock.now_ms())
        drive(e, clock, clock.now_ms() + 3 * int(e.config.rescan_seconds * 1000))
        assert [mid for mid, _ in sink.sent] == [first, "bf0", "bf1", "bf2"]
        drive(e, clock, clock.now_ms() + 60_000)
        assert T0 in e.store.meta.done_segments()  # done again once they were sent
        assert len(sink.sent) == 4
    finally:
        e.stop()


def test_a_part_published_into_a_done_segment_while_stopped_is_sent_at_the_next_start(
        tmp_path: Path, clock: ManualClock) -> None:
    sink = RecordingSink(clock)
    data = tmp_path / "data"
    e, first = _engine_with_done_segment(data, clock, sink)
    e.stop()
    layout = SegmentLayout.open_existing(data)
    _publish(layout, _backfilled(2, T0 + HOUR - 5_000), clock.now_ms())
    again = RecordingSink(clock)
    e2 = Engine(EngineConfig(data), again, clock).start(background=False)
    try:
        drive(e2, clock, clock.now_ms() + 60_000)
        # what was sent before is not sent again: only the published records
        assert [mid for mid, _ in again.sent] == ["bf0", "bf1"]
        assert e2.store is not None and T0 in e2.store.meta.done_segments()
    finally:
        e2.stop()


def test_a_reopened_segment_not_sent_before_a_stop_is_sent_after_the_start(tmp_path: Path,
                                                                         clock: ManualClock) -> None:
    """The rescan clears the mark and loads the segment; the broker is down, and the engine stops
    before the published records are sent: the start loads the segment again."""
    sink = RecordingSink(clock)
    data = tmp_path / "data"
    e, first = _engine_with_done_segment(data, clock, sink)
    try:
        assert e.store is not None
        sink.busy = True
        _publish(e.store.layout, _backfilled(2, T0 + HOUR - 5_000), clock.now_ms())
        drive(e, clock, clock.now_ms() + 3 * int(e.config.rescan_seconds * 1000))
        assert T0 not in e.store.meta.done_segments() and e.stats().retrying == 2
    finally:
        e.stop()
    again = RecordingSink(clock)
    e2 = Engine(EngineConfig(data), again, clock).start(background=False)
    try:
        drive(e2, clock, clock.now_ms() + 60_000)
        assert sorted(mid for mid, _ in again.sent) == ["bf0", "bf1"]
    finally:
        e2.stop()


def test_a_part_published_into_a_segment_retention_retired_is_sent_by_the_running_engine(
        tmp_path: Path, clock: ManualClock) -> None:
    """A backfill that planned before retention retired the segment publishes into it afterwards: the
    publish makes the directory again (`storage.layout`), but with no done mark the timer's rescans
    never looked at it, and its records waited for the next start. Now the housekeeping that retired
    it finds it back and hands it to the timer's catch-up."""
    sink = RecordingSink(clock)
    e = Engine(EngineConfig(tmp_path / "data", retention_hours=1.0), sink, clock).start(background=False)
    try:
        [first] = e.schedule([Message("T", b"a", T0 + 1000, msg_id=f"{1:032X}:00000001")])
        drive(e, clock, T0 + 3 * HOUR)
        run = e._run
        assert run is not None and e.store is not None
        run.housekeeper.run_once()  # a checkpoint, then retention: the done segment goes
        assert T0 not in e.store.layout.list_segments() and run.housekeeper.retired == {T0}
        _publish(e.store.layout, _backfilled(3, T0 + HOUR - 10_000), clock.now_ms())
        assert T0 in e.store.layout.list_segments()
        drive(e, clock, clock.now_ms() + 3 * int(e.config.rescan_seconds * 1000))
        assert [mid for mid, _ in sink.sent] == [first], "sent before housekeeping looked: nothing to test"
        run.housekeeper.run_once()  # the next checkpoint finds the segment back
        drive(e, clock, clock.now_ms() + 60_000)
        assert [mid for mid, _ in sink.sent] == [first, "bf0", "bf1", "bf2"]
        assert run.housekeeper.retired == set() and T0 in e.store.meta.done_segments()
        drive(e, clock, clock.now_ms() + 60_000)
        run.housekeeper.run_once()  # done again: retired again, nothing sent twice
        assert T0 not in e.store.layout.list_segments() and len(sink.sent) == 4
    finally:
        e.stop()
