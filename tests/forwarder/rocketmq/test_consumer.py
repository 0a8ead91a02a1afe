"""The pull consumer: queue allocation, and a real consumer group."""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import RemotingPullConsumer, allocate_averagely
from forwarder.rocketmq import Receipt, RemotingProducer

@given(st.integers(0, 64), st.integers(1, 10))
def test_allocation_splits_queues_evenly_and_disjointly(n_queues: int, n_members: int) -> None:
    queues = [("b", q) for q in range(n_queues)]
    members = [f"c{i}" for i in range(n_members)]
    shares = [allocate_averagely(queues, members, m) for m in members]
    flat = [q for s in shares for q in s]
    assert sorted(flat) == sorted(queues) and len(flat) == len(set(flat))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_allocation_matches_rocketmqs_averagely_split() -> None:
    queues = [("broker-a", q) for q in range(8)]
    members = ["c1", "c2", "c3"]
    assert [allocate_averagely(queues, members, m) for m in members] == [
        [("broker-a", 0), ("broker-a", 1), ("broker-a", 2)],
        [("broker-a", 3), ("broker-a", 4), ("broker-a", 5)],
        [("broker-a", 6), ("broker-a", 7)]]
    assert allocate_averagely(queues, members, "stranger") == []


class Collector:
    """A batch callback that records ids; refuses the first batch it sees once, if asked to."""

    def __init__(self, refuse_first: bool = False) -> None:
        self.lock = threading.Lock()
        self.ids: list[str] = []
        self.refused: list[str] = []
        self._refuse = refuse_first

    def __call__(self, batch: list[ReceivedMessage]) -> bool:
        with self.lock:
            if self._refuse:
                self._refuse = False
                self.refused = [m.body.decode() for m in batch]
                return False
            self.ids += [m.body.decode() for m in batch]
        return True

    def wait(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(set(self.ids)) < n:
            time.sleep(0.05)


def _stacks(prefix: str) -> dict[str, str]:
    """Where each thread whose name starts with `prefix` is now (for a failure's message)."""
    frames = sys._current_frames()
    return {t.name: "".join(traceback.format_stack(frames[t.ident], limit=6))
            for t in threading.enumerate() if t.name.startswith(prefix) and t.ident in frames}


def _send(mq: LocalRocketMQ, topic: str, bodies: list[str], queues: int = 4) -> None:
    # batches of 10, which the producer spreads over the topic's queues: every queue gets some
    with RemotingProducer(mq.namesrv_addr, "test-pull-producer", max_batch_messages=10) as p:
        res = p.send([OutgoingMessage(topic, b.encode()) for b in bodies])
    assert all(isinstance(r, Receipt) for r in res), res
    assert len({r.queue_id for r in res if isinstance(r, Receipt)}) == min(queues, (len(bodies) + 9) // 10)


@pytest.mark.rocketmq
@pytest.mark.slow
def test_a_group_shares_the_queues_commits_offsets_and_re_pulls_a_refused_batch(rocketmq: LocalRocketMQ) -> None:
    records: list[str] = []

    class Recording(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    handler = Recording()
    logging.getLogger("timewheel.pull").addHandler(handler)
    try:
        _group_scenario(rocketmq, records)
    finally:
        logging.getLogger("timewheel.pull").removeHandler(handler)


def _group_scenario(rocketmq: LocalRocketMQ, records: list[str]) -> None:
    topic, group = f"PULL_{uuid.uuid4().hex[:8]}", f"pull-group-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=4)
    first = [f"a{i}" for i in range(400)]
    _send(rocketmq, topic, first)  # sent before any member started: a new group starts at the beginning
    a, b = Collector(refuse_first=True), Collector()
    ca = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, a, rebalance_interval_s=0.5, retry_backoff_s=0.2)
    cb = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, b, rebalance_interval_s=0.5, retry_backoff_s=0.2)
    ca.start()
    cb.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (len(ca.owned()) == 2 and len(cb.owned()) == 2):
            time.sleep(0.1)
        assert sorted(ca.owned() + cb.owned()) == [("broker-a", q) for q in range(4)], "each queue has one owner"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(set(a.ids) | set(b.ids)) < len(first):
            time.sleep(0.05)
        assert set(a.ids) | set(b.ids) == set(first)
        assert a.refused and set(a.refused) <= set(a.ids) | set(b.ids), "a refused batch is pulled again"
        cb.stop()  # b leaves: a takes every queue over
        second = [f"b{i}" for i in range(200)]
        _send(rocketmq, topic, second)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (set(second) <= set(a.ids) and len(ca.owned()) == 4):
            time.sleep(0.05)
        assert set(second) <= set(a.ids) and len(ca.owned()) == 4, (
            f"owned {ca.owned()}, members {ca.members()} (a is {ca.client_id}), counters {ca.counters}, "
            f"log {records[-20:]}, threads {_stacks('ingest-')}")
    finally:
        ca.stop()
        cb.stop()
    # offsets were committed: a newcomer to the group gets only what is new
    third = [f"c{i}" for i in range(50)]
    _send(rocketmq, topic, third)
    c = Collector()
    cc = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, c, rebalance_interval_s=0.5)
    cc.start()
    try:
        c.wait(len(third), 30)
        time.sleep(1.0)
    finally:
        cc.stop()
    assert set(c.ids) == set(third), "nothing accepted before is pulled again after a clean stop"


@pytest.mark.rocketmq
def test_a_queue_filter_keeps_a_member_to_its_shard_and_it_knows_when_it_read_all(rocketmq: LocalRocketMQ) -> None:
    topic, group = f"PULL_{uuid.uuid4().hex[:8]}", f"shard-group-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=4)
    _send(rocketmq, topic, [f"s{i}" for i in range(400)])
    sent_ms = time.time_ns() // 1_000_000
    lock = threading.Lock()
    seen: list[int] = []

    def collect(batch: list[ReceivedMessage]) -> bool:
        with lock:
            seen.extend(m.queue_id for m in batch)
        return True

    odd = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, collect, rebalance_interval_s=0.5,
                               queue_filter=lambda q: q[1] % 2 == 1)
    odd.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(seen) < 200:
            time.sleep(0.05)
        time.sleep(1.0)  # anything from another queue would have come by now
        assert odd.owned() == [("broker-a", 1), ("broker-a", 3)]
        # both queues were read to their end by a pull sent after the last message was stored
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (odd.caught_up_ms() or 0) < sent_ms:
            time.sleep(0.05)
        assert sent_ms <= (odd.caught_up_ms() or 0) <= time.time_ns() // 1_000_000
    finally:
        odd.stop()
    assert len(seen) == 200 and set(seen) == {1, 3}


class Sizes(Collector):
    """A Collector that also records the size of each batch handed over."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __call__(self, batch: list[ReceivedMessage]) -> bool:
        self.sizes.append(len(batch))
        return super().__call__(batch)


@pytest.mark.rocketmq
def test_a_steady_trickle_on_many_queues_goes_in_one_batch_a_tick(rocketmq: LocalRocketMQ) -> None:
    """With a linger, the queues a trickle emptied are pulled again on the same tick and their
    answers read together: a callback (a store commit) per tick, not one per queue's answer."""
    topic, group = f"PULL_{uuid.uuid4().hex[:8]}", f"pull-group-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=8)
    got = Sizes()
    c = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, got, rebalance_interval_s=0.5, pull_linger_ms=100)
    c.start()
    bodies = [f"t{i}" for i in range(400)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(c.owned()) < 8:
            time.sleep(0.05)
        assert len(c.owned()) == 8
        with RemotingProducer(rocketmq.namesrv_addr, "test-trickle-producer") as p:
            t0 = time.monotonic()
            for i in range(0, len(bodies), 8):  # 8 a step, one to each queue (round robin), 20 steps a second
                for b in bodies[i:i + 8]:
                    res = p.send([OutgoingMessage(topic, b.encode())])
                    assert all(isinstance(r, Receipt) for r in res), res
                time.sleep(max(0.0, t0 + (i // 8 + 1) * 0.05 - time.monotonic()))
            spent = time.monotonic() - t0
        got.wait(len(bodies))
    finally:
        c.stop()
    assert sorted(got.ids) == sorted(bodies), "every message once"
    answers = c.counters["batches"]
    # ~25 ticks of 100 ms over the 2.5 s, each answered by up to 8 queues; without the common tick,
    # each queue's answer went on its own (one callback per answer)
    assert answers > 2 * len(got.sizes), (answers, got.sizes)
    assert len(got.sizes) <= 2 * spent / 0.1 + 10, (spent, got.sizes)


@pytest.mark.rocketmq
def test_answers_already_read_are_handed_over_in_one_batch(rocketmq: LocalRocketMQ) -> None:
    """Group commit sized by load: with a backlog on every queue, the answers of several queues'
    pulls go to the callback (and so to one store commit) together; each message once."""
    topic, group = f"PULL_{uuid.uuid4().hex[:8]}", f"pull-group-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=8)
    bodies = [f"g{i}" for i in range(1600)]
    _send(rocketmq, topic, bodies, queues=8)
    got = Sizes()
    c = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, got, pull_batch=16, rebalance_interval_s=0.5)
    c.start()
    try:
        got.wait(len(bodies))
    finally:
        c.stop()
    assert sorted(got.ids) == sorted(bodies), "every message once"
    assert max(got.sizes) > 16, f"no two answers went together: {got.sizes}"
    assert len(got.sizes) < c.counters["batches"], "fewer callbacks than pull answers"


@pytest.mark.rocketmq
def test_a_commit_inflates_a_bounded_number_of_bytes(rocketmq: LocalRocketMQ) -> None:
    """Eight bodies of 1 MiB, compressed by the producer to a few KB each: pulled in one answer, they
    are handed over a couple at a time, never all in one commit, and none is lost."""
    from forwarder._rmq_native import NativeProducer

    topic, group = f"INFLATE_{uuid.uuid4().hex[:8]}", f"inflate-group-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=1)
    with NativeProducer(f"inflate-producer-{uuid.uuid4().hex[:8]}", rocketmq.namesrv_addr) as p:
        for i in range(8):
            p.send(OutgoingMessage(topic, bytes([65 + i]) * (1 << 20)))
    batches: list[list[int]] = []

    def collect(batch: list[ReceivedMessage]) -> bool:
        batches.append([m.queue_offset for m in batch])
        assert all(m.undecodable is None and len(m.body) == 1 << 20 for m in batch)
        return True
    c = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, collect, rebalance_interval_s=0.5,
                             max_commit_inflated_bytes=2 << 20)
    c.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(map(len, batches)) < 8:
            time.sleep(0.05)
    finally:
        c.stop()
    assert sorted(o for b in batches for o in b) == list(range(8)), batches
    assert max(map(len, batches)) <= 3, batches
