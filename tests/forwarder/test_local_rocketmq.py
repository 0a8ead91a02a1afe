"""The local RocketMQ: start-up, topics, a round trip through the real broker, broker restarts."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rocketmq.client import ConsumeStatus, Message, Producer, PushConsumer, RecvMessage, SendResult
from rocketmq.exceptions import ProducerSendSyncFailed

from forwarder.errors import LocalRocketMQError
from forwarder.local_rocketmq import LocalRocketMQ, topic_route
from tests.polling import unique, wait_for


class _Received:
    """Collects what a wrapper PushConsumer hands over, copied out while the message is valid."""

    def __init__(self) -> None:
        self.items: list[dict[str, object]] = []
        self._lock = threading.Lock()

    def __call__(self, msg: RecvMessage) -> ConsumeStatus:
        record = {
            "id": msg.id,
            "topic": msg.topic,
            "body": msg.body,
            "tags": msg.tags,
            "keys": msg.keys,
            "uniq_key": msg.get_property("UNIQ_KEY"),
            "plain": msg.get_property("plain"),
            "unicode": msg.get_property("unicode"),
            "punctuation": msg.get_property("punctuation"),
        }
        with self._lock:
            self.items.append(record)
        return ConsumeStatus.CONSUME_SUCCESS

    def bodies(self) -> list[bytes]:
        """Bodies received so far."""
        with self._lock:
            return [item["body"] for item in self.items]  # type: ignore[misc]


@pytest.fixture
def producer(rocketmq: LocalRocketMQ) -> Iterator[Producer]:
    """A started wrapper Producer on the session broker."""
    p = Producer(unique("test_producer"))
    p.set_namesrv_addr(rocketmq.namesrv_addr)
    p.start()
    yield p
    p.shutdown()


def _consumer(rocketmq: LocalRocketMQ, topic: str, received: _Received) -> PushConsumer:
    """A started wrapper PushConsumer of a fresh group on `topic`."""
    c = PushConsumer(unique("test_consumer"))
    c.set_namesrv_addr(rocketmq.namesrv_addr)
    c.subscribe(topic, received)
    c.start()
    return c


def _message(topic: str, body: str, **properties: str) -> Message:
    """A wrapper Message with tags, keys and properties."""
    msg = Message(topic)
    msg.set_tags("tag-a")
    msg.set_keys("order-1 order-2")
    msg.set_body(body)
    for name, value in properties.items():
        msg.set_property(name, value)
    return msg


pytestmark = pytest.mark.rocketmq


def test_addresses_are_loopback_and_files_stay_in_the_run_dir(rocketmq: LocalRocketMQ) -> None:
    host, port = rocketmq.namesrv_addr.split(":")
    assert host == "127.0.0.1" and 20000 <= int(port) < 32000
    assert rocketmq.broker_addr.startswith("127.0.0.1:")
    run = rocketmq.run_dir
    assert (run / "store" / "commitlog").is_dir()
    assert (run / "logs" / "rocketmqlogs" / "broker.log").is_file()
    assert "timerWheelEnable=true" in (run / "broker.conf").read_text()


def test_create_topics_makes_routes_in_one_go(rocketmq: LocalRocketMQ) -> None:
    topics = [unique("many") for _ in range(10)]
    start = time.monotonic()
    rocketmq.create_topics(topics, queues=2)
    assert time.monotonic() - start < 10
    for topic in topics:
        route = topic_route(rocketmq.namesrv_addr, topic)
        assert route is not None
        assert [q["writeQueueNums"] for q in route["queueDatas"]] == [2]
        assert route["brokerDatas"][0]["brokerAddrs"]["0"] == rocketmq.broker_addr
    assert topic_route(rocketmq.namesrv_addr, unique("never_created")) is None


def test_round_trip_keeps_body_tags_keys_properties(rocketmq: LocalRocketMQ, producer: Producer) -> None:
    topic = unique("roundtrip")
    rocketmq.create_topics([topic])
    props = {"plain": "v1", "unicode": "häll€ ✓ 時間", "punctuation": "a b=c;d&e,f:g|h"}
    result = _send_past_slow_routes(producer, _message(topic, "hello timewheel", **props))
    assert len(result.msg_id) == 32

    received = _Received()
    consumer = _consumer(rocketmq, topic, received)
    try:
        assert wait_for(lambda: any(item["id"] == result.msg_id for item in received.items))
    finally:
        consumer.shutdown()
    got = next(item for item in received.items if item["id"] == result.msg_id)
    assert got["topic"] == topic
    assert got["body"] == b"hello timewheel"
    assert got["tags"] == b"tag-a"
    assert got["keys"] == b"order-1 order-2"
    # The message id on the consumer side is the producer's UNIQ_KEY, as a str; properties are bytes.
    assert got["id"] == result.msg_id
    assert got["uniq_key"] == result.msg_id.encode()
    assert got["plain"] == b"v1"
    assert got["unicode"] == props["unicode"].encode()
    assert got["punctuation"] == props["punctuation"].encode()


def test_broker_crash_and_restart_keep_working(rocketmq: LocalRocketMQ, producer: Producer) -> None:
    topic = unique("restart")
    rocketmq.create_topics([topic])
    producer.send_sync(_message(topic, "before"))
    rocketmq.stop_broker(kill=True)
    try:
        assert not rocketmq.broker_running
        with pytest.raises(ProducerSendSyncFailed):
            producer.send_sync(_message(topic, "while down"))
    finally:
        rocketmq.start_broker()
    assert rocketmq.broker_running
    assert wait_for(lambda: _sends(producer, topic, "after"), timeout=30)

    received = _Received()
    consumer = _consumer(rocketmq, topic, received)
    try:
        assert wait_for(lambda: {b"before", b"after"} <= set(received.bodies()), 60), received.bodies()
    finally:
        consumer.shutdown()


@pytest.mark.slow
def test_graceful_broker_stop_and_start(rocketmq: LocalRocketMQ, producer: Producer) -> None:
    topic = unique("graceful")
    rocketmq.create_topics([topic])
    rocketmq.stop_broker(timeout=60.0)
    rocketmq.start_broker()
    assert wait_for(lambda: _sends(producer, topic, "after graceful restart"), timeout=30)


def _send_past_slow_routes(producer: Producer, msg: Message, tries: int = 4) -> SendResult:
    """Send `msg`, again while the client says "No route info": it says so when the NameServer answered
    it slowly (a loaded machine) although the topic's route is there; any other failure is raised."""
    for attempt in range(1, tries + 1):
        try:
            return producer.send_sync(msg)
        except ProducerSendSyncFailed as e:
            if "No route info" not in str(e) or attempt == tries:
                raise
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")


def _sends(producer: Producer, topic: str, body: str) -> bool:
    """Try one send; tell whether it worked."""
    try:
        producer.send_sync(_message(topic, body))
    except ProducerSendSyncFailed:
        return False
    return True


def test_start_twice_and_stop_twice(tmp_path: Path) -> None:
    mq = LocalRocketMQ(run_dir=tmp_path / "run", stop_timeout=3.0)
    with pytest.raises(LocalRocketMQError, match="not been started"):
        _ = mq.namesrv_addr
    with mq:
        with pytest.raises(LocalRocketMQError, match="already started"):
            mq.start()
        assert (tmp_path / "run" / "broker.out").is_file()
    mq.stop()  # idempotent
    assert not mq.broker_running


@pytest.mark.slow
def test_run_foreground_prints_the_address_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from forwarder.local_rocketmq import run_foreground; run_foreground(Path(sys.argv[1]))",
         str(tmp_path / "fg")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("namesrv 127.0.0.1:"), line
        addr = line.split()[1]
        assert topic_route(addr, "TBW102") is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Stopped cleanly: the broker left no abort marker behind, and the store stays for next time.
    assert (tmp_path / "fg" / "store" / "commitlog").is_dir()
    assert not (tmp_path / "fg" / "store" / "abort").exists()
