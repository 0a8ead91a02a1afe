"""Ingest: a pulled batch stored with one schedule(), the messages the engine refuses left out."""
from __future__ import annotations

import threading
from typing import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forwarder.ingest import _schedule_refusing
from storage import Origin
from timewheel import Message
from timewheel.errors import InvalidMessageError


class RecordingSchedule:
    """A schedule() that records its calls and refuses bodies marked bad or broken."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, messages: Sequence[Message], origins: Sequence[Origin] | None = None) -> list[str]:
        for i, m in enumerate(messages):
            if m.body == b"bad":
                raise InvalidMessageError("bad body", index=i)
            if m.body == b"unknown":
                raise InvalidMessageError("refused, no index")
            if m.body == b"boom":
                raise OSError("disk on fire")
        with self.lock:
            self.calls.append([m.msg_id or "" for m in messages])
        return [m.msg_id or "" for m in messages]


def msg(i: int, body: bytes = b"ok") -> Message:
    return Message("T", body, 1000, msg_id=f"m{i}")


@given(st.lists(st.sampled_from([b"ok", b"bad", b"unknown"]), max_size=12))
def test_refused_messages_are_left_out_and_every_other_one_is_stored_once(bodies: list[bytes]) -> None:
    sched = RecordingSchedule()
    refusals = _schedule_refusing(sched, [msg(i, body) for i, body in enumerate(bodies)],
                                  [("b:0", i) for i in range(len(bodies))])
    stored = [i for call in sched.calls for i in call]
    assert sorted(stored) == sorted(f"m{i}" for i, body in enumerate(bodies) if body == b"ok")
    assert len(stored) == len(set(stored))
    assert [r.reason if r else None for r in refusals] == [
        {b"ok": None, b"bad": "bad body", b"unknown": "refused, no index"}[body] for body in bodies]


def test_an_error_other_than_a_refusal_is_raised() -> None:
    with pytest.raises(OSError):
        _schedule_refusing(RecordingSchedule(), [msg(0), msg(1, b"boom")], [None, None])
