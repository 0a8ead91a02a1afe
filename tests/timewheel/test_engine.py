"""The engine against a heapq reference, across hour boundaries, restarts, cancels and downtime."""
from __future__ import annotations

import heapq
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import summarize
from timewheel import Engine, EngineConfig, InvalidMessageError, ManualClock, Message
from tests.timewheel.conftest import T0, MakeEngine, RecordingSink, drive

MIN = 60_000
HOUR = 3_600_000


def _reference(ops: list[tuple], tick: int) -> list[tuple[str, int]]:
    """What a perfect delay queue releases: each message once at max(due, scheduled time), unless
    cancelled before it was due."""
    heap: list[tuple[int, str]] = []
    cancelled: dict[str, int] = {}
    for op in ops:
        if op[0] == "schedule":
            _, t, mid, due = op
            heapq.heappush(heap, (max(due, t), mid))
        elif op[0] == "cancel":
            _, t, mid = op
            cancelled.setdefault(mid, t)
    due_of = {op[2]: op[3] for op in ops if op[0] == "schedule"}
    out = []
    while heap:
        at, mid = heapq.heappop(heap)
        c = cancelled.get(mid)
        if c is not None and c < due_of[mid]:
            continue
        out.append((mid, at))
    return sorted(out, key=lambda x: (x[1], x[0]))


@st.composite
def scenarios(draw: st.DrawFn) -> list[tuple]:
    """Timed operations over ~4 one-minute segments: schedules, cancels, restarts."""
    n = draw(st.integers(1, 25))
    ops: list[tuple] = []
    for i in range(n):
        t = T0 + draw(st.integers(0, 4 * MIN))
        due = t + draw(st.one_of(st.integers(-2000, 0), st.integers(0, 3 * MIN), st.sampled_from([0, 1, 99, 100, MIN])))
        ops.append(("schedule", t, f"m{i}", max(due, 0)))
    for _ in range(draw(st.integers(0, 5))):
        target = draw(st.sampled_from(ops))
        if target[0] != "schedule":
            continue
        _, t, mid, due = target
        # cancels are promised one tick ahead; also try ones after delivery (they must do nothing)
        when = draw(st.sampled_from([t, max(t, due - 100 - draw(st.integers(0, 5000))), due + 1, due + 500]))
        if when >= t and (when <= due - 100 or when > due):
            ops.append(("cancel", when, mid))
    for _ in range(draw(st.integers(0, 3))):
        ops.append(("restart", T0 + draw(st.integers(0, 5 * MIN))))
    ops.sort(key=lambda o: (o[1], {"schedule": 0, "cancel": 1, "restart": 2}[o[0]]))
    return ops


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(ops=scenarios())
def test_engine_matches_heapq_reference(tmp_path_factory: pytest.TempPathFactory, ops: list[tuple]) -> None:
    data_dir = tmp_path_factory.mktemp("prop")
    clock = ManualClock(T0)
    sink = RecordingSink(clock)
    cfg = EngineConfig(data_dir, tick_ms=100, segment_minutes=1, preload_seconds=10)
    engine = Engine(cfg, sink, clock, seed=0).start(background=False)
    try:
        for op in ops:
            drive(engine, clock, op[1])
            if op[0] == "schedule":
                engine.schedule([Message("T", b"x", op[3], msg_id=op[2])])
            elif op[0] == "cancel":
                engine.cancel(msg_id=op[2])
            else:
                engine.stop()
                engine = Engine(cfg, sink, clock, seed=0).start(background=False)
            engine.step()
        drive(engine, clock, T0 + 10 * MIN)
    finally:
        engine.stop()
    got = sorted(sink.sent, key=lambda x: (x[1], x[0]))
    assert got == _reference(ops, 100)


def test_crosses_hour_boundaries_with_preload(make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink) -> None:
    e = make_engine(preload_seconds=60)
    dues = [T0 + HOUR - 1, T0 + HOUR, T0 + HOUR + 1, T0 + 2 * HOUR + 250, T0 + 5 * HOUR + 17]
    ids = e.schedule([Message("T", b"x", d) for d in dues])
    drive(e, clock, T0 + HOUR - 60_001)
    assert not sink.sent and str(T0 + HOUR) not in e.stats().loaded_segments
    drive(e, clock, T0 + HOUR - 60_000)  # preload point of the next hour
    assert str(T0 + HOUR) in e.stats().loaded_segments
    drive(e, clock, T0 + 6 * HOUR)
    assert sink.sent == list(zip(ids, dues))


def test_late_arrival_into_loaded_segment_and_already_due(make_engine: MakeEngine, clock: ManualClock,
                                                          sink: RecordingSink) -> None:
    e = make_engine()
    drive(e, clock, T0 + 1000)
    [a] = e.schedule([Message("T", b"a", T0 + 5000)])  # current segment, already loaded
    [b] = e.schedule([Message("T", b"b", T0 - 50_000)])  # already due
    e.step()
    assert sink.sent == [(b, T0 + 1000)]
    drive(e, clock, T0 + 10_000)
    assert sink.sent == [(b, T0 + 1000), (a, T0 + 5000)]


def test_restart_mid_segment_sends_nothing_twice(tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    cfg = EngineConfig(tmp_path / "d")
    e = Engine(cfg, sink, clock).start(background=False)
    ids = e.schedule([Message("T", str(i).encode(), T0 + i * 1000) for i in range(100)])
    drive(e, clock, T0 + 49_500)
    assert len(sink.sent) == 50
    e.stop()
    e = Engine(cfg, sink, clock).start(background=False)
    drive(e, clock, T0 + 200_000)
    e.stop()
    assert [m for m, _ in sink.sent] == ids
    assert [t for _, t in sink.sent] == [T0 + i * 1000 for i in range(100)]


def test_six_hour_downtime_catch_up_oldest_first(tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    cfg = EngineConfig(tmp_path / "d", catch_up_chunk=50)
    e = Engine(cfg, sink, clock).start(background=False)
    ids = e.schedule([Message("T", b"x", T0 + HOUR // 2 + i * (HOUR // 10)) for i in range(70)])
    e.stop()  # down from T0 until T0 + 6 h
    clock.set(T0 + 6 * HOUR + 1)
    e = Engine(cfg, sink, clock).start(background=False)
    drive(e, clock, T0 + 6 * HOUR + 1)
    late = [m for m, _ in sink.sent]
    caught_up = [i for i in ids if i in set(late)]
    assert late == caught_up, "catch-up must deliver the oldest first"
    assert len(sink.sent) == 56  # everything due before T0+6h, none twice
    assert e.stats().counters.catch_up_segments >= 5
    drive(e, clock, T0 + 8 * HOUR)
    assert sorted(m for m, _ in sink.sent) == sorted(ids)
    e.stop()
    assert e.store is not None
    totals = summarize(e.store.layout)["totals"]
    assert isinstance(totals, dict) and (totals["dispatched"], totals["pending"]) == (70, 0)


def test_cancel_by_id_and_key(make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink) -> None:
    e = make_engine()
    a, b, c = e.schedule([Message("T", b"a", T0 + 10_000, keys=("order-1",)),
                          Message("T", b"b", T0 + 2 * HOUR, keys=("order-1",)),
                          Message("T", b"c", T0 + 20_000)])
    assert e.cancel(key="order-1") == 2
    assert e.cancel(msg_id=a) == 0  # already cancelled
    drive(e, clock, T0 + 20_000)
    assert e.cancel(msg_id=c) == 0  # already delivered
    drive(e, clock, T0 + 3 * HOUR)
    assert [m for m, _ in sink.sent] == [c]
    assert e.stats().counters.cancelled == 2


def test_failed_sends_retry_then_dead_letter(make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink) -> None:
    parked: list[tuple[str, str]] = []

    class DLQ:
        def dead_letter(self, messages, reason):
            parked.extend((m.msg_id, reason) for m in messages)

    e = make_engine(max_attempts=3, retry_base_ms=100, retry_max_ms=1000)
    e.dead_letter_sink = DLQ()
    ok, bad = e.schedule([Message("T", b"ok", T0 + 1000), Message("T", b"bad", T0 + 2000)])
    sink.fail_next = 1  # the first send of `ok` fails once, then succeeds
    drive(e, clock, T0 + 1500)
    assert [m for m, _ in sink.sent] == [ok]
    sink.busy = True  # every send of `bad` fails
    drive(e, clock, T0 + 10_000)
    assert parked == [(bad, "not delivered after 3 attempts")]
    st = e.stats().counters
    assert (st.delivered, st.dead_lettered, st.retries) == (1, 1, 3)


def test_invalid_messages_are_refused_whole(make_engine: MakeEngine) -> None:
    e = make_engine(max_delay_ms=HOUR, max_body_bytes=10)
    with pytest.raises(InvalidMessageError, match="maximum delay"):
        e.schedule([Message("T", b"x", T0 + 1), Message("T", b"x", T0 + 2 * HOUR)])
    with pytest.raises(InvalidMessageError, match="target topic"):
        e.schedule([Message("", b"x", T0)])
    with pytest.raises(InvalidMessageError, match="max_body_bytes"):
        e.schedule([Message("T", b"x" * 11, T0)])
    with pytest.raises(InvalidMessageError, match="epoch ms"):
        e.schedule([Message("T", b"x", "soon")])  # type: ignore[arg-type]
    assert e.stats().counters.scheduled == 0


def test_duplicate_ids_are_scheduled_once(make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink) -> None:
    e = make_engine()
    e.schedule([Message("T", b"x", T0 + 100, msg_id="same")] * 3)
    e.schedule([Message("T", b"x", T0 + 100, msg_id="same")])
    drive(e, clock, T0 + 1000)
    assert sink.sent == [("same", T0 + 100)]
    assert e.stats().counters.duplicates == 3


def test_background_threads_release_on_time(tmp_path: Path) -> None:
    import time

    from timewheel import SystemClock

    class Sink:
        def __init__(self) -> None:
            self.at: list[tuple[int, int]] = []

        def send_batch(self, messages):
            now = SystemClock().now_ms()
            self.at.extend((now, m.deliver_at_ms) for m in messages)
            return [True] * len(messages)

    sink = Sink()
    with Engine(EngineConfig(tmp_path / "d"), sink) as e:
        now = SystemClock().now_ms()
        e.schedule([Message("T", b"x", now + 200 + i) for i in range(50)])
        deadline = time.monotonic() + 10
        while len(sink.at) < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(sink.at) == 50
    assert all(sent >= due for sent, due in sink.at), "nothing is sent before it is due"


def test_concurrent_schedulers_lose_nothing(tmp_path: Path) -> None:
    """Commits finish in one order and callers return in another: every record is still loaded once."""
    import threading
    import time

    from timewheel import SystemClock

    class Sink:
        def __init__(self) -> None:
            self.ids: list[str] = []

        def send_batch(self, messages):
            self.ids.extend(m.msg_id for m in messages)
            return [True] * len(messages)

    sink = Sink()
    with Engine(EngineConfig(tmp_path / "d"), sink) as e:
        due = SystemClock().now_ms() + 1500
        ids: list[str] = []

        def produce() -> None:
            for _ in range(100):
                ids.extend(e.schedule([Message("T", b"x", due)]))

        threads = [threading.Thread(target=produce) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 20
        while len(sink.ids) < 600 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    assert sorted(sink.ids) == sorted(ids)


def test_a_sink_with_max_in_flight_gets_parallel_sends_each_message_once(tmp_path: Path) -> None:
    """A slow answer holds up only its own batch: the engine keeps max_in_flight calls going."""
    import threading
    import time

    from timewheel import SystemClock

    class SlowSink:
        max_in_flight = 4

        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.ids: list[str] = []
            self.in_flight = 0
            self.most_in_flight = 0

        def send_batch(self, messages):
            with self.lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            time.sleep(0.02)  # a broker's round trip
            with self.lock:
                self.in_flight -= 1
                self.ids.extend(m.msg_id for m in messages)
            return [True] * len(messages)

    sink = SlowSink()
    with Engine(EngineConfig(tmp_path / "d", send_batch_size=10), sink) as e:
        due = SystemClock().now_ms() + 300
        ids = e.schedule([Message("T", f"{i}".encode(), due + i % 50) for i in range(2000)])
        deadline = time.monotonic() + 30
        while len(sink.ids) < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert e.stats().counters.delivered == 2000
    assert sorted(sink.ids) == sorted(ids)
    assert sink.most_in_flight == 4
    assert len([t for t in threading.enumerate() if t.name.startswith("timewheel-dispatch")]) == 0, "threads stopped"


def test_totals_outlive_a_stop_and_a_start_of_the_same_engine(make_engine: MakeEngine, clock: ManualClock,
                                                               sink: RecordingSink) -> None:
    e = make_engine()
    e.schedule([Message("T", b"x", T0 + 1000)])
    drive(e, clock, T0 + 2000)
    e.stop()
    assert e.stats().counters.delivered == 1
    e.start(background=False)
    st = e.stats()
    assert (st.counters.scheduled, st.counters.delivered, st.wheel_entries) == (1, 1, 0)


def test_an_index_entry_whose_due_disagrees_with_its_record_is_sent_at_the_records_due(
        make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink) -> None:
    import numpy as np

    from storage.index import INDEX_DTYPE
    e = make_engine()
    later = T0 + 3 * HOUR  # a segment not loaded yet: it comes from its index
    ids = e.schedule([Message("T", f"b{i}".encode(), later + 1000 + i) for i in range(3)])
    assert e.store is not None
    loc = e.store.meta.locations([ids[1]])[0]
    assert loc is not None
    path = e.store.layout.part_index(loc.segment_ms, loc.part)
    entries = np.fromfile(path, INDEX_DTYPE)
    row = int(np.flatnonzero(entries["offset"] == loc.offset)[0])
    entries["due_ms"][row] = later + 500  # the index (no CRC) says earlier than the intact record
    entries.tofile(path)
    drive(e, clock, later + 5000)
    assert sorted(sink.sent) == sorted([(ids[0], later + 1000), (ids[1], later + 1001), (ids[2], later + 1002)])
    st = e.stats().counters
    assert (st.delivered, st.corrupt) == (3, 0)
