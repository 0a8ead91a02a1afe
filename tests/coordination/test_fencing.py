"""The fencing deadline: extended by confirmed contact, never by an answer older than a revocation;
the fenced sink: where a send batch's fence is decided (before it goes, at the write, after)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pytest

from coordination import FencedDeadLetters, FencedSink, FencingDeadline, HAConfig, NotHoldingError
from storage import RecordBytes
from tests.timewheel.conftest import T0, drive
from timewheel import Engine, EngineConfig, ManualClock, Message, SendResults
from timewheel.errors import ConfigError


class FakeMonotonic:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_holder_may_send_until_a_fraction_of_the_session_after_its_last_confirmed_request() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(10.0, 0.6, clock)
    assert not fence.may_send()  # nothing confirmed yet
    fence.confirmed(sent_at=100.0)
    clock.t = 105.9
    assert fence.may_send()
    clock.t = 106.0  # sent at 100 + 0.6 * 10: the server cannot have expired the session before 110
    assert not fence.may_send()
    fence.confirmed(sent_at=105.5)  # a renewal sent before the deadline, answered after it
    assert fence.may_send() and fence.remaining_s() == pytest.approx(5.5)


def test_a_pause_longer_than_the_session_leaves_the_deadline_behind() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(6.0, 0.6, clock)
    fence.confirmed(100.0)
    clock.t = 100.0 + 30  # SIGSTOP for 30 s: the monotonic clock went on
    assert not fence.may_send()


def test_an_answer_to_a_request_sent_before_a_revocation_extends_nothing() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(10.0, 0.6, clock)
    fence.confirmed(100.0)
    clock.t = 101.0
    fence.revoke()  # connection suspended
    assert not fence.may_send()
    fence.confirmed(sent_at=100.5)  # its answer arrives late
    assert not fence.may_send()
    clock.t = 102.0
    fence.confirmed(sent_at=101.5)  # sent after the revocation, on a connection that works again
    assert fence.may_send()


def test_a_smaller_negotiated_session_shrinks_the_deadline_and_a_larger_one_does_not_grow_it() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(10.0, 0.5, clock)
    fence.set_session_timeout(20.0)
    fence.confirmed(100.0)
    assert fence.remaining_s() == pytest.approx(5.0)
    fence.set_session_timeout(4.0)
    fence.confirmed(100.0)
    assert fence.remaining_s() == pytest.approx(5.0)  # never shortened by an older confirmation either
    fence.confirmed(104.0)
    assert fence.remaining_s() == pytest.approx(6.0)  # 104 + 0.5 * 4 - 100


@pytest.mark.parametrize("kw, key", [
    ({"zookeeper": "127.0.0.1:2181"}, "replica_id"),
    ({"zookeeper": "localhost", "replica_id": "a"}, "zookeeper"),
    ({"shards": 2, "shard": 2}, "shard"),
    ({"fence_fraction": 1.0}, "fence_fraction"),
    ({"session_timeout_s": 4.0, "watermark_interval_s": 5.0}, "watermark_interval_s"),
    ({"root": "timewheel"}, "root"),
    ({"zookeeper": "127.0.0.1:2181", "replica_id": "a/b"}, "replica_id"),
    ({"dedupe_brokers_publish_timeout_s": 0.0}, "dedupe_brokers_publish_timeout_s"),
    ({"dedupe_brokers_publish_timeout_s": math.inf}, "dedupe_brokers_publish_timeout_s"),
], ids=["replica_id-required", "no-port", "shard-out-of-range", "fraction", "watermark-interval", "root", "slash",
        "publish-timeout-zero", "publish-timeout-endless"])
def test_invalid_ha_settings_name_their_key(kw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"ha\.{key} = "):
        HAConfig(**kw)  # type: ignore[arg-type]


def test_a_replica_reads_its_shard_under_a_group_of_its_own() -> None:
    cfg = HAConfig(zookeeper="127.0.0.1:2181,127.0.0.1:2182", shards=3, shard=1, replica_id="b")
    assert cfg.enabled and not HAConfig().enabled
    assert [q for q in range(8) if cfg.owns_queue(q)] == [1, 4, 7]
    assert cfg.consumer_group("tw") == "tw-shard1-b"
    assert cfg.shard_path("TW_DELAY") == "/timewheel/TW_DELAY/shard-1-of-3"


class RecordsSink:
    """A delivery sink that takes stored records and, like the producer, asks the fence at the write."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.sent: list[str] = []
        self.fence_seen: list[bool] = []

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        self.sent += [m.msg_id or "" for m in messages]
        return [True] * len(messages)

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Callable[[], bool] | None = None) -> list[bool]:
        if fence is not None:
            self.fence_seen.append(fence())
            if not self.fence_seen[-1]:
                n = len(records)  # stopped at the write: unsent, held as the producer's FencedError is
                return SendResults([False] * n, errors=["FencedError: not sent"] * n, held=np.ones(n, bool))
        self.sent += [records.record(i).msg_id for i in range(len(records))]
        return [True] * len(records)


class Toggle:
    """A fence the test opens and closes; `closes_after` calls close it by itself (a pause mid-batch)."""

    def __init__(self) -> None:
        self.open = True
        self.closes_after: int | None = None

    def __call__(self) -> bool:
        if self.closes_after is not None:
            if self.closes_after == 0:
                self.open = False
            self.closes_after -= 1
        return self.open


def test_a_closed_fence_sends_nothing_and_holds_every_row() -> None:
    inner, fence = RecordsSink(ManualClock(0)), Toggle()
    fence.open = False
    out = FencedSink(inner, fence).send_batch([Message("T", b"x", 0, msg_id="a")])
    assert inner.sent == [] and out == [False]
    assert isinstance(out, SendResults) and out.held is not None and out.held.tolist() == [True]


def test_the_fence_decides_before_the_batch_and_at_the_write(tmp_path: Path) -> None:
    """One engine, no gate: the fence alone holds; held rows spend no attempt and go once it opens."""
    clock = ManualClock(T0)
    inner, fence = RecordsSink(clock), Toggle()
    e = Engine(EngineConfig(tmp_path / "d", max_attempts=1), FencedSink(inner, fence), clock, seed=1).start(
        background=False)
    ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 1000) for i in range(6)])
    drive(e, clock, T0 + 2_500)
    assert inner.sent == ids[:2] and all(inner.fence_seen)  # the write asked the fence each time
    fence.closes_after = 1  # open before the batch, closed at the write (a pause while encoding)
    drive(e, clock, T0 + 3_500)
    assert inner.sent == ids[:2] and inner.fence_seen[-1] is False
    drive(e, clock, T0 + 10_000)  # closed: not one message more
    assert inner.sent == ids[:2]
    assert e.stats().counters.dead_lettered == 0 and e.stats().counters.send_failures == 0
    fence.open, fence.closes_after = True, None
    drive(e, clock, T0 + 11_000)
    e.stop()
    assert sorted(inner.sent) == sorted(ids) and len(inner.sent) == len(ids)


class DeadLetters:
    """A dead-letter sink that keeps what it was given."""

    def __init__(self) -> None:
        self.parked: list[str] = []

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        self.parked += [m.msg_id or "" for m in messages]


class TimesOutAsTheFenceCloses(RecordsSink):
    """The first batch is written, then the lease runs out before its answer: a timeout."""

    def __init__(self, clock: ManualClock, fence: Toggle) -> None:
        super().__init__(clock)
        self.fence = fence
        self.time_outs = 1

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Callable[[], bool] | None = None) -> list[bool]:
        if not self.time_outs:
            return super().send_records(records, extra, fence)
        self.time_outs -= 1
        self.fence.open = False
        n = len(records)
        return SendResults([False] * n, errors=["RequestTimeoutError: no answer in time"] * n)


def test_a_replica_whose_last_attempt_failed_as_its_fence_closed_does_not_dead_letter_it_while_fenced(
        tmp_path: Path) -> None:
    # its next holder looks the message up and delivers it: dead-lettered too, it would be both
    clock, fence = ManualClock(T0), Toggle()
    inner, parked = TimesOutAsTheFenceCloses(clock, fence), DeadLetters()
    e = Engine(EngineConfig(tmp_path / "d", max_attempts=1), FencedSink(inner, fence), clock, seed=1,
               dead_letter_sink=FencedDeadLetters(parked, fence)).start(background=False)
    [mid] = e.schedule([Message("T", b"x", T0 + 1000)])
    drive(e, clock, T0 + 30_000)
    assert parked.parked == [] and inner.sent == []  # fenced: neither sent nor parked
    fence.open = True
    drive(e, clock, T0 + 60_000)
    e.stop()
    assert inner.sent == [mid] and parked.parked == []


def test_fenced_dead_letters_refuse_while_closed_and_pass_on_while_open() -> None:
    fence, parked = Toggle(), DeadLetters()
    sink = FencedDeadLetters(parked, fence)
    fence.open = False
    with pytest.raises(NotHoldingError, match="may not send now"):
        sink.dead_letter([Message("T", b"x", 0, msg_id="a")], "why")
    fence.open = True
    sink.dead_letter([Message("T", b"x", 0, msg_id="b")], "why")
    assert parked.parked == ["b"]


class _PacedSink:
    """A delivery sink that says how it wants sends paced, as `forwarder.delivery.RocketMQSink` does."""

    max_in_flight = 3
    linger_ms = 1
    linger_max_ms = 6

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        return [True] * len(messages)

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Callable[[], bool] | None = None) -> list[bool]:
        return [True] * len(records)


def test_the_replica_sets_wrappers_keep_the_delivery_sinks_pacing(tmp_path: Path) -> None:
    """The engine reads how to pace sends (threads, the linger and how far it grows with the due rate)
    from its sink: the replica set's wrappers must hand the delivery sink's on, or an engine of a
    replica set sends in many small batches under load (the linger stuck at its quiet floor)."""
    from coordination import EpochStampingSink

    class _Epoch:
        epoch = 1

    sink = FencedSink(EpochStampingSink(_PacedSink(), _Epoch()), lambda: True)  # type: ignore[arg-type]
    assert (sink.max_in_flight, sink.linger_ms, getattr(sink, "linger_max_ms", None)) == (3, 1, 6)
    e = Engine(EngineConfig(tmp_path / "d"), sink, ManualClock(T0), seed=1).start(background=False)
    try:
        assert e._run is not None and e._run.queue._linger_max == 6
    finally:
        e.stop()
