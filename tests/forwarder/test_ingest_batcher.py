"""IngestBatcher: the consume threads' messages gathered into one schedule() call."""
from __future__ import annotations

import threading
import time
from typing import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forwarder.ingest import IngestBatcher, _schedule_refusing
from timewheel import Message
from timewheel.errors import InvalidMessageError


class RecordingSchedule:
    """A schedule() that records its calls and refuses bodies marked bad or broken."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, messages: Sequence[Message]) -> list[str]:
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


def test_threads_in_flight_share_commits_and_each_is_stored_once() -> None:
    sched = RecordingSchedule()
    threads_n, per_thread = 16, 50
    busy = [0]
    lock = threading.Lock()
    batcher = IngestBatcher(sched, lambda: busy[0], max_batch=64, linger_s=0.05)
    start = threading.Barrier(threads_n)

    def worker(k: int) -> None:
        start.wait()
        for j in range(per_thread):
            with lock:
                busy[0] += 1
            try:
                time.sleep(0.001)  # the callback's own work (copying the message), off the GIL
                batcher.submit(msg(k * per_thread + j))
            finally:
                with lock:
                    busy[0] -= 1

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    stored = [i for call in sched.calls for i in call]
    assert sorted(stored) == sorted(f"m{i}" for i in range(threads_n * per_thread))
    assert len(sched.calls) < threads_n * per_thread / 2, "commits were not shared"
    assert batcher.messages == threads_n * per_thread and batcher.commits == len(sched.calls)


def test_a_lone_caller_does_not_wait_for_the_linger() -> None:
    sched = RecordingSchedule()
    batcher = IngestBatcher(sched, lambda: 1, linger_s=3600)  # would hang the test if it waited
    done = threading.Event()
    t = threading.Thread(target=lambda: (batcher.submit(msg(1)), done.set()), daemon=True)
    t.start()
    assert done.wait(30)
    assert sched.calls == [["m1"]]


def _submit_all(batcher: IngestBatcher, messages: list[Message]) -> dict[str, BaseException | None]:
    """Submit from one thread each, all in flight together; the outcome per message id."""
    out: dict[str, BaseException | None] = {}
    barrier = threading.Barrier(len(messages))

    def one(m: Message) -> None:
        barrier.wait()
        try:
            batcher.submit(m)
            out[m.msg_id or ""] = None
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[m.msg_id or ""] = e

    ts = [threading.Thread(target=one, args=(m,)) for m in messages]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


@pytest.mark.parametrize("bad_body", [b"bad", b"unknown"])
def test_a_refused_message_fails_alone(bad_body: bytes) -> None:
    sched = RecordingSchedule()
    messages = [msg(i) for i in range(8)] + [msg(99, bad_body)]
    batcher = IngestBatcher(sched, lambda: len(messages), linger_s=1.0)
    out = _submit_all(batcher, messages)
    assert isinstance(out["m99"], InvalidMessageError)
    assert all(out[f"m{i}"] is None for i in range(8))
    assert sorted(i for call in sched.calls for i in call) == sorted(f"m{i}" for i in range(8))


def test_a_storage_failure_fails_the_whole_commit() -> None:
    sched = RecordingSchedule()
    messages = [msg(i) for i in range(4)] + [msg(9, b"boom")]
    batcher = IngestBatcher(sched, lambda: len(messages), linger_s=5.0)
    out = _submit_all(batcher, messages)
    # whoever shared the failed commit learns of it (and is redelivered by RocketMQ); nothing is
    # reported stored that was not
    stored = {i for call in sched.calls for i in call}
    for mid, err in out.items():
        assert (err is None) == (mid in stored)
    assert isinstance(out["m9"], OSError)


@given(st.lists(st.sampled_from([b"ok", b"bad", b"unknown"]), max_size=12))
def test_refused_messages_are_left_out_and_every_other_one_is_stored_once(bodies: list[bytes]) -> None:
    sched = RecordingSchedule()
    refusals = _schedule_refusing(sched, [msg(i, body) for i, body in enumerate(bodies)])
    stored = [i for call in sched.calls for i in call]
    assert sorted(stored) == sorted(f"m{i}" for i, body in enumerate(bodies) if body == b"ok")
    assert len(stored) == len(set(stored))
    assert [r.reason if r else None for r in refusals] == [
        {b"ok": None, b"bad": "bad body", b"unknown": "refused, no index"}[body] for body in bodies]


def test_an_error_other_than_a_refusal_is_raised() -> None:
    with pytest.raises(OSError):
        _schedule_refusing(RecordingSchedule(), [msg(0), msg(1, b"boom")])
