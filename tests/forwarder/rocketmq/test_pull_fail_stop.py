"""A pull thread is fail-stop: an answer whose offsets are not numbers is pulled again (nothing of it
taken), and an error nothing expected ends the thread for good, reported by `dead_threads` (the
service is then not ready and exits for its supervisor) instead of the thread being started again
by every rebalance, dying each time, while the service looked healthy."""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, Receipt, RemotingProducer, RemotingPullConsumer
from forwarder.rocketmq._puller import BodyReader, Puller, PullSettings, _Messages
from forwarder.rocketmq._queue_state import QueueTable
from forwarder.rocketmq.compression import InflateBudget
from forwarder.rocketmq.errors import BatchesRefusedError, ProtocolError
from forwarder.rocketmq.protocol import PULL_NOT_FOUND, PULL_OFFSET_MOVED, SUCCESS, Response
from tests.polling import wait_for

Q = ("broker-a", 0)


def _puller(accept: bool = True, max_refused_s: float = 120.0) -> tuple[Puller, QueueTable, list[Any]]:
    table = QueueTable()
    table.add(Q, 7)
    handed: list[Any] = []

    def take(batch: list[Any]) -> bool:
        handed.append(batch)
        return accept

    settings = PullSettings("g", "T", 32, 1000, 1.0, 3.0, 4 << 20, 3, 64 << 20, None, 0, max_refused_s)
    counters = {"batches": 0, "refused": 0, "pulled": 0, "undecodable": 0, "bad_answers": 0, "pull_gaps": 0}
    puller = Puller(settings, table, None, take, lambda request: None, counters)  # type: ignore[arg-type]
    return puller, table, handed


_ODD = [(code, "nextBeginOffset", value) for code in (SUCCESS, PULL_NOT_FOUND, PULL_OFFSET_MOVED)
        for value in ("x", "", "1.5", "9" * 5000 + "z")] + [(SUCCESS, "maxOffset", "12a")]  # only a found answer's maxOffset is read


@pytest.mark.parametrize(("code", "field", "value"), _ODD)
def test_an_answer_whose_offsets_are_not_numbers_is_pulled_again(code: int, field: str, value: str) -> None:
    puller, table, handed = _puller()
    st = table.get(Q)
    assert st is not None
    st.in_flight = 5
    ext = {"nextBeginOffset": "9", "maxOffset": "9", field: value}
    before = time.monotonic()
    puller._handle_pulls([(Q, Response(code, 5, "", ext, b""))])
    assert handed == [] and st.offset == 7, "nothing of the answer is taken"
    assert st.in_flight is None and st.retry_at >= before + 0.9, "the same pull goes again after the backoff"
    assert puller.counters["bad_answers"] == 1


def test_answers_whose_offsets_are_not_numbers_end_the_pull_thread_after_the_tries_allowed() -> None:
    """No offset to move on to: after `max_decode_tries` such answers in a row the error ends the
    thread (fail-stop: the service is not ready) rather than pulling the same answer for ever."""
    puller, table, handed = _puller()
    st = table.get(Q)
    assert st is not None
    for n in range(1, 3):
        st.in_flight = n
        puller._handle_pulls([(Q, Response(SUCCESS, n, "", {"nextBeginOffset": "x"}, b""))])
        assert st.decode_failures == n and handed == []
    st.in_flight = 3
    with pytest.raises(ProtocolError, match="3 answers in a row"):
        puller._handle_pulls([(Q, Response(SUCCESS, 3, "", {"nextBeginOffset": "x"}, b""))])
    assert st.offset == 7 and handed == []


def test_an_unexpected_error_ends_the_pull_thread_for_good() -> None:
    puller, table, _ = _puller()

    class Broken:
        def address(self, broker: str) -> str:
            raise RuntimeError("a bug nobody imagined")

    puller.membership = Broken()  # type: ignore[assignment]
    puller.running.set()
    puller.pull_from("broker-a")
    assert wait_for(lambda: puller.dead_threads() == ["ingest-pull-broker-a"], timeout=5)
    assert puller.failures == {"broker-a": "RuntimeError: a bug nobody imagined"}
    dead = puller._threads["broker-a"]
    dead.join(5)
    puller.pull_from("broker-a")  # what a rebalance does: not started again
    assert puller._threads["broker-a"] is dead
    assert not [t for t in threading.enumerate() if t.name == "ingest-pull-broker-a" and t.is_alive()]


@pytest.mark.rocketmq
def test_a_consumer_whose_pull_thread_died_reports_it_and_loses_nothing(rocketmq: LocalRocketMQ) -> None:
    topic, group = f"PULLDIE_{uuid.uuid4().hex[:8]}", f"pull-die-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=2)
    with RemotingProducer(rocketmq.namesrv_addr, "test-pull-die-producer") as p:
        res = p.send([OutgoingMessage(topic, f"m{i}".encode()) for i in range(20)])
    assert all(isinstance(r, Receipt) for r in res), res

    def broken(body: bytes, limit: int, broker: str, budget: InflateBudget) -> Any:
        raise RuntimeError("a reader that fails in a way nobody imagined")

    got: list[str] = []

    def never(answers: list[Any]) -> bool:
        got.append("a batch reached the callback")
        return True

    reader = BodyReader(broken, lambda messages, broker: _Messages(messages))
    dying = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, never,
                                 reader=reader, rebalance_interval_s=0.3, retry_backoff_s=0.2)
    dying.start()
    try:
        assert wait_for(lambda: dying.dead_threads() == ["ingest-pull-broker-a"], timeout=30), dying.dead_threads()
        time.sleep(1.0)  # three rebalances: the thread is not started again to die again
        assert dying.dead_threads() == ["ingest-pull-broker-a"] and got == []
        assert not [t for t in threading.enumerate() if t.name == "ingest-pull-broker-a" and t.is_alive()]
    finally:
        dying.stop()
    # nothing was committed by the thread that died: the next start of the group reads everything
    lock = threading.Lock()

    def collect(batch: list[Any]) -> bool:
        with lock:
            got.extend(m.body.decode() for m in batch)
        return True

    again = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, collect, rebalance_interval_s=0.3)
    again.start()
    try:
        assert wait_for(lambda: len(set(got)) >= 20, timeout=30), got
        assert again.dead_threads() == []
    finally:
        again.stop()
    assert set(got) == {f"m{i}" for i in range(20)}


def test_a_queue_given_up_after_its_broker_left_the_route_is_dropped_without_a_commit(
        caplog: pytest.LogCaptureFixture) -> None:
    """A broker killed or taken out leaves the route; its queues are released, and the pull thread
    commits each before dropping it. That commit looked the broker up with `[]`: KeyError, which
    ended the thread (since it is fail-stop, the whole engine, in every round of broker faults)."""
    from forwarder.rocketmq._membership import Membership

    table = QueueTable()
    table.add(Q, 7)
    st = table.get(Q)
    assert st is not None
    st.offset = 12  # accepted past what the broker was last told
    membership = Membership(None, "g", "T", "me", table, answer=lambda r: None,  # type: ignore[arg-type]
                            pull_from=lambda b: None, counters={}, rebalance_interval_s=1.0, timeout=1.0,
                            security=None, queue_filter=None)
    with caplog.at_level("WARNING", logger="timewheel.pull"):
        membership.commit(Q, st)  # broker-a is in no route this member read
    assert st.committed < 12 and "broker broker-a is no longer in the route" in caplog.text

    table.release([Q])
    puller, _, _ = _puller()
    puller.table, puller.membership = table, membership
    puller.running.set()
    puller._pull("broker-a")  # the released queue is dropped, and with nothing left the thread ends
    assert table.get(Q) is None and puller.failures == {}


def _found(puller: Puller, table: QueueTable, opaque: int) -> None:
    """Hand the puller one answer of one message at the queue's offset (as `_read_pull` reads it)."""
    st = table.get(Q)
    assert st is not None
    answer: Any = [object()]
    puller._read_pull = lambda q, resp, budget: (st, st.offset + 1, answer, True, True)  # type: ignore[method-assign]
    puller._handle_pulls([(Q, Response(SUCCESS, opaque, "", {}, b""))])


def test_batches_refused_for_longer_than_allowed_end_the_pull_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A callback that refuses every batch (a disk that fails, a dead letter refused) had its batches
    pulled again for ever while the service looked ready; now, after `max_refused_s` of refusals in
    a row, the pull thread stops (fail-stop), with nothing refused committed."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    puller, table, handed = _puller(accept=False, max_refused_s=60.0)
    puller.running.set()
    for n in range(1, 4):
        _found(puller, table, n)  # refused at 1000, 1030, 1059.9 s: still within the limit
        clock[0] += 30.0 if n == 1 else 29.9
    st = table.get(Q)
    assert st is not None and st.offset == 7 and puller.counters["refused"] == 3
    with pytest.raises(BatchesRefusedError, match="refused every batch of T queue 0 on broker-a for 90 s"):
        _found(puller, table, 4)
    assert st.offset == 7 and st.committed <= 7, "nothing refused is taken or committed"
    assert len(handed) == 4


def test_an_accepted_batch_or_a_stop_starts_the_count_of_refusals_again(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    answers = [False, True, False, False]
    puller, table, handed = _puller(max_refused_s=60.0)
    puller.on_batch = lambda batch: answers.pop(0) if answers else False
    puller.running.set()
    for n in range(1, 5):  # refused, accepted, refused, refused: 40 s apart, never 60 refused in a row
        _found(puller, table, n)
        clock[0] += 25.0
    puller.running.clear()  # stopping: the ingest refuses what it is handed; not counted
    clock[0] += 500.0
    _found(puller, table, 5)
    puller.running.set()
    _found(puller, table, 6)
    clock[0] += 59.0
    _found(puller, table, 7)
    clock[0] += 1.0
    with pytest.raises(BatchesRefusedError, match="for 60 s"):
        _found(puller, table, 8)


def test_a_callback_that_says_no_retry_can_succeed_ends_the_pull_thread_at_once() -> None:
    """A callback raising `BatchesRefusedError` itself (a store that cannot heal) is not logged as a
    batch to pull again: the thread stops on the first refusal, nothing of the batch taken."""
    puller, table, handed = _puller()

    def broken(batch: list[Any]) -> bool:
        handed.append(batch)
        raise BatchesRefusedError("storing a batch failed for good")

    puller.on_batch = broken
    puller.running.set()
    with pytest.raises(BatchesRefusedError, match="failed for good"):
        _found(puller, table, 1)
    st = table.get(Q)
    assert st is not None and st.offset == 7 and st.committed <= 7 and len(handed) == 1
    assert puller.counters["batches"] == 0


def _membership(table: QueueTable) -> Any:
    from forwarder.rocketmq._membership import Membership

    return Membership(None, "g", "T", "me", table, answer=lambda r: None,  # type: ignore[arg-type]
                      pull_from=lambda b: None, counters={}, rebalance_interval_s=0.01, timeout=1.0,
                      security=None, queue_filter=None)


def test_the_rebalancer_retries_a_broker_away_and_ends_on_a_fault_nobody_expected() -> None:
    """The rebalance thread logged every error and went on: a bug there (a KeyError, say) repeated
    every round while the group went unfollowed and the service said ready. A NameServer or broker
    away (a RemotingError) is tried again the next round; anything else ends the thread, which
    `dead_threads` then reports."""
    from forwarder.rocketmq.errors import ConnectionFailedError

    membership = _membership(QueueTable())
    rounds: list[str] = []

    def rebalance() -> None:
        rounds.append("round")
        if len(rounds) < 3:
            raise ConnectionFailedError("the NameServer is away")
        raise KeyError("broker-b")

    membership.rebalance = rebalance
    stopping = threading.Event()
    t = threading.Thread(target=membership.serve_loop, args=(stopping,), daemon=True)
    t.start()
    t.join(10)
    try:
        assert not t.is_alive(), "a fault nobody expected left the rebalance thread running"
        assert len(rounds) == 3, "a broker away was not tried again"
        assert membership.failure == "KeyError: 'broker-b'"
    finally:
        stopping.set()


@pytest.mark.parametrize(("ext", "body"), [({"offset": "x"}, b""), ({"offset": ""}, b"")])
def test_a_start_offset_that_is_not_a_number_is_a_protocol_error(ext: dict[str, str], body: bytes) -> None:
    table = QueueTable()
    membership = _membership(table)
    membership._brokers["broker-a"] = "127.0.0.1:1"
    membership.request = lambda addr, code, e, ok=None: Response(SUCCESS, 1, "", ext, body)
    with pytest.raises(ProtocolError, match="offset="):
        membership._start_offset(Q)


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"consumerIdList": "me"}', b'{"consumerIdList": [1]}', b"{"])
def test_a_consumer_list_that_is_not_one_is_a_protocol_error(body: bytes) -> None:
    membership = _membership(QueueTable())
    membership._brokers["broker-a"] = "127.0.0.1:1"
    membership.request = lambda addr, code, e, ok=None: Response(SUCCESS, 1, "", {}, body)
    with pytest.raises(ProtocolError, match="consumer list of g"):
        membership.members()


class _Counted:
    """An answer of `count` messages from `first` on (all a gap check reads)."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count

    def __len__(self) -> int:
        return self.count

    def unreadable(self) -> list[str]:
        return []

    def last_offset(self) -> int:
        return self.first + self.count - 1


def _gap_puller() -> tuple[Puller, QueueTable, list[Any], list[int]]:
    """A puller whose every found answer holds `counts.pop(0)` messages from the queue's offset."""
    puller, table, handed = _puller()
    counts: list[int] = []
    st = table.get(Q)
    assert st is not None
    puller.reader = BodyReader(lambda body, limit, broker, budget: _Counted(st.offset, counts.pop(0)),
                               lambda messages, broker: _Counted(st.offset, len(messages)))
    puller._flat = False
    return puller, table, handed, counts


def _answer(puller: Puller, table: QueueTable, opaque: int, next_offset: int) -> None:
    st = table.get(Q)
    assert st is not None
    st.in_flight = opaque
    ext = {"nextBeginOffset": str(next_offset), "maxOffset": str(next_offset)}
    puller._handle_pulls([(Q, Response(SUCCESS, opaque, "", ext, b"body"))])


def test_an_answer_that_skips_an_offset_is_pulled_again_and_its_retry_is_taken_whole() -> None:
    """A broker may count in nextBeginOffset a message it did not return (a commit-log read that came
    back empty): the answer is not taken, so the message is not passed over; the same pull goes again."""
    puller, table, handed, counts = _gap_puller()
    st = table.get(Q)
    assert st is not None
    counts[:] = [3, 4]
    _answer(puller, table, 1, 11)  # offsets 7..10 claimed, 3 returned
    assert handed == [] and st.offset == 7 and st.in_flight is None and st.retry_at > time.monotonic()
    assert puller.counters["pull_gaps"] == 1 and table.offsets_moved == []
    _answer(puller, table, 2, 11)
    assert [len(a) for a in handed[0]] == [4] and st.offset == 11 and st.gap_pulls == 0


def test_a_gap_the_broker_keeps_answering_is_passed_over_after_the_tries_and_reported() -> None:
    puller, table, handed, counts = _gap_puller()
    st = table.get(Q)
    assert st is not None
    counts[:] = [2, 2, 2]
    for opaque in (1, 2):
        _answer(puller, table, opaque, 10)
        assert handed == [] and st.offset == 7
    _answer(puller, table, 3, 10)
    assert [len(a) for a in handed[0]] == [2] and st.offset == 10
    assert puller.counters["pull_gaps"] == 3
    assert table.offsets_moved == ["broker-a:0 7 -> 10 (1 not returned)"]
    puller.on_batch = lambda batch: False  # a refused batch pulled again is not reported twice
    st.offset, counts[:] = 7, [2]
    _answer(puller, table, 4, 10)
    assert st.offset == 7 and len(table.offsets_moved) == 1


def test_an_answer_without_a_gap_is_taken_at_once() -> None:
    puller, table, handed, counts = _gap_puller()
    counts[:] = [3]
    _answer(puller, table, 1, 10)
    assert [len(a) for a in handed[0]] == [3] and puller.counters["pull_gaps"] == 0
