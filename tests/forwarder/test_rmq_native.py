"""The native client bindings against the real local broker: bodies, properties, async, failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from rocketmq.client import ConsumeStatus, Message, Producer, PushConsumer, RecvMessage

from forwarder._rmq_native import NativeProducer, NativePushConsumer, read_message
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, SendResult, SendStatus, user_properties
from forwarder.errors import SendError
from forwarder.local_rocketmq import LocalRocketMQ
from tests.polling import unique, wait_for

pytestmark = pytest.mark.rocketmq

ALL_BYTES = bytes(range(256)) * 2


class _Inbox:
    """Thread-safe list of received messages."""

    def __init__(self) -> None:
        self.messages: list[ReceivedMessage] = []
        self._lock = threading.Lock()

    def add(self, msg: ReceivedMessage) -> None:
        """Keep one message."""
        with self._lock:
            self.messages.append(msg)

    def take(self, msg: ReceivedMessage) -> bool:
        """Keep one message, as a consume callback: consumed."""
        self.add(msg)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self.messages)


@pytest.fixture
def producer(rocketmq: LocalRocketMQ) -> Iterator[NativeProducer]:
    """A started NativeProducer on the session broker."""
    with NativeProducer(unique("native_producer"), rocketmq.namesrv_addr) as p:
        yield p


@pytest.fixture
def topic(rocketmq: LocalRocketMQ) -> str:
    """A fresh topic with 4 queues."""
    name = unique("native")
    rocketmq.create_topics([name])
    return name


def _consume(rocketmq: LocalRocketMQ, topic: str, on_message: Callable[[ReceivedMessage], bool]) -> NativePushConsumer:
    """A started NativePushConsumer of a fresh group."""
    consumer = NativePushConsumer(unique("native_consumer"), rocketmq.namesrv_addr, on_message)
    consumer.subscribe(topic)
    consumer.start()
    return consumer


def test_binary_body_and_every_property_round_trip(
    rocketmq: LocalRocketMQ, producer: NativeProducer, topic: str
) -> None:
    props = {"plain": "v", "empty": "", "unicode": "häll€ ✓ 時間", "punctuation": "a b=c;d&e,f:g|h"}
    result = producer.send(OutgoingMessage(topic, ALL_BYTES, tags="tag-a", keys="k1 k2", properties=props))
    assert result.status is SendStatus.OK
    assert len(result.msg_id) == 32

    inbox = _Inbox()
    consumer = _consume(rocketmq, topic, inbox.take)
    try:
        assert wait_for(lambda: len(inbox) >= 1)
    finally:
        consumer.shutdown()
    got = inbox.messages[0]
    assert got.topic == topic
    assert got.body == ALL_BYTES
    assert (got.tags, got.keys) == ("tag-a", "k1 k2")
    assert got.msg_id == result.msg_id == got.properties["UNIQ_KEY"]
    assert got.queue_offset == result.queue_offset
    assert {k: got.properties[k] for k in props if k != "empty"} == {k: v for k, v in props.items() if k != "empty"}
    # A property with an empty value is sent, but this client's decoder drops it on receipt.
    assert "empty" not in got.properties
    # System properties travel in the same map: the forwarder must filter them when copying.
    assert got.properties["KEYS"] == "k1 k2" and got.properties["TAGS"] == "tag-a"
    assert {"WAIT", "MSG_REGION", "TRACE_ON", "CLUSTER"} <= got.properties.keys()
    assert user_properties(got.properties) == {k: v for k, v in props.items() if k != "empty"}
    assert got.reconsume_times == 0
    assert abs(got.store_timestamp - time.time() * 1000) < 60_000
    assert got.born_timestamp <= got.store_timestamp + 1000


def test_read_message_works_on_the_wrappers_recv_message(rocketmq: LocalRocketMQ, topic: str) -> None:
    wrapper_producer = Producer(unique("wrapper_producer"))
    wrapper_producer.set_namesrv_addr(rocketmq.namesrv_addr)
    wrapper_producer.start()
    try:
        msg = Message(topic)
        msg.set_body("from the wrapper")
        msg.set_property("p", "1")
        sent = wrapper_producer.send_sync(msg)
    finally:
        wrapper_producer.shutdown()

    inbox = _Inbox()

    def on_message(recv: RecvMessage) -> ConsumeStatus:
        inbox.add(read_message(recv))
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(unique("wrapper_consumer"))
    consumer.set_namesrv_addr(rocketmq.namesrv_addr)
    consumer.subscribe(topic, on_message)
    consumer.start()
    try:
        assert wait_for(lambda: len(inbox) >= 1)
    finally:
        consumer.shutdown()
    got = inbox.messages[0]
    assert (got.body, got.msg_id, got.properties["p"]) == (b"from the wrapper", sent.msg_id, "1")


@pytest.mark.parametrize(
    "msg",
    [
        pytest.param(OutgoingMessage("t", b"", properties={"a": "x\x01y"}), id="value-with-x01"),
        pytest.param(OutgoingMessage("t", b"", properties={"a": "x\x02y"}), id="value-with-x02"),
        pytest.param(OutgoingMessage("t", b"", properties={"a\x01": "x"}), id="name-with-x01"),
        pytest.param(OutgoingMessage("t", b"", properties={"a": "x\x00y"}), id="value-with-nul"),
        pytest.param(OutgoingMessage("t", b"", tags="x\x00y"), id="tags-with-nul"),
    ],
)
def test_bytes_rocketmq_cannot_carry_are_refused(producer: NativeProducer, msg: OutgoingMessage) -> None:
    with pytest.raises(ValueError):
        producer.send(msg)


def test_the_wrapper_silently_mangles_separator_bytes(rocketmq: LocalRocketMQ, topic: str) -> None:
    """Why the bindings refuse \\x01 and \\x02: through the wrapper they corrupt properties."""
    wrapper_producer = Producer(unique("wrapper_producer"))
    wrapper_producer.set_namesrv_addr(rocketmq.namesrv_addr)
    wrapper_producer.start()
    try:
        msg = Message(topic)
        msg.set_body("b")
        msg.set_property("one", "a\x01b")
        msg.set_property("two", "c\x02d\x01e")
        wrapper_producer.send_sync(msg)
    finally:
        wrapper_producer.shutdown()
    inbox = _Inbox()
    consumer = _consume(rocketmq, topic, inbox.take)
    try:
        assert wait_for(lambda: len(inbox) >= 1)
    finally:
        consumer.shutdown()
    props = inbox.messages[0].properties
    assert "one" not in props  # dropped: three fields after the split
    assert props["two"] == "c"  # cut, and the rest became a property of its own
    assert props["d"] == "e"


def test_async_sends_report_every_outcome_once(
    rocketmq: LocalRocketMQ, producer: NativeProducer, topic: str
) -> None:
    outcomes: list[tuple[SendResult | None, SendError | None]] = []
    lock = threading.Lock()

    def done(result: SendResult | None, error: SendError | None) -> None:
        with lock:
            outcomes.append((result, error))

    for i in range(300):
        producer.send_async(OutgoingMessage(topic, b"async %d" % i, properties={"i": str(i)}), done)
    assert producer.flush(30)
    assert producer.inflight == 0
    assert len(outcomes) == 300
    assert all(error is None for _, error in outcomes)
    ids = {result.msg_id for result, _ in outcomes if result is not None}
    assert len(ids) == 300

    inbox = _Inbox()
    consumer = _consume(rocketmq, topic, inbox.take)
    try:
        assert wait_for(lambda: len(inbox) >= 300)
    finally:
        consumer.shutdown()
    assert {m.msg_id for m in inbox.messages} == ids


def test_batch_send_is_stored_as_one_message(rocketmq: LocalRocketMQ, producer: NativeProducer, topic: str) -> None:
    """Pins the client bug that keeps SendBatchMessage private (batch header sent as "1")."""
    batch = [OutgoingMessage(topic, b"part-%d" % i, tags=f"t{i}", properties={"i": str(i)}) for i in range(3)]
    result = producer._send_batch(batch)
    assert result.msg_id == ""
    inbox = _Inbox()
    consumer = _consume(rocketmq, topic, inbox.take)
    try:
        assert wait_for(lambda: len(inbox) >= 1)
        time.sleep(1.0)  # would the other two show up?
    finally:
        consumer.shutdown()
    assert len(inbox) == 1
    only = inbox.messages[0]
    assert only.tags == "" and "i" not in only.properties
    assert all(b"part-%d" % i in only.body for i in range(3))


def test_broker_down_gives_retriable_errors_fast(
    rocketmq: LocalRocketMQ, producer: NativeProducer, topic: str
) -> None:
    producer.send(OutgoingMessage(topic, b"up"))
    rocketmq.stop_broker(kill=True)
    try:
        start = time.monotonic()
        with pytest.raises(SendError) as info:
            producer.send(OutgoingMessage(topic, b"down"))
        assert info.value.retriable
        assert time.monotonic() - start < 10

        failed = threading.Event()
        errors: list[SendError | None] = []

        def done(result: SendResult | None, error: SendError | None) -> None:
            errors.append(error)
            failed.set()

        producer.send_async(OutgoingMessage(topic, b"down, async"), done)
        assert failed.wait(15)
        assert isinstance(errors[0], SendError) and errors[0].retriable
    finally:
        rocketmq.start_broker()
    assert wait_for(lambda: _sends(producer, topic), timeout=30)


def _sends(producer: NativeProducer, topic: str) -> bool:
    """Try one send; tell whether it worked."""
    try:
        producer.send(OutgoingMessage(topic, b"after restart"))
    except SendError:
        return False
    return True


@pytest.mark.slow
def test_failed_or_raising_callbacks_get_the_message_again(
    rocketmq: LocalRocketMQ, producer: NativeProducer, topic: str
) -> None:
    producer.send(OutgoingMessage(topic, b"refuse me"))
    producer.send(OutgoingMessage(topic, b"raise on me"))
    attempts: dict[bytes, list[int]] = {b"refuse me": [], b"raise on me": []}
    lock = threading.Lock()

    def on_message(msg: ReceivedMessage) -> bool:
        with lock:
            attempts[msg.body].append(msg.reconsume_times)
            first = len(attempts[msg.body]) == 1
        if first and msg.body == b"raise on me":
            raise RuntimeError("a bug in the callback")
        return not first

    consumer = _consume(rocketmq, topic, on_message)
    try:
        # Redelivery goes through %RETRY%<group> after the broker's first retry delay (10 s): both at once.
        assert wait_for(lambda: all(len(a) >= 2 for a in attempts.values()), timeout=120)
        time.sleep(1.0)  # would either come a third time?
    finally:
        consumer.shutdown()
    assert attempts == {b"refuse me": [0, 1], b"raise on me": [0, 1]}
