"""The fault harness's hook: a signal right after the chosen send batch, before its outcome is recorded."""
from __future__ import annotations

import signal

import pytest

from forwarder.config import RocketMQConfig
from forwarder.faults import SignalAfterSends
from timewheel.errors import ConfigError


class _Sink:
    max_in_flight = 3
    linger_ms = 2

    def __init__(self) -> None:
        self.answers: list[list[bool]] = []

    def send_batch(self, messages: object) -> list[bool]:
        return self.answers.pop(0)


def test_the_signal_goes_after_the_chosen_batch_that_stored_something_and_only_once() -> None:
    sink = _Sink()
    sink.answers = [[True], [False, False], [True, False], [True], [True]]
    fired: list[tuple[int, int]] = []
    wrapped = SignalAfterSends(sink, 2, signal.SIGSTOP, kill=lambda pid, sig: fired.append((pid, sig)))
    assert wrapped.max_in_flight == 3 and wrapped.linger_ms == 2
    wrapped.send_batch([])
    wrapped.send_batch([])  # nothing stored: not counted
    assert fired == []
    assert wrapped.send_batch([]) == [True, False]  # the answer still goes back (to a process that froze)
    assert [s for _, s in fired] == [int(signal.SIGSTOP)]
    wrapped.send_batch([])
    wrapped.send_batch([])
    assert len(fired) == 1


def test_fault_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="fault_after_sends"):
        RocketMQConfig(fault_after_sends=-1)
    with pytest.raises(ConfigError, match="dedupe_sentinel_topic"):
        RocketMQConfig(dedupe_sentinel_topic="TW_DELAY")
    with pytest.raises(ValueError):
        SignalAfterSends(_Sink(), 0, signal.SIGKILL)
