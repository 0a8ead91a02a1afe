"""The pull consumer's linger: a queue whose answer emptied it waits before its next pull; one that
still holds messages (a backlog, however few each answer carries) is pulled again at once."""
from __future__ import annotations

import time
from typing import Any

import pytest

from forwarder.rocketmq._puller import Puller, PullSettings
from forwarder.rocketmq._queue_state import QueueTable

Q = ("broker-a", 0)


def _puller(linger_ms: int) -> tuple[Puller, QueueTable]:
    table = QueueTable()
    table.add(Q, 0)
    settings = PullSettings("g", "T", 32, 1000, 1.0, 3.0, 4 << 20, 3, 64 << 20, None, linger_ms)
    puller = Puller(settings, table, None, lambda batch: True, lambda request: None, {"batches": 0, "refused": 0})  # type: ignore[arg-type]
    return puller, table


def _answer(puller: Puller, table: QueueTable, messages: int, caught_up: bool) -> float:
    """Hand over an answer of `messages` messages; returns how long the queue now waits."""
    st = table.get(Q)
    assert st is not None
    answer: Any = [object()] * messages
    puller._read_pull = lambda q, resp, budget: (st, st.offset + messages, answer, caught_up)  # type: ignore[method-assign]
    puller._handle_pulls([(Q, object())])  # type: ignore[list-item]
    assert st.offset > 0 and st.in_flight is None
    return st.retry_at - time.monotonic()


@pytest.mark.parametrize("messages", [1, 32])
def test_a_queue_emptied_by_its_answer_waits_the_linger(messages: int) -> None:
    puller, table = _puller(500)
    assert 0.3 < _answer(puller, table, messages, caught_up=True) <= 0.5


@pytest.mark.parametrize("messages", [1, 2, 32])
def test_a_queue_with_more_to_read_is_pulled_again_at_once(messages: int) -> None:
    """Two messages of 2 MB fill an answer (the broker's byte limit): a backlog, not a trickle."""
    puller, table = _puller(500)
    assert _answer(puller, table, messages, caught_up=False) <= 0


def test_without_a_linger_nothing_waits() -> None:
    puller, table = _puller(0)
    assert _answer(puller, table, 1, caught_up=True) <= 0
