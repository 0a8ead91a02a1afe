"""`RepeatedFailureLog` on a scripted clock: a run's first failure with its traceback, then only another
error or the same one a while later, with the run's count; `end()` closes the run."""
from __future__ import annotations

import logging

import pytest

from timewheel.failure_log import RepeatedFailureLog, one_line

log = logging.getLogger("tests.failure_log")


class _Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.name == log.name]
    caplog.clear()
    return out


def test_the_same_error_is_logged_again_only_after_repeat_s_and_another_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    failures = RepeatedFailureLog(log, clock, repeat_s=30.0)
    caplog.set_level(logging.WARNING, logger=log.name)
    assert failures.failed(OSError("disk full"), "writing %s failed", "x") is True
    assert [r.exc_info is not None for r in caplog.records] == [True]
    assert _lines(caplog) == ["writing x failed"]
    for _ in range(29):
        clock.t += 1.0
        assert failures.failed(OSError("disk full"), "writing %s failed", "x") is False
    assert _lines(caplog) == [] and failures.logged_within()
    clock.t += 0.5
    assert failures.failed(OSError("disk  full\n"), "writing %s failed", "x") is False, "the same on one line"
    clock.t += 0.5
    assert failures.failed(OSError("disk full"), "writing %s failed", "x") is True
    assert _lines(caplog) == ["writing x failed (32 in a row over 30 s)"]
    assert failures.failed(ValueError("bad"), "writing %s failed", "y", note=" (mine)") is True
    assert _lines(caplog) == ["writing y failed (mine)"]
    clock.t += 30.0
    assert not failures.logged_within()
    assert failures.end() == (33, 60.0)
    assert failures.end() is None
    assert failures.failed(ValueError("bad"), "writing %s failed", "y") is True, "a new run: its first at once"
    assert _lines(caplog) == ["writing y failed"]


def test_one_line_names_the_type_and_folds_the_message() -> None:
    assert one_line(OSError("a\n  b")) == "OSError: a b"
    assert one_line(KeyError()) == "KeyError"


def test_errors_that_differ_only_in_their_numbers_say_the_same(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    failures = RepeatedFailureLog(log, clock)
    caplog.set_level(logging.WARNING, logger=log.name)
    assert failures.failed(TimeoutError("no answer in 3000 ms from 127.0.0.1:10911"), "a send failed")
    clock.t += 1.0
    assert not failures.failed(TimeoutError("no answer in 3001 ms from 127.0.0.1:10911"), "a send failed")
    assert failures.failed(TimeoutError("no answer in 3001 ms from broker-b"), "a send failed"), "another broker"
    assert failures.failed(OSError("no answer in 3001 ms from broker-b"), "a send failed"), "another type"
    assert len(_lines(caplog)) == 3
