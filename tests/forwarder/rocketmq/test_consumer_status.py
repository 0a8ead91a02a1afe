"""Requests a broker sends its consumer: their bodies, the answers on the wire, and a real broker's notice."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import Connection, RemotingPullConsumer
from forwarder.rocketmq.consumer_status import QueueReport, consumer_status_body, parse_reset_offsets, running_info_body
from forwarder.rocketmq.errors import ProtocolError
from forwarder.rocketmq.protocol import (GET_CONSUMER_RUNNING_INFO, NOTIFY_CONSUMER_IDS_CHANGED,
                                         REQUEST_CODE_NOT_SUPPORTED, RESET_CONSUMER_CLIENT_OFFSET, SUCCESS,
                                         SYSTEM_ERROR, Request, decode_frame, encode_request, take_frame)

# ResetOffsetBody and GetConsumerStatusBody as RocketMQ 5.3.3's Java classes encode them
JAVA_RESET_BODY = b'{"offsetTable":{{"brokerName":"broker-a","queueId":1,"topic":"T"}:7}}'
JAVA_STATUS_BODY = b'{"consumerTable":{},"messageQueueTable":{{"brokerName":"broker-a","queueId":1,"topic":"T"}:7}}'


def test_reset_offsets_read_as_java_writes_them() -> None:
    assert parse_reset_offsets(JAVA_RESET_BODY) == {("T", "broker-a", 1): 7}
    assert parse_reset_offsets(b'{"offsetTable":{}}') == {}
    with pytest.raises(ProtocolError):
        parse_reset_offsets(b'{"offsetTable":{{"brokerName":"b","queueId":"x","topic":"T"}:7}}')


def test_status_body_is_written_as_java_writes_it() -> None:
    report = QueueReport("T", "broker-a", 1, 7, 5, 0, 0)
    assert consumer_status_body([report]) == JAVA_STATUS_BODY


def test_running_info_carries_queues_properties_and_counters() -> None:
    body = running_info_body({"PROP_CONSUME_TYPE": "CONSUME_PASSIVELY"}, "T",
                             [QueueReport("T", "broker-a", 2, 9, 8, 111, 222)], {"pulled": 3})
    # standard JSON once the queue key is quoted: every field where Java's ConsumerRunningInfo has it
    doc = json.loads(body.replace(b'{"brokerName":"broker-a","queueId":2,"topic":"T"}:', b'"mq":'))
    assert doc["mqTable"]["mq"]["commitOffset"] == 8 and doc["mqTable"]["mq"]["lastPullTimestamp"] == 111
    assert doc["properties"] == {"PROP_CONSUME_TYPE": "CONSUME_PASSIVELY"}
    assert doc["subscriptionSet"][0]["topic"] == "T" and doc["userConsumerInfo"] == {"pulled": "3"}


class FakeBroker:
    """A listening socket that sends the client request frames and returns the client's answers."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.peer: socket.socket | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener shut down before a client came
            self.peer, _ = self.server.accept()

    def ask(self, code: int, opaque: int, oneway: bool = False) -> dict[str, object] | None:
        while self.peer is None:
            time.sleep(0.01)
        frame = bytearray(encode_request(code, opaque, {"consumerGroup": "g"}, b""))
        if oneway:  # flag bit 1
            frame[8:] = frame[8:].replace(b'"flag":0', b'"flag":2')
        self.peer.sendall(bytes(frame))
        self.peer.settimeout(0.5)
        buf = bytearray()
        try:
            while (got := take_frame(buf, "client")) is None:
                chunk = self.peer.recv(65536)
                if not chunk:
                    return None
                buf += chunk
        except TimeoutError:
            return None
        flag, header, _ = decode_frame(got, "client")
        assert flag & 1
        return header


@pytest.fixture
def fake_broker() -> Iterator[FakeBroker]:
    b = FakeBroker()
    yield b
    with contextlib.suppress(OSError):  # wakes the thread blocked in accept(), which close() alone does not
        b.server.shutdown(socket.SHUT_RDWR)
    b.server.close()
    if b.peer is not None:  # the accepted connection is a socket of its own
        b.peer.close()


def test_a_connection_without_handler_answers_not_supported(fake_broker: FakeBroker) -> None:
    conn = Connection(fake_broker.addr, 2.0)
    try:
        answered: list[dict[str, object] | None] = []
        t = threading.Thread(target=lambda: answered.append(fake_broker.ask(999, 41)))
        t.start()
        deadline = time.monotonic() + 5
        while t.is_alive() and time.monotonic() < deadline:
            conn.serve_requests()
            time.sleep(0.01)
        [header] = answered
        assert header is not None and header["code"] == REQUEST_CODE_NOT_SUPPORTED and header["opaque"] == 41
        assert "999" in str(header["remark"])
    finally:
        conn.close()


def test_a_consumer_answers_what_it_knows_and_refuses_the_rest(fake_broker: FakeBroker) -> None:
    consumer = RemotingPullConsumer("127.0.0.1:1", "g", "T", lambda batch: True)
    conn = Connection(fake_broker.addr, 2.0, on_request=consumer.answer)
    try:
        def ask(code: int, opaque: int, oneway: bool = False) -> dict[str, object] | None:
            out: list[dict[str, object] | None] = []
            t = threading.Thread(target=lambda: out.append(fake_broker.ask(code, opaque, oneway)))
            t.start()
            while t.is_alive():
                conn.serve_requests()
                time.sleep(0.01)
            return out[0]

        info = ask(GET_CONSUMER_RUNNING_INFO, 1)
        assert info is not None and info["code"] == SUCCESS
        assert ask(NOTIFY_CONSUMER_IDS_CHANGED, 2, oneway=True) is None  # one-way: no answer
        assert consumer._membership.rebalance_now.is_set()
        assert ask(RESET_CONSUMER_CLIENT_OFFSET, 3, oneway=True) is None
        unknown = ask(36, 4)  # CONSUME_MESSAGE_DIRECTLY: not handled by the engine
        assert unknown is not None and unknown["code"] == REQUEST_CODE_NOT_SUPPORTED and unknown["opaque"] == 4
    finally:
        conn.close()
    other = RemotingPullConsumer("127.0.0.1:1", "another", "T", lambda batch: True)
    refusal = other.answer(Request(GET_CONSUMER_RUNNING_INFO, 1, False, {"consumerGroup": "g"}, b""))
    assert refusal is not None and refusal[0] == SYSTEM_ERROR and "<g>" in str(refusal[1])


@pytest.mark.rocketmq
def test_a_joining_member_is_noticed_at_once_not_at_the_next_round(rocketmq: LocalRocketMQ) -> None:
    """With rebalances a minute apart, the broker's NOTIFY_CONSUMER_IDS_CHANGED makes the first member
    give up half its queues within seconds of a second one joining."""
    topic, group = f"NOTIFY_{uuid.uuid4().hex[:8]}", f"notify_{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic])
    first = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, lambda b: True, rebalance_interval_s=60)
    second = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, lambda b: True, rebalance_interval_s=60)
    first.start()
    try:
        assert len(first.owned()) == 4
        second.start()  # its first rebalance runs inside start(): it already sees both members
        t0 = time.monotonic()
        while len(first.owned()) != 2 and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert len(first.owned()) == 2 and sorted(first.owned() + second.owned()) == [(first.owned()[0][0], q)
                                                                                        for q in range(4)]
        print(f"\nthe first member rebalanced {took:.2f} s after the second joined (rounds are 60 s apart)")
        assert took < 20
    finally:
        second.stop()
        first.stop()


def test_serving_a_flood_of_requests_returns_after_its_limit(fake_broker: FakeBroker) -> None:
    # a broker that keeps sending must not hold the rebalance thread in one call for good
    seen: list[int] = []

    def handler(req: Request) -> None:
        seen.append(req.opaque)
        return None

    conn = Connection(fake_broker.addr, 2.0, on_request=handler)
    try:
        while fake_broker.peer is None:
            time.sleep(0.01)
        frames = bytearray()
        for opaque in range(1, 201):
            frame = bytearray(encode_request(NOTIFY_CONSUMER_IDS_CHANGED, opaque, {"consumerGroup": "g"}, b""))
            frame[8:] = frame[8:].replace(b'"flag":0', b'"flag":2')  # one-way: nothing to answer
            frames += frame
        fake_broker.peer.sendall(bytes(frames))
        deadline = time.monotonic() + 5
        while not conn.readable(0.05) and time.monotonic() < deadline:
            pass
        time.sleep(0.2)  # all 200 on the client's side of the socket
        assert conn.serve_requests(limit=64) == 64
        assert seen == list(range(1, 65))
        served = 64
        while served < 200 and time.monotonic() < deadline:
            served += conn.serve_requests(limit=64)
        assert served == 200 and seen == list(range(1, 201)), "the rest are served by the next calls"
    finally:
        conn.close()
