"""The clock check against the real local RocketMQ: the host clock measured against the broker's, and
delivery held while the host is far ahead, released once it agrees, never held when it cannot measure."""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from forwarder.clock_check import BrokerClockProbe, ClockGuard
from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from storage import RecordBytes
from storage.record_bytes import HEADER_DTYPE
from tests.polling import unique, wait_for
from timewheel.clock import SystemClock
from timewheel.message import Fence, Message, SendResults

pytestmark = pytest.mark.rocketmq

HOUR_MS = 3_600_000
#: the probe's round trip on loopback, and the broker's whole-second index, stay well inside this
_AGREE_MS = 3000


class RecordingSink:
    """A RecordSink that stores everything it is handed, and what the fence said at the write."""

    max_in_flight = 2

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.fence_at_write: list[bool] = []
        self.lock = threading.Lock()

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Fence | None = None) -> list[bool]:
        with self.lock:
            self.fence_at_write.append(fence() if fence is not None else True)
            self.sent.append(len(records))
        return SendResults([True] * len(records))

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        with self.lock:
            self.sent.append(len(messages))
        return [True] * len(messages)


def _messages(n: int) -> list[Message]:
    return [Message("ORDERS", b"x", 0) for _ in range(n)]


def _cfg(rocketmq: LocalRocketMQ, **kw: object) -> RocketMQConfig:
    return RocketMQConfig(namesrv=rocketmq.namesrv_addr, producer_group=unique("tw_clock"), **kw)  # type: ignore[arg-type]


def test_the_probe_measures_a_host_an_hour_ahead_and_one_that_agrees(rocketmq: LocalRocketMQ) -> None:
    clock = SystemClock(HOUR_MS)
    probe = BrokerClockProbe(_cfg(rocketmq), clock.now_ms)
    try:
        ahead = probe.measure()
        clock.offset_ms = 0
        agree = probe.measure()
    finally:
        probe.close()
    assert ahead and {r.broker for r in ahead} == {r.broker for r in agree}
    for r in ahead:
        assert abs(r.offset_ms - HOUR_MS) < _AGREE_MS, r
    for r in agree:
        assert abs(r.offset_ms) < _AGREE_MS, r


def test_the_guard_holds_every_row_while_ahead_and_reopens_once_the_clock_is_put_right(
        rocketmq: LocalRocketMQ) -> None:
    clock = SystemClock(HOUR_MS)
    inner = RecordingSink()
    guard = ClockGuard(inner, BrokerClockProbe(_cfg(rocketmq), clock.now_ms), 30_000, held_period_s=0.05)
    try:
        guard.start(wait_s=10.0)
        assert not guard.may_send()
        held = guard.send_batch(_messages(3))
        assert isinstance(held, SendResults) and held.held is not None
        assert held.held.tolist() == [True] * 3 and list(held) == [False] * 3
        assert inner.sent == []
        status = guard.status()
        assert status["holding"] is True and abs(int(status["offset_ms"]) - HOUR_MS) < _AGREE_MS  # type: ignore
        why = " ".join(guard.not_ready_why())
        assert "ahead of broker" in why and str(status["broker"]) in why and "NTP" in why, why
        clock.offset_ms = 0  # the clock is fixed: the next measurement, while held, reopens
        assert wait_for(guard.may_send, 10), guard.status()
        assert guard.send_batch(_messages(2)) == [True, True]
        assert inner.sent == [2] and guard.not_ready_why() == []
        assert abs(int(guard.status()["offset_ms"])) < _AGREE_MS  # type: ignore[call-overload]
    finally:
        guard.close()


def test_the_guard_hands_its_check_down_with_the_fence_it_was_given(rocketmq: LocalRocketMQ) -> None:
    inner = RecordingSink()
    guard = ClockGuard(inner, BrokerClockProbe(_cfg(rocketmq), SystemClock().now_ms), 30_000)
    try:
        guard.probe_once()
        assert guard.may_send()
        records = RecordBytes(b"", np.zeros(0, np.int64), np.zeros(0, HEADER_DTYPE), np.zeros(0, bool))  # no rows
        guard.send_records(records, None, lambda: False)
        guard.send_records(records, None, lambda: True)
        guard.send_records(records)
        assert inner.fence_at_write == [False, True, True]
        assert guard.max_in_flight == 2
    finally:
        guard.close()


def test_a_probe_that_cannot_run_holds_nothing_and_says_so(rocketmq: LocalRocketMQ) -> None:
    missing = unique("TW_NO_SENTINEL")
    inner = RecordingSink()
    clock = SystemClock(HOUR_MS)  # an hour ahead, but nothing can tell
    guard = ClockGuard(inner, BrokerClockProbe(_cfg(rocketmq, dedupe_sentinel_topic=missing), clock.now_ms), 30_000)
    try:
        guard.start(wait_s=10.0)
        assert guard.counters["probe_failures"] >= 1
        assert guard.may_send() and guard.not_ready_why() == []
        assert guard.send_batch(_messages(1)) == [True]
        status = guard.status()
        assert status["offset_ms"] is None and status["holding"] is False
        assert any(missing in w and "not held" in w for w in status["warnings"]), status  # type: ignore[attr-defined]
    finally:
        guard.close()


def test_held_rows_are_marked_held_for_the_dispatcher(rocketmq: LocalRocketMQ) -> None:
    inner = RecordingSink()
    guard = ClockGuard(inner, BrokerClockProbe(_cfg(rocketmq), SystemClock(HOUR_MS).now_ms), 30_000)
    try:
        guard.probe_once()
        out = guard.send_batch(_messages(4))
        assert isinstance(out, SendResults) and out.errors is not None and out.held is not None
        assert np.array_equal(out.held, np.ones(4, bool)) and all("clock" in (e or "") for e in out.errors)
        assert guard.counters["held"] == 4
    finally:
        guard.close()
