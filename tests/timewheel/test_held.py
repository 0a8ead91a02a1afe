"""The shaper's held queues: what a late cancel takes out of them, and what stays in order."""
from __future__ import annotations

import numpy as np

from timewheel._held import Batch, HeldQueues
from timewheel.message import Message


def _batch(refs: list[int], topics: list[str]) -> Batch:
    n = len(refs)
    r = np.array(refs, np.uint64)
    messages = [Message(t, b"", r * 100, msg_id=str(r)) for r, t in zip(refs, topics)]
    return Batch(messages, np.array(refs, np.int64) * 100, r, np.zeros(n, np.int16), np.full(n, 7, np.int64),
                 np.ones(n, np.uint16), (r * 10).astype(np.uint32), None, topics)


def test_the_messages_a_cancel_names_are_taken_out_wherever_they_wait_and_the_rest_keep_their_order() -> None:
    held = HeldQueues()
    held.add(_batch([1, 2, 3], ["A", "B", "A"]), 5)
    held.add(_batch([4, 5], ["B", "A"]), 6)
    out = held.take_refs(np.array([3, 4, 9], np.uint64))
    assert out is not None and sorted(out.refs.tolist()) == [3, 4]
    assert sorted(out.offsets.tolist()) == [30, 40]  # located, to be recorded
    assert held.size == 3 and held.sizes() == {"A": 2, "B": 1}
    assert held.take_refs(np.array([3, 4], np.uint64)) is None  # gone already
    rest, since = held.take({"A": 5, "B": 5}, 10)
    assert rest is not None and rest.refs.tolist() == [1, 2, 5] and since.tolist() == [5, 5, 6]
    assert held.size == 0 and held.take_refs(np.array([1], np.uint64)) is None


def test_a_topic_whose_queue_is_emptied_leaves_no_queue_behind() -> None:
    held = HeldQueues()
    topics = [f"REPLY_{i:05d}" for i in range(10_000)]  # one-off topics, a request id in each name
    held.add(_batch(list(range(1, 10_001)), topics), 5)
    held.add(_batch([10_001, 10_002], ["ORDERS", "ORDERS"]), 6)
    out = held.take_refs(np.array([10_001], np.uint64))
    assert out is not None and out.refs.tolist() == [10_001]
    rest, _ = held.take(dict.fromkeys(topics, 1), 20_000)
    assert rest is not None and len(rest) == 10_000
    assert held.size == 1 and held.sizes() == {"ORDERS": 1}
    assert list(held.queues) == ["ORDERS"]
    assert held.take_refs(np.array([10_002], np.uint64)) is not None
    assert held.size == 0 and held.queues == {} and held.earliest_due() is None
