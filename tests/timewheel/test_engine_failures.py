"""Sends that fail the same way every time end as dead letters; nothing retries forever."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forwarder.contract import to_dead_letter, to_outgoing
from forwarder.rocketmq import MessageRejectedError, encode_message
from storage import Record, summarize
from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.timewheel.conftest import T0, RecordingSink, drive

MIN = 60_000


class EncodingSink:
    """Sends as the wire client would encode them: a message it cannot encode fails, every time."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        out = []
        for m in messages:
            try:
                encode_message(to_outgoing(m), "ID")
            except MessageRejectedError:
                out.append(False)
                continue
            self.sent.append(m)
            out.append(True)
        return out


class EncodingDeadLetters:
    """A dead-letter path that encodes its messages the same way (a NUL in tags must not break it)."""

    def __init__(self) -> None:
        self.parked: list[tuple[Message, str]] = []

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        for m in messages:
            encode_message(to_dead_letter("TW_DLQ", m.body, m.tags, " ".join(m.keys), dict(m.properties or {}),
                                          reason), "ID")
            self.parked.append((m, reason))


class DeliverySinkDeadLetters(EncodingDeadLetters):
    """The dead-letter path as the delivery sink writes it (`RocketMQSink.dead_letter`): the target
    topic and the id go along with every user property."""

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        for m in messages:
            props = {**(m.properties or {}), "TW_TARGET_TOPIC": m.topic}
            encode_message(to_dead_letter("TW_DLQ", m.body, m.tags, " ".join(m.keys), props, reason,
                                          msg_id=m.msg_id or ""), "ID")
            self.parked.append((m, reason))


@contextmanager
def _engine(tmp_path: Path, clock: ManualClock, sink: Any, **cfg: Any) -> Iterator[Engine]:
    e = Engine(EngineConfig(tmp_path / "data", **cfg), sink, clock, seed=1).start(background=False)
    try:
        yield e
    finally:
        e.stop()


def test_a_message_the_encoder_refuses_every_time_is_dead_lettered_and_its_segment_finishes(
        tmp_path: Path, clock: ManualClock) -> None:
    sink, dlq = EncodingSink(), EncodingDeadLetters()
    with _engine(tmp_path, clock, sink, segment_minutes=1, preload_seconds=10, max_attempts=4,
                 retry_base_ms=100, retry_max_ms=400) as e:
        _refused_every_time(e, clock, sink, dlq)


def _refused_every_time(e: Engine, clock: ManualClock, sink: EncodingSink, dlq: EncodingDeadLetters) -> None:
    e.dead_letter_sink = dlq
    ok, poison = e.schedule([Message("T", b"ok", T0 + 1000), Message("T", b"poison", T0 + 1000, tags="t\x00g",
                                                                      keys=("k\x00",))])
    drive(e, clock, T0 + 3 * MIN)
    assert [m.msg_id for m in sink.sent] == [ok]
    assert [(m.msg_id, r) for m, r in dlq.parked] == [(poison, "not delivered after 4 attempts")]
    st = e.stats()
    assert (st.counters.delivered, st.counters.dead_lettered, st.retrying) == (1, 1, 0)
    # the segment is over and fully dispatched: marked done, not held open by a retry
    assert e.store is not None
    assert T0 in e.store.meta.done_segments()
    segments = summarize(e.store.layout)["segments"]
    assert isinstance(segments, list)
    [seg] = [s for s in segments if s["start_ms"] == T0]
    assert seg["pending"] == 0


def test_retry_counts_saturate_instead_of_wrapping(tmp_path: Path, clock: ManualClock) -> None:
    class Refusing:
        def send_batch(self, messages: Sequence[Message]) -> list[bool]:
            return [False] * len(messages)

    class DeadLettersDown:
        def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
            raise ConnectionError("the dead-letter topic is unreachable")

    with _engine(tmp_path, clock, Refusing(), max_attempts=2, retry_base_ms=1000, retry_max_ms=1000) as e:
        _saturates(e, clock, DeadLettersDown())


def _saturates(e: Engine, clock: ManualClock, dead_letters: Any) -> None:
    e.dead_letter_sink = dead_letters
    [mid] = e.schedule([Message("T", b"x", T0 + 10)])
    drive(e, clock, T0 + 2500)
    assert e.stats().retrying == 1  # the dead-letter path is down: it waits to try again, not lost
    run = e._run
    assert run is not None
    # one retry away from int16's end: the next failure must not wrap the count around
    from timewheel._held import Batch
    assert e.store is not None
    loc = e.store.meta.locations([mid])[0]
    assert loc is not None
    near_end = Batch([Message("T", b"x", T0 + 10, msg_id=mid)], np.array([T0 + 10]), np.array([1], np.uint64),
                     np.array([32767], np.int16), np.array([loc.segment_ms]), np.array([loc.part], np.uint16),
                     np.array([loc.offset], np.uint32))
    run.dispatcher.outcomes.fail(near_end, T0 + 2600)
    assert e.stats().retrying == 2 and e.stats().counters.dead_lettered == 0
    assert run.queue._retries.entries.attempts.min() > 0  # saturated at 32767, not wrapped to -32768


def test_a_thread_that_dies_is_reported_so_readiness_goes_down(tmp_path: Path) -> None:
    """An error escaping a worker loop (here a shaper whose token clock overflows, as a 1e-320 rate
    once did) leaves the engine unable to deliver: it must say so, not look healthy."""

    from timewheel import SystemClock

    class OverflowingShaper:
        def grant(self, backlog: Any, now_ms: int) -> dict[str, int]:
            return {}

        def next_grant_ms(self, now_ms: int) -> int | None:
            raise OverflowError("cannot convert float infinity to integer")

        def release(self, topic: str, n: int) -> None:
            pass

        def record(self, topic: str, sent: int, failed: int, held_ms: float, now_ms: int) -> None:
            pass

        def stats(self) -> dict[str, object]:
            return {}

        def passes_through(self) -> bool:
            return False

    sink = EncodingSink()
    e = Engine(EngineConfig(tmp_path / "data"), sink, SystemClock(), shaper=OverflowingShaper()).start()
    try:
        assert e.dead_threads() == []
        e.schedule([Message("T", b"x", int(time.time() * 1000))])
        deadline = time.monotonic() + 10
        while not e.dead_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.dead_threads() == ["timewheel-dispatch-0"]
        [(name, error)] = e.thread_failures().items()  # what /readyz names beside the thread
        assert (name, error) == ("timewheel-dispatch-0", "OverflowError: cannot convert float infinity to integer")
    finally:
        e.stop()


def test_the_service_is_not_ready_while_an_engine_thread_is_dead() -> None:
    from tests.timewheel.app.service_parts import readiness_only

    class DeadEngine:
        def dead_threads(self) -> list[str]:
            return ["timewheel-timer"]

        def thread_failures(self) -> dict[str, str]:
            return {"timewheel-timer": "OSError: [Errno 5] Input/output error"}

        def checkpoint_failure(self) -> str | None:
            return None

    svc = readiness_only(DeadEngine())
    assert svc.ready() is False
    assert [w for w in svc.not_ready_why() if "timewheel-timer (OSError: [Errno 5] Input/output error)" in w]


def test_the_service_is_not_ready_while_checkpoints_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.timewheel.app.service_parts import readiness_only

    clock = ManualClock(T0)
    e = Engine(EngineConfig(tmp_path / "data"), RecordingSink(clock), clock).start(background=False)
    try:
        svc = readiness_only(e)
        assert svc.ready() is True

        def full() -> None:
            raise OSError(28, "No space left on device")
        assert e._run is not None
        monkeypatch.setattr(e._run.store, "checkpoint", full)
        e._run.housekeeper.run_once()
        assert svc.ready() is False
    finally:
        monkeypatch.undo()
        e.stop()


def test_checkpoints_that_keep_failing_log_their_traceback_once_then_their_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    clock = ManualClock(T0)
    e = Engine(EngineConfig(tmp_path / "data"), RecordingSink(clock), clock).start(background=False)
    try:
        assert e._run is not None
        real, full = e._run.store.checkpoint, [True]

        def checkpoint() -> None:
            if full[0]:
                raise OSError(28, "No space left on device")
            real()
        monkeypatch.setattr(e._run.store, "checkpoint", checkpoint)
        with caplog.at_level(logging.INFO, logger="timewheel.housekeeping"):
            for _ in range(6):  # a minute of checkpoints every 10 s
                e._run.housekeeper.run_once()
            failed = [r for r in caplog.records if "checkpoint failed" in r.getMessage()]
            assert len(failed) == 1 and failed[0].exc_info is not None and failed[0].levelno == logging.ERROR
            full[0] = False
            e._run.housekeeper.run_once()
            assert any("checkpoints succeed again after 6 failed" in r.getMessage() for r in caplog.records)
            assert e._run.housekeeper.failure is None
    finally:
        monkeypatch.undo()
        e.stop()


def test_a_failed_fsync_keeps_the_service_unready_until_a_restart_replays_what_it_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an fsync fails the store stops checkpointing for good (the kernel may have dropped the
    pages): the service stays unready even once the disk answers again, the engine's stop raises the
    error with every file closed, and the next start replays and delivers what was acknowledged."""
    from storage import StorageWriteError
    from tests.timewheel.app.service_parts import readiness_only

    clock = ManualClock(T0)
    data = tmp_path / "data"
    e = Engine(EngineConfig(data), RecordingSink(clock), clock).start(background=False)
    ids = [f"{i:032X}:00000001" for i in range(4)]
    e.schedule([Message("ORDERS", b"x", T0 + 60_000, msg_id=mid) for mid in ids])
    svc = readiness_only(e)
    assert e._run is not None and e.store is not None
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        e._run.housekeeper.run_once()
    assert "Input/output error" in (e.store.checkpoints_stopped or "")
    e._run.housekeeper.run_once()  # the disk answers again
    assert svc.ready() is False and "checkpoints are stopped" in (e.checkpoint_failure() or "")
    with pytest.raises(StorageWriteError, match="checkpoints are stopped"):
        e.stop()
    assert e._run is None
    sink = RecordingSink(clock)
    again = Engine(EngineConfig(data), sink, clock).start(background=False)
    try:
        assert again.store is not None and again.store.recovery.replayed_records == 4
        drive(again, clock, T0 + 120_000)
        assert sorted(mid for mid, _ in sink.sent) == ids
    finally:
        again.stop()


def test_a_look_up_racing_the_stop_finishes_before_the_meta_store_closes_or_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`GET /messages` while the service stops: the stop once closed the meta store under a look-up
    (an HTTP 500). Now the stop waits for a look-up under way, and one asked after the stop began is
    refused with a typed error (503)."""
    import threading

    from timewheel.app.service import Service
    from timewheel.app.settings import Settings
    from timewheel.errors import EngineStateError
    from timewheel.find import MessageFinder

    clock = ManualClock(T0)
    config = EngineConfig(tmp_path / "data")
    e = Engine(config, RecordingSink(clock), clock).start(background=False)
    mid = f"{7:032X}:00000001"
    e.schedule([Message("ORDERS", b"x", T0 + 60_000, msg_id=mid)])
    svc = Service(Settings(config), clock, admin=False)
    svc.engine = e
    inside, go_on = threading.Event(), threading.Event()
    real = MessageFinder.by_id

    def slow_by_id(self: MessageFinder, *args: Any, **kw: Any) -> Any:
        inside.set()
        go_on.wait(10)
        return real(self, *args, **kw)

    monkeypatch.setattr(MessageFinder, "by_id", slow_by_id)
    answers: list[Any] = []

    def look_up() -> None:
        try:
            answers.append(svc.find_messages(mid, None, 20)["count"])
        except Exception as ex:
            answers.append(ex)

    finder = threading.Thread(target=look_up)
    finder.start()
    assert inside.wait(10)
    stopper = threading.Thread(target=svc.stop)
    stopper.start()
    stopper.join(0.5)
    assert stopper.is_alive(), "the stop did not wait for the look-up under way"
    go_on.set()
    finder.join(10)
    stopper.join(30)
    assert answers == [1]
    with pytest.raises(EngineStateError, match="stopping"):
        svc.find_messages(mid, None, 20)


def test_a_cancel_reading_records_does_not_hold_up_the_engine(tmp_path: Path) -> None:
    """cancel(key=...) reads each record from disk; while it does, the timer, the dispatchers and a
    stats scrape must not wait for it (the reads once ran under the lock they all need)."""
    import threading

    from timewheel import SystemClock

    e = Engine(EngineConfig(tmp_path / "data"), EncodingSink(), SystemClock()).start()
    try:
        far = int(__import__("time").time() * 1000) + 3_600_000
        e.schedule([Message("T", b"x", far, keys=("order-7",)) for _ in range(3)])
        reading, release = threading.Event(), threading.Event()
        store = e.store
        assert store is not None
        original = store.read_record

        def slow_read(segment_ms: int, part: int, offset: int) -> Record:
            reading.set()
            release.wait(10)  # a disk that stalls
            return original(segment_ms, part, offset)

        store.read_record = slow_read  # type: ignore[method-assign]
        canceller = threading.Thread(target=e.cancel, kwargs={"key": "order-7"})
        canceller.start()
        assert reading.wait(5)
        scraped: list[object] = []
        scraper = threading.Thread(target=lambda: scraped.append(e.stats()))
        scraper.start()
        scraper.join(5)
        stalled = scraper.is_alive()
        release.set()
        canceller.join(10)
        scraper.join(5)
        assert not stalled, "stats() waited for a cancel's disk reads"
        assert e.stats().counters.cancelled == 3
    finally:
        e.stop()


@pytest.mark.parametrize("size", [32_700, 32_767])
def test_a_stored_message_too_large_to_deliver_is_dead_lettered_not_retried_for_good(
        tmp_path: Path, clock: ManualClock, size: int) -> None:
    """Properties that fit the store but not RocketMQ once the engine adds its own (32,767 bytes became
    32,808 at delivery and 32,868 in the dead letter): refused at each attempt, then dead-lettered
    minimal, and the segment finishes."""
    sink, dlq = EncodingSink(), DeliverySinkDeadLetters()
    with _engine(tmp_path, clock, sink, segment_minutes=1, preload_seconds=10, max_attempts=3,
                 retry_base_ms=100, retry_max_ms=400) as e:
        e.dead_letter_sink = dlq
        [big] = e.schedule([Message("T", b"b", T0 + 1000, properties={"A": "x" * (size - 10)})])
        drive(e, clock, T0 + 3 * MIN)
        assert sink.sent == [] and [(m.msg_id, r) for m, r in dlq.parked] == [(big, "not delivered after 3 attempts")]
        st = e.stats()
        assert (st.counters.dead_lettered, st.retrying) == (1, 0)
        assert e.store is not None
        assert T0 in e.store.meta.done_segments()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors in /proc")
def test_an_engine_that_fails_to_start_closes_its_store(tmp_path: Path, clock: ManualClock,
                                                        sink: RecordingSink) -> None:
    """The store is opened first: when what comes after it fails (here the tombstone log, whose
    directory is a file), the store's files are closed with the error and the directory is free."""
    Engine(EngineConfig(tmp_path / "warm"), sink, clock).start(background=False).stop()  # rocksdb's own files
    data = tmp_path / "data"
    data.mkdir()
    (data / "cancels").write_bytes(b"")  # where the tombstone log's directory goes
    before = len(os.listdir("/proc/self/fd"))
    engine = Engine(EngineConfig(data), sink, clock)
    with pytest.raises(OSError):
        engine.start(background=False)
    assert len(os.listdir("/proc/self/fd")) == before
    (data / "cancels").unlink()
    engine.start(background=False).stop()  # nothing holds the meta store's lock


@pytest.mark.parametrize("where", ["_load_parts", "not_covered"])
def test_a_failed_timer_pass_stops_the_timer_and_a_restart_delivers_what_it_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A pass is not all or nothing: a load that fails half way has marked its segment loaded, and
    records taken from the store's commits are in no list any more. Retried in place, the pass
    would go on without them (and could mark their segment done); so the timer stops at once, the
    engine says so, and the next start delivers them from the store."""

    from timewheel import SystemClock
    from timewheel.loader import SegmentLoader

    real = getattr(SegmentLoader, where)
    raised: list[str] = []

    def failing(self: Any, *args: Any) -> Any:
        if not raised:
            raised.append(where)
            raise OSError(24, "Too many open files")
        return real(self, *args)

    sink = EncodingSink()
    e = Engine(EngineConfig(tmp_path / "data"), sink, SystemClock())
    monkeypatch.setattr(SegmentLoader, where, failing)
    e.start()
    try:
        if where == "not_covered":  # the current segment loads first; the record then arrives as a commit
            assert e._run is not None
            loaded = e._run.timer.loader.loaded
            deadline = time.monotonic() + 10
            while not loaded and time.monotonic() < deadline:
                time.sleep(0.01)
            assert loaded
        ids = e.schedule([Message("T", b"x", int(time.time() * 1000) + 300)])
        deadline = time.monotonic() + 10
        while not e.dead_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert raised == [where] and e.dead_threads() == ["timewheel-timer"]
        time.sleep(0.5)
        assert sink.sent == [], "nothing is sent by an engine whose timer stopped"
    finally:
        e.stop()
    monkeypatch.setattr(SegmentLoader, where, real)
    again = Engine(EngineConfig(tmp_path / "data"), sink, SystemClock()).start()
    try:
        deadline = time.monotonic() + 10
        while not sink.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m.msg_id for m in sink.sent] == ids and again.dead_threads() == []
    finally:
        again.stop()


@pytest.mark.parametrize("first_removed", ["dispatch.log", "00000.idx"])
def test_a_crash_midway_through_retiring_a_segment_sends_none_of_its_messages_again(
        tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, first_removed: str) -> None:
    """Retiring removes a segment's files one by one: a crash between them once left a segment whose
    dispatch log (or an index) was gone and whose records were still there. Nothing was sent again
    (its "done" mark outlived the crash), but its records read as pending for ever: retention never
    retired it, and `inspect` counted them."""
    import storage.retention as retention

    sink = RecordingSink(clock)
    data = tmp_path / "data"
    e = Engine(EngineConfig(data_dir=data), sink, clock, seed=1).start(background=False)
    e.schedule([Message("ORDERS", b"x", T0 + 1000 + i, msg_id=f"{i:032X}:00000001") for i in range(5)])
    drive(e, clock, T0 + 3 * 3_600_000)
    assert len(sink.sent) == 5
    assert e.store is not None
    seg = e.store.layout.segment_start(T0)

    def crash_midway(path: Any, *args: Any, **kw: Any) -> None:
        for victim in Path(path).rglob(first_removed):
            victim.unlink()
        raise SystemExit("killed while removing the segment's files")

    monkeypatch.setattr(retention.shutil, "rmtree", crash_midway)
    e.store.checkpoint()  # housekeeping's order: a checkpoint, then retention
    with pytest.raises(SystemExit):
        e.store.retire(clock.now_ms(), 3_600_000)
    e.stop()
    monkeypatch.undo()

    again = RecordingSink(clock)
    e2 = Engine(EngineConfig(data_dir=data, retention_hours=1.0), again, clock, seed=1).start(background=False)
    try:
        drive(e2, clock, clock.now_ms() + 60_000)
        assert again.sent == []
        assert e2.store is not None and seg not in e2.store.layout.list_segments()
        assert not any(e2.store.layout.retiring_dir.iterdir())
        assert any("retiring/" in f for f in e2.store.recovery.findings), e2.store.recovery.findings
        assert summarize(e2.store.layout)["totals"]["pending"] == 0  # type: ignore[index]
    finally:
        e2.stop()


def test_records_the_timer_was_not_told_of_stop_the_timer_and_a_restart_delivers_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's commit listener (the timer's `_on_commit`) fails once, after the records were
    stored. The error once went back to ingest as a failed store: the batch was pulled again, every
    id was found stored (dedupe) and nothing was handed to the wheel, so a record of a part already
    loaded was never sent while the engine looked healthy. Now the append stands, the timer stops
    with the error (the engine not ready; the service exits), and the next start sends it."""

    from timewheel import SystemClock
    from timewheel.timer import TimerDriver

    real = TimerDriver._on_commit
    calls: list[int] = []

    def failing(self: TimerDriver, locations: np.ndarray) -> None:
        calls.append(len(locations))
        if len(calls) == 2:  # the second commit: its part is loaded already
            raise MemoryError("could not keep the new records")
        real(self, locations)

    def wait_for(done: Any) -> None:
        deadline = time.monotonic() + 3
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setattr(TimerDriver, "_on_commit", failing)
    sink = EncodingSink()
    e = Engine(EngineConfig(tmp_path / "data"), sink, SystemClock()).start()
    try:
        [first] = e.schedule([Message("T", b"x", int(time.time() * 1000) + 300, msg_id=f"{1:032X}:00000001")])
        wait_for(lambda: sink.sent)
        assert [m.msg_id for m in sink.sent] == [first]
        msgs = [Message("T", b"y", int(time.time() * 1000) + 300, msg_id=f"{2:032X}:00000001")]
        try:
            ids = e.schedule(msgs)
        except MemoryError:  # as ingest does with a batch it could not store: pull it again
            ids = e.schedule(msgs)
        wait_for(lambda: len(sink.sent) > 1 or e.dead_threads())
        assert len(calls) == 2
        assert e.dead_threads() == ["timewheel-timer"], (
            f"stranded: sent {[m.msg_id for m in sink.sent]}, dead threads {e.dead_threads()}, {e.stats().counters}")
        assert [m.msg_id for m in sink.sent] == [first]
    finally:
        e.stop()
    monkeypatch.setattr(TimerDriver, "_on_commit", real)
    again = Engine(EngineConfig(tmp_path / "data"), sink, SystemClock()).start()
    try:
        wait_for(lambda: len(sink.sent) > 1)
        assert [m.msg_id for m in sink.sent] == [first, *ids] and again.dead_threads() == []
    finally:
        again.stop()


def test_a_late_message_stored_in_a_segment_marked_done_is_sent_after_a_restart(
        tmp_path: Path, clock: ManualClock) -> None:
    """A message due in a segment already marked done (it arrived late: ingest lag, a producer's
    clock) is stored there and sent from memory. With the broker down it waits for a retry, and a
    stop then once lost it for good: a start never loads a done segment, so it stayed on disk
    unsent. Now storing it makes the segment pending again."""
    sink = RecordingSink(clock)
    data = tmp_path / "data"
    e = Engine(EngineConfig(data), sink, clock).start(background=False)
    try:
        e.schedule([Message("T", b"a", T0 + 1000, msg_id=f"{1:032X}:00000001")])
        drive(e, clock, T0 + 2 * 3_600_000)
        assert e.store is not None and T0 in e.store.meta.done_segments()
        sink.busy = True  # the broker is down
        [late] = e.schedule([Message("T", b"late", T0 + 5000, msg_id=f"{2:032X}:00000001")])
        drive(e, clock, clock.now_ms() + 10_000)
        assert e.stats().retrying == 1
    finally:
        e.stop()
    again = RecordingSink(clock)
    e2 = Engine(EngineConfig(data), again, clock).start(background=False)
    try:
        drive(e2, clock, clock.now_ms() + 60_000)
        assert [mid for mid, _ in again.sent] == [late]
        drive(e2, clock, clock.now_ms() + 3_600_000)
        assert e2.store is not None and T0 in e2.store.meta.done_segments()  # done again once it was sent
    finally:
        e2.stop()


def test_a_segment_is_not_marked_done_while_a_record_stored_in_it_waits_for_the_timer(
        tmp_path: Path, clock: ManualClock) -> None:
    """The timer decides a past segment is done from what it has taken; a record stored in it since
    (late) waits in its inbound list. Marked done then, the segment would not be loaded by a start
    that came before the record was sent."""
    sink = RecordingSink(clock)
    e = Engine(EngineConfig(tmp_path / "data"), sink, clock).start(background=False)
    try:
        e.schedule([Message("T", b"a", T0 + 1000, msg_id=f"{1:032X}:00000001")])
        drive(e, clock, T0 + 2 * 3_600_000)
        run = e._run
        assert run is not None and e.store is not None and T0 not in run.timer.loader.loaded
        # the segment as the pass that finds it done sees it: loaded, nothing outstanding, not marked yet
        e.store.meta.forget_segment(T0)
        run.timer.loader.load(T0)
        [late] = e.schedule([Message("T", b"late", T0 + 5000, msg_id=f"{2:032X}:00000001")])
        run.timer._finish_segments(clock.now_ms())  # the late record waits in the inbound list
        assert T0 not in e.store.meta.done_segments()
        drive(e, clock, clock.now_ms() + 1000)
        assert [mid for mid, _ in sink.sent][1:] == [late] and T0 in e.store.meta.done_segments()
    finally:
        e.stop()


def test_readiness_is_exported_as_timewheel_serving_beside_the_ready_queue_gauge(tmp_path: Path) -> None:
    """`timewheel_ready` was taken (due messages waiting for a sender): the readiness is `timewheel_serving`."""
    from timewheel.app.metrics import EngineCollector

    clock = ManualClock(T0)
    e = Engine(EngineConfig(tmp_path / "data"), RecordingSink(clock), clock).start(background=False)
    try:
        for serving in (True, False):
            collector = EngineCollector(e.stats, lambda: e.lateness_buckets, lambda: {"serving": serving})
            names = {s.name: s.value for m in collector.collect() for s in m.samples}
            assert (names["timewheel_serving"], names["timewheel_ready"]) == (float(serving), 0.0)
    finally:
        e.stop()


def test_a_checkpoint_the_stopped_meta_store_refuses_ends_the_housekeeping_thread_not_retried_forever(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RocksDB takes no write until reopened: a checkpoint every 10 s could never succeed, a retry without
    end. The thread ends instead, and the engine reports it (the service goes not ready, serve exits 3)."""
    from storage import MetaStoreStoppedError

    clock = ManualClock(T0)
    e = Engine(EngineConfig(tmp_path / "data", checkpoint_seconds=0.05), RecordingSink(clock), clock).start()
    try:
        assert e._run is not None
        calls: list[int] = []

        def stopped() -> None:
            calls.append(1)
            raise MetaStoreStoppedError(str(tmp_path / "data" / "meta"), "IO error: No space left on device")
        monkeypatch.setattr(e._run.store, "checkpoint", stopped)
        deadline = time.monotonic() + 10
        while not e.dead_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.dead_threads() == ["timewheel-housekeeping"], e.dead_threads()
        assert "MetaStoreStoppedError" in (e.checkpoint_failure() or "")
        time.sleep(0.2)
        assert calls == [1], "tried once, not again"
    finally:
        monkeypatch.undo()
        e.stop()
