"""The delivery gate: a standby records what the holder delivered and holds the rest; the fence holds
without spending attempts; the delivered-up-to watermark never passes an entry not yet done."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

from coordination.watermark import Watermark, covered_by
from forwarder.shaping import TrafficShaper, parse_rules

from storage import CANCELLED, DELIVERED, RETRIED, ScheduleStore, read_dispatch_log
from tests.timewheel.conftest import T0, RecordingSink, drive
from timewheel import NO_WATERMARK, Engine, EngineConfig, ManualClock, Message
from timewheel.message import SendResults


class ScriptedGate:
    """A gate the test opens, closes and moves by hand."""

    hold_ms = 100
    took_over_ms = 0  # the test sets it when this replica takes over

    def __init__(self) -> None:
        self.open = False
        self.watermark = NO_WATERMARK
        self.peer_delivered = 0
        self.held = 0
        self.offsets: dict[str, int] | None = None
        self.exceptions: tuple[tuple[str, int, int], ...] = ()

    def may_send(self) -> bool:
        return self.open

    def delivered_elsewhere_up_to(self) -> int:
        return self.watermark

    def delivered_elsewhere(self, due: np.ndarray, origins: np.ndarray, queue_names: Sequence[str]) -> np.ndarray:
        return covered_by([self.mark()], due, origins, queue_names, 2**62)

    def mark(self) -> Watermark:
        """What the holder published: the watermark, with offsets once the test sets them."""
        return Watermark(1, self.watermark, "holder", 0, self.offsets, self.exceptions)

    def count(self, peer_delivered: int, held: int) -> None:
        self.peer_delivered += peer_delivered
        self.held += held


def _engine(path: Path, sink: RecordingSink, clock: ManualClock, gate: ScriptedGate | None,
            *, shaper: TrafficShaper | None = None, **kw: object) -> Engine:
    return Engine(EngineConfig(path, **kw), sink, clock, seed=1, gate=gate,  # type: ignore[arg-type]
                  shaper=shaper).start(background=False)


def _dispatch_rows(path: Path, segment_minutes: int = 60) -> list[tuple[int, int, int]]:
    """(due, outcome, attempts) of every dispatch-log row, sorted by due time."""
    store = ScheduleStore(path, segment_minutes=segment_minutes)
    try:
        rows = [(int(r["due_ms"]), int(r["outcome"]), int(r["attempts"])) for seg in store.layout.list_segments()
                for r in read_dispatch_log(store.layout.dispatch_log(seg)).entries]
    finally:
        store.close()
    return sorted(rows)


def test_a_standby_records_what_the_holder_delivered_and_sends_the_rest_after_taking_over(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 100) for i in range(100)])  # due T0+1s..T0+10.9s
    gate.watermark = T0 + 3_000  # the holder published: everything due by T0+3s is delivered
    drive(e, clock, T0 + 6_000)
    assert sink.sent == []  # a standby sends nothing
    assert gate.peer_delivered == 21  # due T0+1.0s .. T0+3.0s
    assert gate.held > 0  # due after the watermark: waiting for the lease
    gate.watermark = T0 + 5_000  # the holder's last watermark before it died
    gate.open = True  # this replica takes over: overdue ones (due 5.1-6 s) go at once, the rest on time
    drive(e, clock, T0 + 12_000)
    e.stop()
    sent_at = dict(sink.sent)
    assert len(sink.sent) == 59 and set(sent_at) == set(ids[41:])  # each once, none due by the watermark
    # overdue at the takeover: at once, or when their hold ends
    assert all(T0 + 6_000 <= sent_at[ids[i]] <= T0 + 6_000 + gate.hold_ms for i in range(41, 51))
    assert all(sent_at[ids[i]] == T0 + 1000 + i * 100 for i in range(51, 100))  # the rest on time
    assert gate.peer_delivered == 41
    rows = _dispatch_rows(tmp_path / "d")
    assert [(o, a) for _, o, a in rows] == [(DELIVERED, 0)] * 41 + [(DELIVERED, 1)] * 59
    # the record is durable: the same data directory served again without a gate sends nothing twice
    again = _engine(tmp_path / "d", sink, clock, None)
    drive(again, clock, T0 + 20_000)
    again.stop()
    assert len(sink.sent) == 59


def test_a_closed_fence_holds_without_spending_attempts(tmp_path: Path, clock: ManualClock,
                                                        sink: RecordingSink) -> None:
    gate = ScriptedGate()
    gate.open = True
    e = _engine(tmp_path / "d", sink, clock, gate, max_attempts=1)  # one failed attempt would dead-letter
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 1000) for i in range(10)])
    drive(e, clock, T0 + 3_500)
    assert len(sink.sent) == 3
    gate.open = False  # the deadline passed: not one message more
    drive(e, clock, T0 + 30_000)
    assert len(sink.sent) == 3
    assert e.stats().counters.dead_lettered == 0 and e.stats().counters.send_failures == 0
    gate.open = True  # confirmed again
    drive(e, clock, T0 + 31_000)
    e.stop()
    assert [m for m, _ in sink.sent] == ids
    assert all(m.attempts == 1 for m in sink.messages)


def test_the_watermark_stops_before_the_earliest_message_not_yet_delivered(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    e = _engine(tmp_path / "d", sink, clock, None, retry_base_ms=1000, max_attempts=100)
    e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 1000) for i in range(10)])
    drive(e, clock, T0 + 2_500)
    assert e.delivered_up_to() == T0 + 2_500  # everything due by the last pass went out
    sink.busy = True  # the broker fails every send: what comes due waits for retries
    drive(e, clock, T0 + 8_000)
    assert e.delivered_up_to() == T0 + 3_000 - 1  # the first failed one holds it back
    sink.busy = False
    drive(e, clock, T0 + 20_000)
    assert e.delivered_up_to() == T0 + 20_000
    assert len(sink.sent) == 10
    e.stop()


def test_a_standby_finishes_past_segments_while_it_holds_what_is_due_now(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate, segment_minutes=1, preload_seconds=5)
    e.schedule([Message("T", str(i).encode(), T0 + 500 + i * 500) for i in range(400)])  # 200 s, four segments
    for t in range(T0, T0 + 190_000, 1_000):  # the holder's watermark trails the clock by a second
        gate.watermark = t - 1_000
        drive(e, clock, t)
        assert sink.sent == []
    assert e.stats().retrying > 0  # what came due since the watermark waits for the lease
    assert e._require_started().store.meta.done_segments() >= {T0, T0 + 60_000, T0 + 120_000}
    e.stop()


def test_a_message_that_arrives_after_the_watermark_passed_its_due_time_is_sent_by_the_new_holder(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    """The holder published W with the offsets it had stored; a message of the same queue at a later
    offset, already due by W (a relay draining a backlog, a retry, a "deliver now"), reaches this
    replica after the takeover: the holder never had it, so this replica must send it."""
    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate)
    on_time = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 100) for i in range(10)],
                         [("broker-a:0", i) for i in range(10)])
    gate.watermark = T0 + 5_000
    gate.offsets = {"broker-a:0": 10}  # the holder had stored offsets 0-9 when it published
    drive(e, clock, T0 + 4_000)
    assert gate.peer_delivered == 10 and sink.sent == []
    gate.open = True  # the holder died; this replica holds the lease with the mark it took over from
    late = e.schedule([Message("T", b"late", T0 + 2_000), Message("T", b"later", T0 + 3_000)],
                      [("broker-a:0", 10), ("broker-b:0", 0)])  # due before W, stored after the takeover
    replayed = e.schedule([Message("T", b"again", T0 + 2_500, msg_id="old-offset")], [("broker-a:0", 3)])
    drive(e, clock, T0 + 6_000)
    e.stop()
    sent = [mid for mid, _ in sink.sent]
    assert sorted(sent) == sorted(late)  # the late ones, once each; none the holder had
    assert not set(sent) & set(on_time) and replayed[0] not in sent  # below the holder's offsets: its own


def test_a_late_message_whose_origin_row_was_lost_is_held_by_a_standby_and_sent_once_it_holds_the_lease(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    """A power loss on a filesystem that keeps a file's size but not its data left the message's
    origin row as zeros: read as queue 0 offset 0 (below every offset the holder published), then as
    "unknown" and judged by the watermark alone, a late message was recorded delivered by the holder,
    which never had it, and nobody sent it. A row that fails its check now keeps it held."""
    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate)
    gate.watermark = T0 + 5_000
    gate.offsets = {"broker-a:0": 10}  # the holder had stored offsets 0-9 when it published
    [late] = e.schedule([Message("T", b"late", T0 + 2_000)], [("broker-a:0", 10)])  # due before W, stored after
    [org] = (tmp_path / "d" / "schedule").glob("*/00000.org")
    with open(org, "r+b") as f:  # the row's data never reached the disk: zeros, the size kept
        f.write(bytes(16))
    drive(e, clock, T0 + 4_000)
    assert gate.peer_delivered == 0 and sink.sent == []  # held: not the holder's to have sent
    gate.open = True  # the holder died; this replica holds the lease
    drive(e, clock, T0 + 6_000)
    e.stop()
    assert [mid for mid, _ in sink.sent] == [late]


def test_origin_rows_that_fail_their_check_are_counted_in_the_stats_the_metrics_and_the_status(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    """A standby holds a record whose origin row was lost until it holds the lease: the count of
    such rows was only in the log, so an operator could not see why a standby held records."""
    from timewheel.app.metrics import EngineCollector
    from timewheel.app.status import status_document

    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate)
    gate.watermark, gate.offsets = T0 + 5_000, {"broker-a:0": 10}
    e.schedule([Message("T", b"late", T0 + 2_000)], [("broker-a:0", 10)])
    [org] = (tmp_path / "d" / "schedule").glob("*/00000.org")
    with open(org, "r+b") as f:  # the row's data never reached the disk: zeros, the size kept
        f.write(bytes(16))
    try:
        assert e.stats().storage_corrupt_origin_rows == 0  # not read yet
        drive(e, clock, T0 + 4_000)
        stats = e.stats()
        assert stats.storage_corrupt_origin_rows == 1
        samples = {s.name: s.value for m in EngineCollector(e.stats, lambda: e.lateness_buckets).collect()
                   for s in m.samples}
        assert samples["timewheel_storage_corrupt_origin_rows_total"] == 1.0
        doc = status_document(stats.as_dict(), serving=True, now_ms=T0, lag=None, lag_error=None,
                              lateness_ms=[0.0, 0.0], lateness_count=0, lateness_span_ms=0)
        assert doc["storage_corrupt_origin_rows"] == 1
    finally:
        e.stop()


def test_without_offsets_a_late_message_would_be_recorded_as_delivered(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    """What the offsets fix, shown with a holder that publishes none: the watermark alone drops it."""
    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate)
    gate.watermark, gate.open = T0 + 5_000, True
    e.schedule([Message("T", b"late", T0 + 2_000)], [("broker-a:0", 10)])
    drive(e, clock, T0 + 6_000)
    e.stop()
    assert sink.sent == [] and gate.peer_delivered == 1


def test_a_batch_that_fails_after_it_left_the_queue_goes_back_and_the_engine_stops_dispatching(
        tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> None:
    """A standby writing its "delivered by the holder" rows hits a full disk: before, the batch was
    logged and dropped, the watermark passed it, and after a takeover nobody sent it."""
    from storage import StorageWriteError

    gate = ScriptedGate()
    e = _engine(tmp_path / "d", sink, clock, gate)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 100) for i in range(10)])
    gate.watermark = T0 + 1_400  # the holder delivered the first five
    run = e._require_started()
    real = run.store.record_dispatch
    calls = {"n": 0}

    def full_disk(*a: object, **kw: object) -> None:
        calls["n"] += 1
        raise StorageWriteError("No space left on device")

    run.store.record_dispatch = full_disk  # type: ignore[method-assign]
    failed = None
    try:
        drive(e, clock, T0 + 3_000)
    except StorageWriteError as err:
        failed = err
    assert failed is not None and calls["n"] >= 1  # the error is not swallowed
    assert run.dispatcher.failed
    assert e.delivered_up_to() < T0 + 1_000  # nothing taken is past the watermark
    run.store.record_dispatch = real  # type: ignore[method-assign]
    gate.watermark, gate.open = NO_WATERMARK, True  # the next holder: the holder's claim is gone too
    run.dispatcher.failed = False
    drive(e, clock, T0 + 5_000)
    e.stop()
    assert sorted(mid for mid, _ in sink.sent) == sorted(ids)  # none lost


class RefusingSink(RecordingSink):
    """A broker that refuses one topic (every send to it fails) and takes the rest."""

    def __init__(self, clock: ManualClock, refused: str) -> None:
        super().__init__(clock)
        self.refused = refused

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        ok = [m.topic != self.refused for m in messages]
        sent = super().send_batch([m for m, good in zip(messages, ok) if good])
        it = iter(sent)
        return [next(it) if good else False for good in ok]


def test_one_message_stuck_retrying_does_not_hold_the_watermark_back_and_the_next_holder_sends_it(
        tmp_path: Path, clock: ManualClock) -> None:
    """The holder lists the stuck message as an exception and its watermark moves on with the rest of
    the shard; a standby records everything else as delivered, holds the stuck one, and sends it (and
    nothing else) once it holds the lease. Before exceptions, W stayed before the stuck message and the
    new holder sent again everything due after it."""
    holder_sink = RefusingSink(clock, "BAD")
    holder = _engine(tmp_path / "a", holder_sink, clock, None, retry_base_ms=1000, max_attempts=1000)
    standby_sink = RecordingSink(clock)
    gate = ScriptedGate()
    standby = _engine(tmp_path / "b", standby_sink, clock, gate)
    msgs = [Message("BAD" if i == 3 else "T", str(i).encode(), T0 + 1000 + i * 500, msg_id=f"m{i}")
            for i in range(20)]  # due T0+1s .. T0+10.5s; m3 (due T0+2.5s) goes to a topic the broker refuses
    origins = [("broker-a:0", i) for i in range(20)]
    holder.schedule(msgs, origins)
    standby.schedule(msgs, origins)
    for t in range(T0, T0 + 12_001, 1_000):  # the holder publishes every second; the standby follows
        drive(holder, clock, t)
        mark = holder.delivered_up_to_except(64)
        gate.watermark, gate.offsets, gate.exceptions = mark.up_to, {"broker-a:0": 20}, mark.exceptions
        drive(standby, clock, t)
    assert holder.delivered_up_to() == T0 + 2_500 - 1  # the plain watermark is stuck before m3
    mark = holder.delivered_up_to_except(64)
    assert mark.up_to == T0 + 12_000 and mark.exceptions == (("broker-a:0", 3, T0 + 2_500),)
    assert holder.delivered_up_to_except(0).up_to == T0 + 2_500 - 1  # past the bound: held back as before
    assert sorted(mid for mid, _ in holder_sink.sent) == sorted(f"m{i}" for i in range(20) if i != 3)
    assert standby_sink.sent == [] and gate.peer_delivered == 19  # everything but m3, none sent here
    holder.stop()  # the holder dies; the standby takes over with the last mark
    gate.open = True
    drive(standby, clock, T0 + 14_000)
    standby.stop()
    assert [mid for mid, _ in standby_sink.sent] == ["m3"]  # the stuck one is sent, nothing twice


def test_a_stuck_message_the_two_replicas_stored_from_different_copies_is_not_recorded_delivered_by_the_standby(
        tmp_path: Path, clock: ManualClock) -> None:
    """A producer's retry can leave two copies of one delay message (one id, one due time) on two
    queues of a shard; each replica stores the copy it reads first and drops the other as a repeated
    id, and the two may read them in either order. The holder names its stuck copy by its origin: the
    standby's copy has another origin. Before, the standby found its copy covered by the mark (due by
    W, below the offsets: the holder had read that copy too, and dropped it), recorded it as delivered,
    and after the failover nobody sent the message."""
    holder_sink = RefusingSink(clock, "BAD")
    holder = _engine(tmp_path / "a", holder_sink, clock, None, retry_base_ms=1000, max_attempts=1000)
    standby_sink = RecordingSink(clock)
    gate = ScriptedGate()
    standby = _engine(tmp_path / "b", standby_sink, clock, gate)
    msgs = [Message("BAD" if i == 3 else "T", str(i).encode(), T0 + 1000 + i * 500, msg_id=f"m{i}")
            for i in range(20)]  # m3 (due T0+2.5s) goes to a topic the broker refuses
    origins = [("broker-a:0", i) for i in range(20)]
    retried = ([msgs[3]], [("broker-b:0", 0)])  # the producer's retry stored m3 again on another broker
    holder.schedule(*retried)  # the holder reads that copy first, and drops broker-a:0's as a repeat
    assert holder.schedule(msgs, origins) and holder.stats().counters.duplicates == 1
    standby.schedule(msgs, origins)  # the standby reads them the other way round
    standby.schedule(*retried)
    assert standby.stats().counters.duplicates == 1
    for t in range(T0, T0 + 12_001, 1_000):  # the holder publishes every second; the standby follows
        drive(holder, clock, t)
        mark = holder.delivered_up_to_except(64)
        gate.watermark, gate.offsets, gate.exceptions = mark.up_to, {"broker-a:0": 20, "broker-b:0": 1}, \
            mark.exceptions
        drive(standby, clock, t)
    assert mark.up_to == T0 + 12_000 and mark.exceptions == (("broker-b:0", 0, T0 + 2_500),)
    assert sorted(mid for mid, _ in holder_sink.sent) == sorted(f"m{i}" for i in range(20) if i != 3)
    assert standby_sink.sent == [] and gate.peer_delivered == 19  # everything but m3
    holder.stop()  # the holder dies with m3 unsent; the standby takes over with the last mark
    gate.open = True
    drive(standby, clock, T0 + 14_000)
    standby.stop()
    assert [mid for mid, _ in standby_sink.sent] == ["m3"]


def test_a_cancel_a_standby_reads_after_its_message_came_due_is_kept_when_it_takes_over(
        tmp_path: Path, clock: ManualClock) -> None:
    """A replica reading the delay topic again (a wiped directory) reads some cancels after their
    messages came due. An engine skips cancels of due messages (they may be in flight), but a standby
    has sent none: before this, it kept the one its gate held and sent it once it held the lease."""
    from timewheel.cancels import CancelRequest

    sink = RecordingSink(clock)
    gate = ScriptedGate()
    standby = _engine(tmp_path / "b", sink, clock, gate)
    standby.schedule([Message("T", b"doomed", T0 + 1000, msg_id="doomed"),
                      Message("T", b"kept", T0 + 1000, msg_id="kept")], [("broker-a:0", 0), ("broker-a:0", 1)])
    drive(standby, clock, T0 + 2000)  # both came due and are held: this replica may not send
    assert sink.sent == [] and gate.held >= 2
    assert standby.apply_cancels([CancelRequest("doomed", None, T0)]) == 1  # read late: already due
    gate.open = True  # it takes the lease
    drive(standby, clock, T0 + 4000)
    standby.stop()
    assert [mid for mid, _ in sink.sent] == ["kept"]
    rows = _dispatch_rows(tmp_path / "b")
    assert sorted(r[1] for r in rows) == sorted([CANCELLED, DELIVERED])  # one outcome each



class _FencedOnTheWay(RecordingSink):
    """Sends the first message of its first batch; the fence closes while the rest are on their way
    (held, as `coordination.FencedSink` marks them), then sends everything."""

    fenced = False

    def send_batch(self, messages: Sequence[Message]) -> SendResults:
        if self.fenced:
            return SendResults(super().send_batch(messages))
        self.fenced = True
        ok = super().send_batch(messages[:1]) + [False] * (len(messages) - 1)
        return SendResults(ok, held=np.array([False] + [True] * (len(messages) - 1)))


def test_rows_a_fence_held_on_their_way_are_not_failed_sends_to_the_traffic_rules(
        tmp_path: Path, clock: ManualClock) -> None:
    # a failed send backs its topic off and spends its tokens: a fence held these, nothing failed
    sink = _FencedOnTheWay(clock)
    shaper = TrafficShaper(parse_rules({"topics": {"T": {"rate": 1000, "burst": 1000}}}))
    e = Engine(EngineConfig(tmp_path / "d"), sink, clock, seed=1, shaper=shaper).start(background=False)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000) for i in range(5)])
    drive(e, clock, T0 + 5_000)
    e.stop()
    assert sorted(m for m, _ in sink.sent) == sorted(ids)
    topic: Any = shaper.stats()["topics"]
    assert (topic["T"]["sent"], topic["T"]["failed"], topic["T"]["backoffs"]) == (5, 0, 0), topic["T"]
    assert not topic["T"]["backed_off"]


def test_a_late_cancel_of_a_message_in_a_past_segment_not_yet_caught_up_is_kept_when_the_standby_takes_over(
        tmp_path: Path, clock: ManualClock) -> None:
    """A standby restarted after a downtime catches its past segments up one by one while its ingest
    reads again what the delay topic got meanwhile: a cancel read then finds its message due, in a
    segment the catch-up has not loaded yet, so nothing in the dispatch queue to withdraw. Before
    this, the cancel was only marked in the meta store; the catch-up then loaded the message like any
    other, the standby held it, and sent it once it held the lease."""
    from timewheel.cancels import CancelRequest

    sink = RecordingSink(clock)
    gate = ScriptedGate()
    first = _engine(tmp_path / "b", sink, clock, gate, segment_minutes=1, preload_seconds=5)
    first.schedule([Message("T", b"doomed", T0 + 61_000, msg_id="doomed"),
                    Message("T", b"kept", T0 + 61_000, msg_id="kept")], [("broker-a:0", 0), ("broker-a:0", 1)])
    drive(first, clock, T0 + 1_000)
    first.stop()  # down while they come due; no holder covers them (its last mark is before them)
    clock.set(T0 + 180_000)
    standby = _engine(tmp_path / "b", sink, clock, gate, segment_minutes=1, preload_seconds=5)
    assert standby._require_started().timer.snapshot()[0] >= 1  # their segment waits for the catch-up
    assert standby.apply_cancels([CancelRequest("doomed", None, T0)]) == 1  # read late: already due
    drive(standby, clock, T0 + 182_000)  # the catch-up loads their segment; held: no lease
    assert sink.sent == []
    gate.open = True  # it takes the lease
    drive(standby, clock, T0 + 184_000)
    standby.stop()
    assert [mid for mid, _ in sink.sent] == ["kept"]
    rows = _dispatch_rows(tmp_path / "b", segment_minutes=1)
    assert sorted(r[1] for r in rows) == sorted([CANCELLED, DELIVERED])  # one outcome each


_LATE: dict[str, Any] = dict(segment_minutes=1, preload_seconds=5, catch_up_chunk=1)
_WHERE = ["held in the dispatch queue", "due but not popped yet", "deferred behind the catch-up"]
_IN_HAND = "in a dispatch pass's hands"
_SHAPED = "held by the traffic shaper after the lease ran out"
_FENCED_ON_ITS_WAY = "on its way when the lease ran out, held by the fence"
_FAILED_ON_ITS_WAY = "on its way when the lease ran out, its send failed"
_ON_ITS_WAY = [_FENCED_ON_ITS_WAY, _FAILED_ON_ITS_WAY]


class _GateFenced(RecordingSink):
    """Holds every batch while its gate is closed, as `coordination.FencedSink` does once the lease's
    fencing deadline passed; sends while it is open (or without a gate)."""

    gate: ScriptedGate | None = None

    def send_batch(self, messages: Sequence[Message]) -> SendResults:
        if self.gate is not None and not self.gate.open:
            return SendResults([False] * len(messages), held=np.ones(len(messages), bool))
        return SendResults(super().send_batch(messages))


class _LeaseLostWhileSending(_GateFenced):
    """Has the engine read the late cancel of "doomed" while the batch carrying it is on its way: the
    lease runs out (the gate closes), the cancel is read, and the batch comes back held by the fence
    (as `coordination.FencedSink` marks it) or, with `fail`, failed (a timeout: retried later)."""

    engine: Engine | None = None
    fail = False

    def send_batch(self, messages: Sequence[Message]) -> SendResults:
        engine, self.engine = self.engine, None
        if engine is None:
            return super().send_batch(messages)
        from timewheel.cancels import CancelRequest
        assert self.gate is not None
        self.gate.open = False
        assert engine.apply_cancels([CancelRequest("doomed", None, T0)]) == 1  # read late: already due
        if self.fail:
            return SendResults([False] * len(messages), errors=["RequestTimeoutError: no answer"] * len(messages))
        return super().send_batch(messages)


def _due_on_a_standby(path: Path, sink: RecordingSink, clock: ManualClock, gate: ScriptedGate, where: str) -> Engine:
    """A standby holding "doomed" and "kept" (and, behind the catch-up, two older ones), come due and
    unsent, `where` the timer, the dispatch queue or the shaper keep them when the cancel is read."""
    def doomed_and_kept(due: int) -> list[Message]:
        return [Message("T", b"doomed", due, msg_id="doomed"), Message("T", b"kept", due, msg_id="kept")]

    if where == "deferred behind the catch-up":
        first = _engine(path, sink, clock, gate, **_LATE)
        first.schedule([Message("T", b"a", T0 + 61_000, msg_id="a"), Message("T", b"b", T0 + 121_000, msg_id="b"),
                        *doomed_and_kept(T0 + 185_000)], [("broker-a:0", i) for i in range(4)])
        first.stop()  # down while they come due
        clock.set(T0 + 190_000)
        standby = _engine(path, sink, clock, gate, **_LATE)
        standby.step()  # loads their segment while two past ones wait: its overdue entries wait behind them
        return standby
    if where == _SHAPED:
        # The shaper holds only what was read while this replica held the lease (a standby's gate holds
        # its due entries in the queue, unread): one a second for topic T, so "early" takes the token.
        assert isinstance(sink, _GateFenced)
        sink.gate = gate
        shaper = TrafficShaper(parse_rules({"topics": {"T": {"rate": 1, "burst": 1}}}))
        holder = _engine(path, sink, clock, gate, shaper=shaper, **_LATE)
        gate.open = True
        holder.schedule([Message("T", b"early", T0 + 500, msg_id="early"), *doomed_and_kept(T0 + 1000)],
                        [("broker-a:0", i) for i in range(3)])
        drive(holder, clock, T0 + 1_000)
        assert [mid for mid, _ in sink.sent] == ["early"] and holder.stats().held_by_shaping == 2
        gate.open = False  # the lease ran out: a standby now, whose shaper still holds the two
        return holder
    if where in _ON_ITS_WAY:  # the lease holder, until its batch is on its way
        assert isinstance(sink, _LeaseLostWhileSending)
        sink.gate, sink.fail = gate, where == _FAILED_ON_ITS_WAY
        gate.open = True
    standby = _engine(path, sink, clock, gate, **_LATE)
    standby.schedule(doomed_and_kept(T0 + 1000), [("broker-a:0", 0), ("broker-a:0", 1)])
    if where == "held in the dispatch queue":
        drive(standby, clock, T0 + 2_000)  # both came due, were taken and are held: no lease
        assert gate.held >= 2
    else:
        drive(standby, clock, T0 + 900)
        clock.set(T0 + 1_500)  # due, and no timer pass since
    return standby


class _CancelMidPass(ScriptedGate):
    """Has the engine read the late cancel while a dispatch pass holds its message in hand (taken,
    not held again yet): asked whether it may send, it applies the cancel first."""

    engine: Engine | None = None

    def may_send(self) -> bool:
        engine, self.engine = self.engine, None
        if engine is not None:
            from timewheel.cancels import CancelRequest
            assert engine.apply_cancels([CancelRequest("doomed", None, T0)]) == 1
        return self.open


def _cancel_late(standby: Engine, gate: _CancelMidPass, where: str) -> None:
    """Have the standby apply the cancel of "doomed", come due already, while `where` holds it."""
    from timewheel.cancels import CancelRequest

    if where == _IN_HAND:
        gate.engine = standby
        standby.step()  # the pass that takes both reads the cancel, then holds them
        assert gate.engine is None
    elif where in _ON_ITS_WAY:
        sink = standby._require_started().dispatcher.sink
        assert isinstance(sink, _LeaseLostWhileSending)
        sink.engine = standby
        standby.step()  # the pass that sends both loses the lease and reads the cancel on the way
        assert sink.engine is None and sink.sent == []
    else:
        assert standby.apply_cancels([CancelRequest("doomed", None, T0)]) == 1  # read late: already due


def _crash(engine: Engine) -> None:
    """Abandon an engine as a kill -9 does: no stop, nothing recorded on the way out. Only its meta
    store is closed, to let go of the lock the operating system lets go of for a killed process."""
    engine._require_started().store.meta.close()


@pytest.mark.parametrize("where", [*_WHERE, _IN_HAND, _SHAPED, *_ON_ITS_WAY])
def test_a_late_cancel_a_standby_applied_before_a_crash_is_kept_when_it_takes_over(
        tmp_path: Path, clock: ManualClock, where: str) -> None:
    """The cancel is acknowledged once applied: the CANCELLED outcome must be in the dispatch log by
    then. Before this, for a loaded segment it was only remembered in memory and recorded when a
    dispatch pass met the entry again (a hold later): killed in between, the replica loaded the
    message again as due and unsent after its restart, and sent it once it held the lease. So it was
    still for an entry a dispatch pass had in hand, or the shaper held, when the cancel came; and for
    one on its way when the lease ran out, back in the queue unsent until a take met it again."""
    sink = _LeaseLostWhileSending(clock)
    gate = _CancelMidPass()
    standby = _due_on_a_standby(tmp_path / "b", sink, clock, gate, "due but not popped yet" if where == _IN_HAND else where)
    _cancel_late(standby, gate, where)
    _crash(standby)
    sink.gate = restarted_gate = ScriptedGate()
    restarted = _engine(tmp_path / "b", sink, clock, restarted_gate, **_LATE)
    now = clock.now_ms()
    drive(restarted, clock, now + 2_000)
    assert [mid for mid, _ in sink.sent if mid != "early"] == []  # still a standby
    restarted_gate.open = True  # it takes the lease
    drive(restarted, clock, now + 4_000)
    restarted.stop()
    sent = [mid for mid, _ in sink.sent]
    assert "doomed" not in sent and "kept" in sent, sent
    rows = _dispatch_rows(tmp_path / "b", segment_minutes=1)
    # one terminal outcome each (a failed send also left its RETRIED rows)
    assert sorted(r[1] for r in rows if r[1] != RETRIED) == sorted([CANCELLED] + [DELIVERED] * len(sent))


@pytest.mark.parametrize("where", [*_WHERE, _IN_HAND, _SHAPED, *_ON_ITS_WAY])
def test_a_late_cancel_is_recorded_once_and_counted_off_its_segment_once(
        tmp_path: Path, clock: ManualClock, where: str) -> None:
    """The CANCELLED outcome is recorded when the cancel is applied (or, for an entry on its way,
    once its pass has it back), once, and counted off the segment once: counted twice, the segment
    would be marked done with a message left, which a restart would never load; not at all, never done."""
    sink = _LeaseLostWhileSending(clock)
    gate = _CancelMidPass()
    standby = _due_on_a_standby(tmp_path / "b", sink, clock, gate, "due but not popped yet" if where == _IN_HAND else where)
    timer = standby._require_started().timer
    seg = T0 + (180_000 if where == "deferred behind the catch-up" else 0)
    _cancel_late(standby, gate, where)
    assert timer.snapshot()[3][str(seg)] == 1  # "kept" only: "doomed" is recorded and counted off
    log = standby._require_started().store.dispatch_log(seg).entries
    assert (log["outcome"] == CANCELLED).sum() == 1  # in the dispatch log by the cancel's acknowledgement
    drive(standby, clock, clock.now_ms() + 1_000)  # held, taken and held again: still a standby
    assert timer.snapshot()[3][str(seg)] == 1
    gate.open = True
    drive(standby, clock, seg + 61_000)  # the segment is over: done once "kept" is delivered
    assert seg in standby._require_started().store.meta.done_segments()
    standby.stop()
    assert [mid for mid, _ in sink.sent if mid in ("doomed", "kept")] == ["kept"]
    rows = [r for r in _dispatch_rows(tmp_path / "b", segment_minutes=1) if r[0] >= seg and r[1] != RETRIED]
    early = [DELIVERED] if where == _SHAPED else []  # the one sent while this replica held the lease
    assert sorted(r[1] for r in rows) == sorted([CANCELLED, DELIVERED, *early])  # one terminal outcome each


class _TakesOverMidPass(_CancelMidPass):
    """The late cancel is read while this replica is still a standby, in the middle of a pass that has
    the message in hand; the same pass is then told it may send (the replica took the lease)."""

    def may_send(self) -> bool:
        if self.engine is None:
            return self.open
        super().may_send()  # the cancel, read as a standby
        self.open = True
        return True


def test_a_pass_that_may_send_after_a_late_cancel_recorded_its_entry_leaves_that_entry_out(
        tmp_path: Path, clock: ManualClock) -> None:
    """The cancel records what a pass took and has not claimed; the pass claims only once it may send,
    and the claim leaves out what was recorded meanwhile: not sent, one outcome each."""
    sink = _GateFenced(clock)
    gate = _TakesOverMidPass()
    standby = _due_on_a_standby(tmp_path / "b", sink, clock, gate, "due but not popped yet")
    _cancel_late(standby, gate, _IN_HAND)
    assert [mid for mid, _ in sink.sent] == ["kept"]  # by the same pass, once it held the lease
    drive(standby, clock, T0 + 61_000)
    assert T0 in standby._require_started().store.meta.done_segments()
    standby.stop()
    assert [mid for mid, _ in sink.sent] == ["kept"]
    assert sorted(r[1] for r in _dispatch_rows(tmp_path / "b", segment_minutes=1)) == sorted([CANCELLED, DELIVERED])
