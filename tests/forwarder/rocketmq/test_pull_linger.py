"""The pull consumer's linger: a queue whose answer emptied it, or left less than one more answer
after an answer cut by the count, waits for the next tick of the linger before its next pull (the
queues of a broker pulled together); one that still holds a backlog (a full answer or more, or an
answer cut by the broker's byte limit, however few each carries) is pulled again at once."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from forwarder.rocketmq._puller import BodyReader, Puller, PullSettings, _emptied, _Messages, next_tick
from forwarder.rocketmq._queue_state import QueueTable
from forwarder.rocketmq.compression import InflateBudget
from forwarder.rocketmq.protocol import SUCCESS, Response

Q = ("broker-a", 0)
Q2 = ("broker-a", 1)


def _puller(linger_ms: int) -> tuple[Puller, QueueTable]:
    table = QueueTable()
    table.add(Q, 0)
    table.add(Q2, 0)
    settings = PullSettings("g", "T", 32, 1000, 1.0, 3.0, 4 << 20, 3, 64 << 20, None, linger_ms)
    puller = Puller(settings, table, None, lambda batch: True, lambda request: None, {"batches": 0, "refused": 0})  # type: ignore[arg-type]
    return puller, table


def _answer(puller: Puller, table: QueueTable, messages: int, caught_up: bool, q: tuple[str, int] = Q,
            steady: bool | None = None) -> float:
    """Hand over an answer of `messages` messages from queue `q` (`steady`: less than one more answer
    left; as `caught_up` unless given); returns how long it now waits."""
    st = table.get(q)
    assert st is not None
    answer: Any = [object()] * messages
    lingers = caught_up if steady is None else steady
    puller._read_pull = lambda q, resp, budget: (st, st.offset + messages, answer, caught_up, lingers)  # type: ignore[method-assign]
    puller._handle_pulls([(q, object())])  # type: ignore[list-item]
    assert st.offset > 0 and st.in_flight is None
    return st.retry_at - time.monotonic()


@pytest.mark.parametrize("messages", [1, 32])
def test_a_queue_emptied_by_its_answer_waits_for_the_next_tick(messages: int) -> None:
    puller, table = _puller(500)
    assert 0 < _answer(puller, table, messages, caught_up=True) <= 0.5
    st = table.get(Q)
    assert st is not None and st.retry_at == next_tick(st.retry_at - 0.25, 0.5)  # on the grid


def test_queues_emptied_at_different_moments_of_a_tick_are_pulled_together() -> None:
    puller, table = _puller(1000)  # a long tick: a busy machine's pause still leaves both answers in it
    time.sleep(next_tick(time.monotonic(), 1.0) - time.monotonic() + 0.01)  # early in a tick
    _answer(puller, table, 3, caught_up=True, q=Q)
    time.sleep(0.05)
    _answer(puller, table, 2, caught_up=True, q=Q2)
    a, b = table.get(Q), table.get(Q2)
    assert a is not None and b is not None and a.retry_at == b.retry_at


def test_the_tick_is_the_next_multiple_of_the_period() -> None:
    assert next_tick(10.0, 0.02) == pytest.approx(10.02)
    assert next_tick(10.005, 0.02) == pytest.approx(10.02)
    assert next_tick(10.0199, 0.02) == pytest.approx(10.02)
    assert next_tick(10.02, 0.02) == pytest.approx(10.04)


@pytest.mark.parametrize("messages", [1, 2, 32])
def test_a_queue_with_more_to_read_is_pulled_again_at_once(messages: int) -> None:
    """Two messages of 2 MB fill an answer (the broker's byte limit): a backlog, not a trickle."""
    puller, table = _puller(500)
    assert _answer(puller, table, messages, caught_up=False) <= 0


def test_without_a_linger_nothing_waits() -> None:
    puller, table = _puller(0)
    assert _answer(puller, table, 1, caught_up=True) <= 0


def test_a_queue_left_with_less_than_one_answer_waits_for_the_next_tick() -> None:
    """A tick's share just over one answer: the few left over go with the next tick, not a commit of their own."""
    puller, table = _puller(500)
    assert 0 < _answer(puller, table, 32, caught_up=False, steady=True) <= 0.5
    st = table.get(Q)
    assert st is not None and st.caught_up_ms == 0  # not caught up: the watermark does not move past it


def _found(asked: int, end: int, max_offset: int) -> Response:
    return Response(SUCCESS, 1, "", {"nextBeginOffset": str(end), "maxOffset": str(max_offset)}, b"")


@pytest.mark.parametrize(("asked", "end", "max_offset", "steady"), [
    (0, 5, 5, True),        # emptied
    (0, 32, 32, True),      # emptied by a full answer
    (0, 32, 63, True),      # cut by the count, 31 left: less than one answer
    (0, 32, 64, False),     # cut by the count, 32 left: a full answer more
    (0, 32, 1000, False),   # a backlog
    (0, 2, 5, False),       # cut by the byte limit (large bodies): a backlog however few are left
    (100, 131, 140, False),  # 31 messages: not cut by the count
    (100, 132, 140, True),
])
def test_what_counts_as_less_than_one_more_answer(asked: int, end: int, max_offset: int, steady: bool) -> None:
    assert _emptied(_found(asked, end, max_offset), asked, 32) is steady


def test_an_odd_answer_is_no_steady_stream() -> None:
    resp = Response(SUCCESS, 1, "", {"nextBeginOffset": "x", "maxOffset": "5"}, b"")
    assert not _emptied(resp, 0, 32)


@pytest.mark.parametrize(("got", "max_offset", "caught_up", "steady"), [
    (32, 32, True, True),    # emptied
    (32, 63, False, True),   # 31 left after a full answer: waits, but not caught up
    (32, 64, False, False),  # a full answer more: pulled again at once
    (2, 5, False, False),    # cut by the byte limit
])
def test_a_found_answer_says_whether_its_queue_is_caught_up_and_whether_it_may_wait(
        got: int, max_offset: int, caught_up: bool, steady: bool) -> None:
    """The broker's answer as `_read_pull` reads it: the offsets of a real answer decide both."""
    table = QueueTable()
    table.add(Q, 0)
    settings = PullSettings("g", "T", 32, 1000, 1.0, 3.0, 4 << 20, 3, 64 << 20, None, 500)
    readable = [SimpleNamespace(undecodable="", queue_offset=i) for i in range(got)]
    reader = BodyReader(lambda body, limit, broker, budget: _Messages(readable),  # type: ignore[arg-type]
                        lambda messages, broker: _Messages(messages))
    puller = Puller(settings, table, None, lambda batch: True, lambda request: None,  # type: ignore[arg-type]
                    {"pulled": 0, "undecodable": 0}, reader)
    st = table.get(Q)
    assert st is not None
    st.in_flight = 7
    resp = Response(SUCCESS, 7, "", {"nextBeginOffset": str(got), "maxOffset": str(max_offset)}, b"")
    read = puller._read_pull(Q, resp, InflateBudget(64 << 20))
    assert read is not None
    assert read[1] == got and read[3] is caught_up and read[4] is steady
