"""Cancels as the delay topic carries them: tombstones that win over messages arriving later,
survive a restart, expire, and never grow past their bound."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import AppendResult, Origin, Record, TombstoneLog
from timewheel import ManualClock, Message
from timewheel.cancels import CancelRequest, Tombstones
from tests.timewheel.conftest import T0, MakeEngine, RecordingSink, drive

HOUR = 3_600_000


def _uniq(i: int) -> str:
    return f"{i:032X}"


def test_cancel_by_id_before_the_message_arrives_wins(make_engine: MakeEngine, clock: ManualClock,
                                                      sink: RecordingSink) -> None:
    e = make_engine()
    assert e.apply_cancels([CancelRequest(_uniq(1), None, T0)]) == 0  # nothing stored yet
    e.schedule([Message("T", b"a", T0 + 10_000, msg_id=f"{_uniq(1)}:0badc0de"),
                Message("T", b"b", T0 + 10_000, msg_id=f"{_uniq(2)}:0badc0de")])
    drive(e, clock, T0 + 20_000)
    assert [m for m, _ in sink.sent] == [f"{_uniq(2)}:0badc0de"]
    st_ = e.stats()
    assert (st_.counters.cancelled_on_arrival, st_.counters.cancel_requests, st_.tombstones) == (1, 1, 1)


def test_cancel_by_full_original_id_names_that_message_only(make_engine: MakeEngine, clock: ManualClock,
                                                             sink: RecordingSink) -> None:
    e = make_engine()
    e.apply_cancels([CancelRequest(f"{_uniq(1)}:00000001", None, T0)])
    e.schedule([Message("T", b"a", T0 + 1000, msg_id=f"{_uniq(1)}:00000001"),
                Message("T", b"b", T0 + 1000, msg_id=f"{_uniq(1)}:00000002")])
    drive(e, clock, T0 + 5000)
    assert [m for m, _ in sink.sent] == [f"{_uniq(1)}:00000002"]


@pytest.mark.parametrize("cancel_first", [True, False])
def test_a_producer_id_holding_a_colon_names_its_own_messages_only(make_engine: MakeEngine, clock: ManualClock,
                                                                   sink: RecordingSink, cancel_first: bool) -> None:
    """An engine id is `<UNIQ_KEY>:<8 hex digits>`, and a UNIQ_KEY a client set may hold ':' itself:
    a cancel of "ORDER" is not one of "ORDER:42", and one of "ORDER:42" must find it, in either order."""
    e = make_engine()
    msgs = [Message("T", b"a", T0 + 10_000, msg_id="ORDER:42:655733ab"),
            Message("T", b"b", T0 + 10_000, msg_id="ORDER:914a3394")]
    cancels = [CancelRequest("ORDER:42", None, T0), CancelRequest("NOPE", None, T0)]
    if cancel_first:
        e.apply_cancels(cancels)
        e.schedule(msgs)
    else:
        e.schedule(msgs)
        e.apply_cancels(cancels)
    e.apply_cancels([CancelRequest("ORDER:4", None, T0)])  # a prefix of the id, not the id
    drive(e, clock, T0 + 20_000)
    assert [m for m, _ in sink.sent] == ["ORDER:914a3394"]


def test_a_cancel_of_a_producer_id_leaves_a_longer_id_that_starts_with_it(make_engine: MakeEngine,
                                                                          clock: ManualClock,
                                                                          sink: RecordingSink) -> None:
    e = make_engine()
    e.apply_cancels([CancelRequest("ORDER", None, T0)])
    e.schedule([Message("T", b"a", T0 + 10_000, msg_id="ORDER:42:655733ab"),
                Message("T", b"b", T0 + 10_000, msg_id="ORDER:914a3394")])
    e.apply_cancels([CancelRequest("ORDER", None, T0)])  # again, with both stored
    drive(e, clock, T0 + 20_000)
    assert [m for m, _ in sink.sent] == ["ORDER:42:655733ab"]


def test_cancel_by_id_after_the_message_is_stored(make_engine: MakeEngine, clock: ManualClock,
                                                  sink: RecordingSink) -> None:
    e = make_engine()
    e.schedule([Message("T", b"a", T0 + 10_000, msg_id=f"{_uniq(1)}:00000001")])
    assert e.apply_cancels([CancelRequest(_uniq(1), None, T0)]) == 1
    assert e.apply_cancels([CancelRequest(_uniq(1), None, T0)]) == 0  # the copy from another queue
    drive(e, clock, T0 + 20_000)
    assert sink.sent == []
    c = e.stats().counters
    assert (c.cancelled, c.cancel_requests, c.cancels_applied, e.stats().tombstones) == (1, 2, 1, 1)


def test_key_cancel_covers_stored_and_later_messages_of_that_key(make_engine: MakeEngine, clock: ManualClock,
                                                                   sink: RecordingSink) -> None:
    e = make_engine()
    e.schedule([Message("T", b"stored", T0 + 10_000, keys=("order-7",), msg_id="m0")])
    assert e.apply_cancels([CancelRequest(None, "order-7", T0)]) == 1
    clock.set(T0 + 1000)
    e.schedule([Message("T", b"later", T0 + 10_000, keys=("x", "order-7"), msg_id="m1"),
                Message("T", b"other", T0 + 10_000, keys=("order-8",), msg_id="m2")])
    drive(e, clock, T0 + 20_000)
    assert [m for m, _ in sink.sent] == ["m2"]
    assert e.stats().counters.cancelled_on_arrival == 1


def test_tombstones_survive_a_restart_and_expire(make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink,
                                                  tmp_path: Path) -> None:
    e = make_engine(tombstone_retention_hours=1.0)
    e.apply_cancels([CancelRequest(_uniq(1), None, T0), CancelRequest(None, "k", T0)])
    e.stop()
    clock.set(T0 + HOUR - 1)
    e = make_engine(tombstone_retention_hours=1.0)
    assert e.stats().tombstones == 2
    e.schedule([Message("T", b"a", T0 + HOUR + 1000, msg_id=f"{_uniq(1)}:1"),
                Message("T", b"b", T0 + HOUR + 1000, msg_id="m2", keys=("k",))])
    clock.set(T0 + HOUR)  # retention over: forgotten, later arrivals are scheduled
    e.schedule([Message("T", b"c", T0 + HOUR + 1000, msg_id=f"{_uniq(1)}:2")])
    drive(e, clock, T0 + HOUR + 5000)
    assert [m for m, _ in sink.sent] == [f"{_uniq(1)}:2"]
    assert e.stats().tombstones == 0


def test_a_cancel_racing_a_store_still_wins(make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink) -> None:
    """The cancel's tombstone lands between the batch's screening and its store: the batch is
    checked again once stored."""
    e = make_engine()
    run = e._run
    assert run is not None
    store_append = run.store.append

    def append_then_cancel(records: Sequence[Record], now_ms: int,
                           origins: Sequence[Origin] | None = None) -> AppendResult:
        # a cancel from another queue's thread, mid-store
        out = store_append(records, now_ms, origins)
        t = threading.Thread(target=e.apply_cancels, args=([CancelRequest(_uniq(9), None, T0)],))
        t.start()
        t.join()
        return out

    run.store.append = append_then_cancel  # type: ignore[method-assign]  # for this one schedule() only
    try:
        e.schedule([Message("T", b"a", T0 + 10_000, msg_id=f"{_uniq(9)}:1")])
    finally:
        run.store.append = store_append  # type: ignore[method-assign]
    drive(e, clock, T0 + 20_000)
    assert sink.sent == []
    assert e.stats().counters.cancelled == 1


def test_tombstones_are_bounded_and_the_log_compacts(tmp_path: Path) -> None:
    log = TombstoneLog(tmp_path)
    t = Tombstones(log, retention_ms=1000, max_entries=100)
    t.load(T0)
    for i in range(50):
        t.save(T0 + i, t.add([CancelRequest(f"id{i}-{j}", None, T0) for j in range(10)], T0 + i))
    assert len(t) == 100 and t.evicted == 400
    for i in range(3000):
        late = t.add([CancelRequest(f"late{i}", None, T0)], T0 + 10_000 + i * 10)  # each expires 100 adds later
        t.save(T0 + 10_000 + i * 10, late)
    assert len(t) <= 101
    size = log.path.stat().st_size
    assert size < 2 * 101 * 40 + 1024 * 40 + 100, size  # rewritten when mostly dead
    t.close()  # the log's descriptor is a raw one: the garbage collector would never close it
    again = Tombstones(TombstoneLog(tmp_path), retention_ms=1000, max_entries=100)
    again.load(T0 + 10_000 + 2999 * 10)
    assert len(again) == len(t)
    again.close()


def test_a_repeated_cancel_is_applied_and_written_once_and_renewed_late(tmp_path: Path) -> None:
    log = TombstoneLog(tmp_path)
    t = Tombstones(log, retention_ms=HOUR, max_entries=100)
    t.load(T0)
    a, k = CancelRequest("a", None, T0), CancelRequest(None, "k", T0)
    assert t.add([a, k, a], T0) == [a, k]
    assert t.add([a], T0 + 1) == [a]  # not saved yet: its application may not have finished
    t.save(T0, [a, k])
    size = log.path.stat().st_size
    for _ in range(8):  # the same cancel from every queue
        assert t.add([a, k], T0 + 5) == []
        t.save(T0 + 5, [])
    assert log.path.stat().st_size == size
    assert t.add([k], T0 + HOUR // 2) == [k]  # sent again much later: renewed
    t.save(T0 + HOUR // 2, [k])
    t.expire(T0 + HOUR)
    assert len(t) == 1  # "a" expired, "k" lives on
    t.close()


def test_a_cancel_not_saved_before_a_crash_is_applied_again(make_engine: MakeEngine, clock: ManualClock,
                                                            sink: RecordingSink) -> None:
    """A crash between holding a tombstone and saving it: the cancel comes again (it was not
    acknowledged) and is applied whole, the stored message included."""
    e = make_engine()
    e.schedule([Message("T", b"a", T0 + 10_000, msg_id=f"{_uniq(3)}:1")])
    run = e._run
    assert run is not None
    run.tombstones.add([CancelRequest(_uniq(3), None, T0)], T0)  # held, then the process dies
    run.tombstones._unsaved.clear()
    e.stop()
    e = make_engine()
    assert e.stats().tombstones == 0
    assert e.apply_cancels([CancelRequest(_uniq(3), None, T0)]) == 1
    drive(e, clock, T0 + 20_000)
    assert sink.sent == []


@pytest.mark.parametrize("bad", [dict(msg_id=None, key=None), dict(msg_id="a", key="b"), dict(msg_id="", key=None),
                                 dict(msg_id=None, key="x" * 70_000)])
def test_a_cancel_names_exactly_one_id_or_key(bad: dict) -> None:
    with pytest.raises(ValueError):
        CancelRequest(born_ms=0, **bad)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["id", "full-id", "key"]), st.integers(0, 5)), max_size=8),
       st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 5)), st.integers(0, 3),
                          st.lists(st.integers(0, 5), max_size=3)), max_size=12))
def test_screen_agrees_with_a_plain_reading_of_the_rules(tmp_path_factory: pytest.TempPathFactory,
                                                         cancels: list, messages: list) -> None:
    t = Tombstones(TombstoneLog(tmp_path_factory.mktemp("t")), retention_ms=HOUR, max_entries=1000)
    t.load(T0)
    reqs = [CancelRequest({"id": f"U{x}", "full-id": f"U{x}:{x % 4}"}.get(kind), f"k{x}" if kind == "key" else None,
                          T0) for kind, x in cancels]
    t.save(T0, t.add(reqs, T0))
    msgs = [Message("T", b"", T0, keys=tuple(f"k{k}" for k in keys), msg_id=None if u is None else f"U{u}:{c}")
            for u, c, keys in messages]
    want = []
    for i, m in enumerate(msgs):
        by_id = m.msg_id is not None and any(r.msg_id in (m.msg_id, m.msg_id.split(":")[0]) for r in reqs)
        by_key = any(r.key in m.keys for r in reqs)
        if by_id or by_key:
            want.append(i)
    assert t.screen(msgs, T0 + 1000) == want
    t.close()


def test_compaction_keeps_a_cancel_still_being_applied_off_the_disk(tmp_path: Path) -> None:
    t = Tombstones(TombstoneLog(tmp_path), retention_ms=1000, max_entries=10_000)
    t.load(T0)
    t.save(T0, t.add([CancelRequest(f"old{i}", None, T0) for i in range(3000)], T0))
    pending = t.add([CancelRequest("pending", None, T0)], T0 + 5000)  # everything older expires: the log compacts
    assert [x.text for x in TombstoneLog(tmp_path).read().tombstones] == []
    t.save(T0 + 5000, pending)
    assert [x.text for x in TombstoneLog(tmp_path).read().tombstones] == ["pending"]
    t.close()


def test_evictions_are_counted_and_exported(make_engine: MakeEngine, clock: ManualClock) -> None:
    from timewheel.app.metrics import EngineCollector
    e = make_engine(max_tombstones=10)
    e.apply_cancels([CancelRequest(f"nothing-{i}", None, T0) for i in range(25)])
    assert e.stats().counters.cancel_tombstones_evicted == 15
    names = {s.name: s.value for m in EngineCollector(e.stats, lambda: e.lateness_buckets).collect() for s in m.samples}
    assert names["timewheel_cancel_tombstones_evicted_total"] == 15


def test_a_failing_checkpoint_is_kept_until_one_succeeds(make_engine: MakeEngine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine()
    run = e._run
    assert run is not None
    assert e.checkpoint_failure() is None

    def broken() -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(run.store, "checkpoint", broken)
    run.housekeeper.run_once()
    assert "No space left" in (e.checkpoint_failure() or "")
    monkeypatch.undo()
    run.housekeeper.run_once()
    assert e.checkpoint_failure() is None


def test_a_checkpoint_fsyncs_the_tombstone_log_in_async_mode(make_engine: MakeEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine(flush="async")
    e.apply_cancels([CancelRequest("some-id", None, T0)])
    run = e._run
    assert run is not None
    flushed: list[bool] = []
    real = run.tombstones._log.flush

    def flush() -> None:
        flushed.append(True)
        real()

    monkeypatch.setattr(run.tombstones._log, "flush", flush)
    run.housekeeper.run_once()
    assert flushed == [True]


def test_a_batch_of_cancels_is_recorded_in_one_dispatch_frame_per_segment(make_engine: MakeEngine, clock: ManualClock,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine()
    ids = e.schedule([Message("T", b"b", T0 + 2 * HOUR + i, msg_id=f"{_uniq(i)}:0000000{i % 10}") for i in range(50)])
    assert e.store is not None
    frames: list[int] = []
    real = e.store.record_dispatch

    def record_dispatch(seg: int, entries: np.ndarray, now: int) -> None:
        frames.append(len(entries))
        real(seg, entries, now)

    monkeypatch.setattr(e.store, "record_dispatch", record_dispatch)
    assert e.apply_cancels([CancelRequest(i, None, T0) for i in ids]) == 50
    assert frames == [50]
    assert e.stats().counters.cancelled == 50


def test_cancels_of_a_segment_are_let_go_with_it(make_engine: MakeEngine, clock: ManualClock,
                                                 sink: RecordingSink) -> None:
    """The queue remembers a cancel of a loaded segment until that segment is done, not forever:
    every send tests its batch against what it remembers."""
    e = make_engine()
    e.schedule([Message("T", b"x", T0 + 1000 + i, msg_id=f"{_uniq(i)}:1") for i in range(20)])
    drive(e, clock, T0 + 1)  # loaded into the wheel: a cancel now is remembered by the queue too
    e.apply_cancels([CancelRequest(_uniq(i), None, T0) for i in range(0, 20, 2)])
    assert e._run is not None
    queue = e._run.queue
    assert queue.cancelled_held() == 10 and e.stats().cancels_held == 10
    drive(e, clock, T0 + 10_000)
    assert sorted(m for m, _ in sink.sent) == [f"{_uniq(i)}:1" for i in range(1, 20, 2)]
    assert queue.cancelled_held() == 10, "the segment is not over yet"
    e.schedule([Message("T", b"y", T0 + HOUR + 1000, msg_id="next-hour")])
    clock.set(T0 + HOUR)
    drive(e, clock, T0 + HOUR + 5000)
    assert queue.cancelled_held() == 0 and e.stats().cancels_held == 0
    assert [m for m, _ in sink.sent][-1] == "next-hour"


def test_a_cancelled_entry_due_before_its_removal_is_still_never_sent(make_engine: MakeEngine, clock: ManualClock,
                                                                      sink: RecordingSink) -> None:
    """Cancelled entries leave the wheel in batches, up to a second later: one that comes due
    meanwhile reaches the dispatch queue, which drops it."""
    e = make_engine()
    e.schedule([Message("T", b"x", T0 + 200, msg_id=f"{_uniq(1)}:1"),
                Message("T", b"y", T0 + 200, msg_id=f"{_uniq(2)}:1")])
    drive(e, clock, T0 + 1)
    e.apply_cancels([CancelRequest(_uniq(1), None, T0)])
    assert e.stats().wheel_entries == 2, "not removed yet: batched"
    drive(e, clock, T0 + 500)
    assert [m for m, _ in sink.sent] == [f"{_uniq(2)}:1"]
    drive(e, clock, T0 + 1500)
    assert e.stats().wheel_entries == 0 and e.stats().counters.cancelled == 1


def test_many_cancels_leave_the_wheel_at_the_next_pass(make_engine: MakeEngine, clock: ManualClock,
                                                       sink: RecordingSink) -> None:
    e = make_engine()
    n = 5000  # past the removal batch: no waiting for the second to pass
    e.schedule([Message("T", b"x", T0 + 10_000, msg_id=f"{_uniq(i)}:1") for i in range(n)])
    drive(e, clock, T0 + 1)
    e.apply_cancels([CancelRequest(_uniq(i), None, T0) for i in range(n)])
    assert e.next_wakeup_ms() == T0 + 1, "the removal is due now"
    drive(e, clock, T0 + 2)
    assert e.stats().wheel_entries == 0
    drive(e, clock, T0 + 20_000)
    assert sink.sent == [] and e.stats().counters.cancelled == n
