"""A backfilled data set is delivered by the in-process engine, including parts published into
segments the engine has already loaded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import pytest

from spark.backfill import backfill, read_input
from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.spark.conftest import HOUR, T0

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark


class Recorder:
    """A sink that keeps every message with the clock time it was sent at."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.sent: list[tuple[Message, int]] = []

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        self.sent.extend((m, self.clock.now_ms()) for m in messages)
        return [True] * len(messages)


def _rescan(engine: Engine, clock: ManualClock) -> None:
    """Let a rescan interval pass: a driven engine rescans loaded segments only when it steps."""
    clock.advance(int(engine.config.rescan_seconds * 1000))
    engine.step()


def _drive(engine: Engine, clock: ManualClock, until_ms: int) -> None:
    """Step through every wake-up up to `until_ms`."""
    for _ in range(100_000):
        t = engine.next_wakeup_ms()
        if t is None or t > until_ms:
            break
        clock.set(max(t, clock.now_ms()))
        engine.step()
    clock.set(max(until_ms, clock.now_ms()))
    engine.step()


def _rows(prefix: str, dues: list[int]) -> list[dict]:
    return [{"msg_id": f"{prefix}{i}", "topic": "ORDERS", "body": f"{prefix}-{i}", "deliver_at_ms": due,
             "tags": "bf", "keys": [f"key-{i}"], "properties": {"origin": "backfill"}} for i, due in enumerate(dues)]


def test_backfilled_parts_are_delivered_by_the_engine(spark: SparkSession, tmp_path: Path) -> None:
    clock = ManualClock(T0)
    sink = Recorder(clock)
    data = tmp_path / "data"
    engine = Engine(EngineConfig(data_dir=data, rescan_seconds=1.0), sink, clock, seed=1).start(background=False)
    try:
        engine.step()  # the current segment is loaded now
        first = _rows("now", [T0 + 10 * 60_000, T0 + 20 * 60_000]) + _rows("later", [T0 + HOUR + 5, T0 + 4 * HOUR])
        src = tmp_path / "first.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in first))
        clock.set(T0 + 1000)
        assert backfill(spark, data, read_input(spark, [str(src)]), now_ms=clock.now_ms()).scheduled == 4
        _rescan(engine, clock)
        _drive(engine, clock, T0 + HOUR - 60_000)  # the next segment is preloaded by now
        second = _rows("late", [T0 + HOUR + 30 * 60_000, T0 + HOUR - 30_000])
        src2 = tmp_path / "second.jsonl"
        src2.write_text("".join(json.dumps(r) + "\n" for r in second))
        assert backfill(spark, data, read_input(spark, [str(src2)]), now_ms=clock.now_ms()).scheduled == 2
        _rescan(engine, clock)
        _drive(engine, clock, T0 + 5 * HOUR)
    finally:
        engine.stop()
    got = {m.msg_id: (m, at) for m, at in sink.sent}
    assert len(sink.sent) == len(got) == 6
    for row in first + second:
        m, at = got[row["msg_id"]]
        assert at == row["deliver_at_ms"], f"{row['msg_id']} sent at {at}, due {row['deliver_at_ms']}"
        assert (m.topic, m.body, m.tags, tuple(m.keys), dict(m.properties or {})) == (
            "ORDERS", row["body"].encode(), "bf", tuple(row["keys"]), {"origin": "backfill"})


def test_a_backfill_published_after_its_segment_was_marked_done_is_delivered(spark: SparkSession,
                                                                             tmp_path: Path) -> None:
    """The backfill was planned in hour T0 (rows due late in it, and past-due rows moved to "now")
    and published after the hour ended and the timer marked its segment done."""
    clock = ManualClock(T0)
    sink = Recorder(clock)
    data = tmp_path / "data"
    engine = Engine(EngineConfig(data_dir=data, rescan_seconds=1.0), sink, clock, seed=1).start(background=False)
    try:
        _drive(engine, clock, T0 + HOUR + 60_000)
        assert engine.store is not None and T0 in engine.store.meta.done_segments()
        planned_at = T0 + HOUR - 1000
        rows = _rows("late", [T0 + HOUR - 500]) + _rows("past", [T0 - 2 * HOUR])
        src = tmp_path / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert backfill(spark, data, read_input(spark, [str(src)]), now_ms=planned_at, past_due="now").scheduled == 2
        _rescan(engine, clock)
        _drive(engine, clock, clock.now_ms() + 10_000)
    finally:
        engine.stop()
    assert sorted(m.msg_id or "" for m, _ in sink.sent) == ["late0", "past0"]
