"""Outcomes of failed sends: what each message's dispatch-log row says when the dead-letter path fails too."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from storage import DEAD_LETTERED, RETRIED, ScheduleStore
from tests.timewheel.conftest import T0
from timewheel import EngineConfig, ManualClock, Message
from timewheel._held import Batch
from timewheel._outcomes import DispatchCounters, Outcomes
from timewheel.dispatch_queue import DispatchQueue
from timewheel.message import DeadLetterSink


class _DownDeadLetters:
    """A dead-letter path that is down."""

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        raise ConnectionError("dead-letter topic unreachable")


def test_a_failed_dead_letter_is_noted_only_on_the_messages_that_were_due_one(tmp_path: Path) -> None:
    # the others failed an ordinary attempt: their rows must not say a dead letter was tried
    store = ScheduleStore(tmp_path)
    clock = ManualClock(T0)
    try:
        outcomes = Outcomes(EngineConfig(tmp_path, max_attempts=3), store, DispatchQueue(clock, batch_size=10,
                            catch_up_chunk=10), DispatchCounters(), threading.Lock(), _DownDeadLetters(), seed=1)
        seg = store.layout.segment_start(T0)
        batch = Batch([Message("T", b"last", T0), Message("T", b"first", T0)], np.array([T0, T0], np.int64),
                      np.array([1, 2], np.uint64), np.array([2, 0], np.int16), np.array([seg, seg], np.int64),
                      np.array([0, 0], np.int64), np.array([0, 100], np.int64))
        outcomes.fail(batch, T0, ["BrokerBusyError: busy", "BrokerBusyError: busy"])
        log = store.dispatch_log(seg)
        rows = {int(e["offset"]): (int(e["outcome"]), log.notes[int(log.note[i])])
                for i, e in enumerate(log.entries)}
    finally:
        store.close()
    assert rows[0][0] == RETRIED and "dead letter failed too" in rows[0][1], rows  # it stays, retrying
    assert rows[100] == (RETRIED, "BrokerBusyError: busy"), rows
    assert DEAD_LETTERED not in {o for o, _ in rows.values()}


def _fail_last_attempt(tmp_path: Path, dead_letters: DeadLetterSink, times: int = 1) -> None:
    """One message on its last attempt, failed (`times` times over): its dead letter goes to `dead_letters`."""
    store = ScheduleStore(tmp_path)
    clock = ManualClock(T0)
    try:
        queue = DispatchQueue(clock, batch_size=10, catch_up_chunk=10)
        outcomes = Outcomes(EngineConfig(tmp_path, max_attempts=1), store, queue, DispatchCounters(), threading.Lock(),
                            dead_letters, seed=1)
        seg = store.layout.segment_start(T0)
        batch = Batch([Message("T", b"x", T0)], np.array([T0], np.int64), np.array([1], np.uint64),
                      np.array([0], np.int16), np.array([seg], np.int64), np.array([0], np.int64),
                      np.array([0], np.int64))
        for _ in range(times):
            outcomes.fail(batch, T0, ["BrokerBusyError: busy"])
    finally:
        store.close()


def test_a_dead_letter_a_fenced_replica_refuses_is_one_warning_line_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Refused while the lease fence is closed, the message is kept for another attempt as intended:
    not an error to investigate, and a traceback at every retry would bury the real ones."""
    from coordination import FencedDeadLetters

    class _Parked:
        def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
            raise AssertionError("nothing is parked while fenced")

    with caplog.at_level(logging.DEBUG, logger="timewheel.dispatcher"):
        _fail_last_attempt(tmp_path, FencedDeadLetters(_Parked(), lambda: False))
    [line] = [r for r in caplog.records if r.name == "timewheel.dispatcher"]
    assert (line.levelno, line.exc_info) == (logging.WARNING, None), (line.levelname, line.exc_info)
    assert "may not send now" in line.getMessage() and "\n" not in line.getMessage()


def test_a_dead_letter_path_that_fails_otherwise_is_logged_with_its_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="timewheel.dispatcher"):
        _fail_last_attempt(tmp_path, _DownDeadLetters())
    [line] = [r for r in caplog.records if r.name == "timewheel.dispatcher"]
    assert line.levelno == logging.ERROR and line.exc_info is not None


def test_a_dead_letter_path_that_stays_down_is_logged_once_not_at_every_retry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="timewheel.dispatcher"):
        _fail_last_attempt(tmp_path, _DownDeadLetters(), times=20)
    [line] = [r for r in caplog.records if r.name == "timewheel.dispatcher"]
    assert line.levelno == logging.ERROR and line.exc_info is not None
