"""The dispatcher's record path: a sink with `send_records` is handed stored bytes instead of a
Message each, and every behaviour of the Message path holds: exact times, catch-up, retries and
dead letters, cancels, corrupt records never served, shaping."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Mapping

import pytest

from storage import RecordBytes
from tests.timewheel.conftest import T0, MakeEngine, RecordingSink, drive
from tests.timewheel.test_engine import (  # noqa: F401  (collected here again, with the record sink below)
    test_cancel_by_id_and_key, test_crosses_hour_boundaries_with_preload, test_duplicate_ids_are_scheduled_once,
    test_failed_sends_retry_then_dead_letter, test_late_arrival_into_loaded_segment_and_already_due,
    test_restart_mid_segment_sends_nothing_twice, test_six_hour_downtime_catch_up_oldest_first,
    test_an_index_entry_whose_due_disagrees_with_its_record_is_sent_at_the_records_due)
from timewheel import Engine, EngineConfig, ManualClock, Message, SendResults


class RecordingRecordSink(RecordingSink):
    """`RecordingSink` taking stored records; counts the calls that came that way."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.record_calls = 0

    def send_records(self, records: RecordBytes) -> list[bool]:
        self.record_calls += 1
        assert records.ok.all(), "only good records reach the sink"
        return self.send_batch([Message.from_record(records.record(i)) for i in range(len(records))])


@pytest.fixture
def sink(clock: ManualClock) -> RecordingRecordSink:
    return RecordingRecordSink(clock)


def test_the_records_come_as_bytes_and_a_corrupt_one_is_never_served(make_engine: MakeEngine, clock: ManualClock,
                                                                      sink: RecordingRecordSink) -> None:
    e = make_engine()
    ids = e.schedule([Message("T", f"body-{i}".encode(), T0 + 1000 + i, tags="t", keys=("k",),
                              properties={"p": "v"} if i == 0 else None) for i in range(3)])
    assert e.store is not None
    loc = e.store.meta.locations([ids[1]])[0]
    assert loc is not None
    path = e.store.layout.part_log(loc.segment_ms, loc.part)
    data = bytearray(path.read_bytes())
    data[loc.offset + 60] ^= 0xFF  # inside the record: its CRC no longer matches
    path.write_bytes(bytes(data))
    drive(e, clock, T0 + 5000)
    assert sink.record_calls > 0
    assert [(m, t) for m, t in sink.sent] == [(ids[0], T0 + 1000), (ids[2], T0 + 1002)]
    assert sink.messages[0].properties == {"p": "v"} and sink.messages[1].keys == ("k",)
    st = e.stats().counters
    assert (st.delivered, st.corrupt) == (2, 1)


class TwoAPass:
    """A shaper granting at most two messages of each topic a pass, so that the rest are held."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()

    def grant(self, backlog: Mapping[str, int], now_ms: int) -> dict[str, int]:
        return {t: min(n, 2) for t, n in backlog.items()}

    def next_grant_ms(self, now_ms: int) -> int | None:
        return now_ms + 1

    def release(self, topic: str, n: int) -> None:
        pass

    def record(self, topic: str, sent: int, failed: int, held_ms: float, now_ms: int) -> None:
        self.sent[topic] += sent

    def stats(self) -> dict[str, object]:
        return {}

    def passes_through(self) -> bool:
        return False  # a rule applies: every message through the held queues


def test_held_by_the_shaper_the_records_go_out_all_and_once(tmp_path: Path, clock: ManualClock,
                                                           sink: RecordingRecordSink) -> None:
    shaper = TwoAPass()
    e = Engine(EngineConfig(tmp_path / "data"), sink, clock, shaper=shaper, seed=1).start(background=False)
    try:
        ids = e.schedule([Message(f"T{i % 2}", f"b{i}".encode(), T0 + 1000) for i in range(9)])
        drive(e, clock, T0 + 3000)
        assert sorted(m for m, _ in sink.sent) == sorted(ids)
        assert shaper.sent == Counter({"T0": 5, "T1": 4}) and sink.record_calls >= 3
        assert e.stats().counters.delivered == 9
    finally:
        e.stop()


class CountingPassThrough(TwoAPass):
    """A shaper without a rule that counts each topic's sent and failed messages."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: Counter[str] = Counter()

    def record(self, topic: str, sent: int, failed: int, held_ms: float, now_ms: int) -> None:
        self.sent[topic] += sent
        self.failed[topic] += failed

    def passes_through(self) -> bool:
        return True


class GroupingRecordSink(RecordingRecordSink):
    """Answers with each topic's rows (`SendResults.by_topic`), as the delivery sink does from its cut;
    `wrong`: rows that do not cover the batch, which the dispatcher must not trust."""

    def __init__(self, clock: ManualClock, wrong: bool) -> None:
        super().__init__(clock)
        self.wrong = wrong

    def send_records(self, records: RecordBytes) -> list[bool]:
        ok = super().send_records(records)
        rows: dict[str, list[int]] = {}
        for i, topic in enumerate(records.topics()):
            rows.setdefault(topic, []).append(i)
        if self.wrong:
            rows = {"elsewhere": [0]}
        return SendResults(ok, by_topic=rows)


@pytest.mark.parametrize("wrong", [False, True])
def test_the_shaper_counts_each_topic_from_the_sinks_rows_or_the_batchs_own(tmp_path: Path, clock: ManualClock,
                                                                             wrong: bool) -> None:
    sink = GroupingRecordSink(clock, wrong)
    shaper = CountingPassThrough()
    e = Engine(EngineConfig(tmp_path / "data"), sink, clock, shaper=shaper, seed=1).start(background=False)
    try:
        e.schedule([Message(f"T{i % 3}", f"b{i}".encode(), T0 + 1000) for i in range(10)])
        sink.fail_next = 2  # the first two rows of the first send fail once: T0 and T1
        drive(e, clock, T0 + 1001)
        assert shaper.sent + shaper.failed == Counter({"T0": 4, "T1": 3, "T2": 3})
        assert shaper.failed == Counter({"T0": 1, "T1": 1})
    finally:
        e.stop()
