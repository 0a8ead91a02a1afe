"""The producer: batches against a scripted NameServer and broker, and real batches through the local
RocketMQ (round trips, several topics, broker restarts, missing topics)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, SendStatus
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import (
    BrokerBusyError,
    ConnectionFailedError,
    MessageRejectedError,
    ProtocolError,
    Receipt,
    RemotingError,
    RemotingProducer,
    RequestTimeoutError,
    TopicNotFoundError,
)
from forwarder.config import RocketMQConfig
from timewheel.message import Message, SendResults

# -- a scripted NameServer + broker on loopback ----------------------------------------------------


@dataclass
class Request:
    """A request the fake server received."""

    code: int
    opaque: int
    ext: dict[str, str]
    body: bytes


Reply = tuple[int, dict[str, str], bytes] | None  # (code, extFields, body); None: no answer


def _store_all(reqs: list[Request]) -> list[tuple[Request, Reply]]:
    """Every batch stored, in the queue its request names."""
    return [(r, (0, {"queueId": r.ext["e"], "queueOffset": "0"}, b"")) for r in reqs]


@dataclass
class FakeServer:
    """Answers GET_ROUTEINFO_BY_TOPIC from `routes` and SEND_BATCH_MESSAGE through `on_batch`.

    One address plays NameServer and broker. `on_batch` gets all the batch requests one socket
    read delivered (so a test can answer them out of order) and returns the answers to write.
    """

    routes: dict[str, int] = field(default_factory=dict)  # topic -> write queues
    on_batch: Callable[[list[Request]], list[tuple[Request, Reply]]] = field(default=_store_all)
    requests: list[Request] = field(default_factory=list)
    connections: int = 0

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._socks.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buf = b""
        try:
            while True:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    return
                buf += chunk
                reqs = []
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">i", buf[:4])[0]:
                    (length,) = struct.unpack(">i", buf[:4])
                    frame, buf = buf[4:4 + length], buf[4 + length:]
                    hlen = struct.unpack(">i", frame[:4])[0] & 0xFFFFFF
                    h = json.loads(frame[4:4 + hlen])
                    reqs.append(Request(h["code"], h["opaque"], h.get("extFields") or {}, frame[4 + hlen:]))
                self.requests += reqs
                answers: list[tuple[Request, Reply]] = []
                batch = [r for r in reqs if r.code == 320]
                for r in reqs:
                    if r.code == 105:
                        answers.append((r, self._route(r.ext["topic"])))
                if batch:
                    answers += self.on_batch(batch)
                for r, reply in answers:
                    if reply is not None:
                        sock.sendall(frame_of(r.opaque, *reply))
        except OSError:
            return

    def _route(self, topic: str) -> Reply:
        if topic not in self.routes:
            return 17, {}, b""
        body = {"brokerDatas": [{"cluster": "c", "brokerName": "b", "brokerAddrs": {"0": self.addr}}],
                "queueDatas": [{"brokerName": "b", "readQueueNums": self.routes[topic],
                                "writeQueueNums": self.routes[topic], "perm": 6, "topicSysFlag": 0}]}
        return 0, {}, json.dumps(body).encode()

    def batches(self) -> list[Request]:
        return [r for r in self.requests if r.code == 320]

    def drop_connections(self) -> None:
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # a close() alone waits for the thread blocked in recv()
            except OSError:
                pass
            s.close()
        self._socks.clear()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept(), which close() alone does not
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()


def frame_of(opaque: int, code: int, ext: dict[str, str], body: bytes) -> bytes:
    header = json.dumps({"code": code, "flag": 1, "opaque": opaque, "language": "JAVA", "version": 0,
                         "remark": f"remark {code}", "extFields": ext}).encode()
    return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body


def decode_batch(body: bytes) -> list[tuple[bytes, dict[str, str]]]:
    """Split a SEND_BATCH_MESSAGE body back into (body, properties) per message."""
    out = []
    while body:
        size, _, _, _, blen = struct.unpack(">iiiii", body[:20])
        msg_body = body[20:20 + blen]
        (plen,) = struct.unpack(">h", body[20 + blen:22 + blen])
        props = body[22 + blen:22 + blen + plen].decode()
        assert size == 22 + blen + plen
        out.append((msg_body, dict(p.split("\x01") for p in props.split("\x02") if p)))
        body = body[size:]
    return out


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer(routes={"T": 4, "U": 2})
    yield s
    s.close()


def _msgs(topic: str, n: int, size: int = 10) -> list[OutgoingMessage]:
    return [OutgoingMessage(topic, bytes([i % 256]) * size, tags=f"t{i}", properties={"i": str(i)}) for i in range(n)]


def test_batches_are_cut_by_count_and_bytes_and_go_round_robin_over_the_queues(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g", max_batch_messages=128, max_batch_bytes=20_000) as p:
        results = p.send(_msgs("T", 300) + _msgs("U", 3, size=15_000))
    assert all(isinstance(r, Receipt) for r in results)
    sizes = [(r.ext["b"], len(decode_batch(r.body))) for r in server.batches()]
    assert sizes == [("T", 128), ("T", 128), ("T", 44), ("U", 1), ("U", 1), ("U", 1)]
    queues_t = [int(r.ext["e"]) for r in server.batches() if r.ext["b"] == "T"]
    assert sorted((q - queues_t[0]) % 4 for q in queues_t) == [0, 1, 2], "consecutive queues"
    first = server.batches()[0]
    assert first.ext["m"] == "true" and first.ext["a"] == "g" and first.ext["c"] == "TBW102"
    body, props = decode_batch(first.body)[5]
    assert body == b"\x05" * 10 and props["TAGS"] == "t5" and props["i"] == "5" and props["WAIT"] == "true"
    assert props["UNIQ_KEY"] == results[5].msg_id  # type: ignore[union-attr]
    assert server.connections == 2, "one to the NameServer, one to the broker (one address plays both here)"


def test_receipts_follow_the_queue_offsets_and_answers_are_matched_by_opaque(server: FakeServer) -> None:
    def reversed_answers(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        return [(r, (0, {"queueId": r.ext["e"], "queueOffset": str(1000 * r.opaque)}, b"")) for r in reversed(reqs)]

    server.on_batch = reversed_answers
    with RemotingProducer(server.addr, "g", max_batch_messages=2) as p:
        results = p.send(_msgs("T", 5))
    receipts = [r for r in results if isinstance(r, Receipt)]
    assert len(receipts) == 5
    opaques = [r.opaque for r in server.batches()]
    assert [r.queue_offset for r in receipts] == [1000 * opaques[0], 1000 * opaques[0] + 1, 1000 * opaques[1],
                                                  1000 * opaques[1] + 1, 1000 * opaques[2]]
    assert len({r.msg_id for r in receipts}) == 5 and all(len(r.msg_id) == 32 for r in receipts)


def test_a_refused_batch_fails_only_its_own_messages(server: FakeServer) -> None:
    def busy_u(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        return [(r, (2, {}, b"") if r.ext["b"] == "U" else (10, {"queueId": "0", "queueOffset": "7"}, b""))
                for r in reqs]

    server.on_batch = busy_u
    with RemotingProducer(server.addr, "g") as p:
        results = p.send(_msgs("T", 2) + _msgs("U", 2))
    assert [type(r) for r in results] == [Receipt, Receipt, BrokerBusyError, BrokerBusyError]
    assert results[0].status == SendStatus.FLUSH_DISK_TIMEOUT  # type: ignore[union-attr]  # stored, not flushed
    busy = results[2]
    assert busy is results[3] and isinstance(busy, BrokerBusyError) and busy.retriable and "remark 2" in str(busy)


def test_a_topic_without_route_fails_as_not_retriable_when_brokers_cannot_create_it(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g") as p:
        results = p.send(_msgs("NOPE", 2) + _msgs("T", 1))
    assert isinstance(results[0], TopicNotFoundError) and not results[0].retriable
    assert "NOPE does not exist" in str(results[0]) and isinstance(results[2], Receipt)


def test_a_topic_without_route_goes_through_the_default_topic_and_a_refusal_is_not_retriable(
        server: FakeServer) -> None:
    server.routes["TBW102"] = 8

    def no_auto_create(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        return [(r, (17, {}, b"") if r.ext["b"] == "NEW" else (0, {"queueOffset": "0"}, b"")) for r in reqs]

    server.on_batch = no_auto_create
    with RemotingProducer(server.addr, "g") as p:
        [result] = p.send(_msgs("NEW", 1))
        assert isinstance(result, TopicNotFoundError) and not result.retriable
        assert p.route("NEW").via_default_topic and len(p.route("NEW").queues) == 4  # as many as the broker creates
    [req] = server.batches()
    assert req.ext["b"] == "NEW" and req.ext["c"] == "TBW102" and req.ext["d"] == "4"


def test_batches_cut_beforehand_go_as_they_are_and_a_topic_without_route_fails_its_rows(server: FakeServer) -> None:
    from forwarder.rocketmq import EncodedBatches, SendBatch
    from forwarder.rocketmq.codec import encode_message

    def batch(topic: str, rows: list[int]) -> SendBatch:
        parts: list[bytes | memoryview] = [encode_message(OutgoingMessage(topic, b"m%d" % i), f"{i:032X}") for i in rows]
        return SendBatch(topic, rows, [f"{i:032X}" for i in rows], parts, sum(len(x) for x in parts))

    refused = MessageRejectedError("too big")
    cut = EncodedBatches([batch("T", [0, 2]), batch("NOPE", [1]), batch("T", [4])],
                         [(3, "T", refused), (5, "NOPE", refused)], [f"{i:032X}" for i in range(6)])
    with RemotingProducer(server.addr, "g") as p:
        out = p.send_batches(cut)
    assert out[0] is None and out[2] is None and out[4] is None and out[3] is refused
    assert isinstance(out[1], TopicNotFoundError) and out[5] is out[1], "the route's error first, as `send` answers"
    assert [[b for b, _ in decode_batch(r.body)] for r in server.batches()] == [[b"m0", b"m2"], [b"m4"]]


@pytest.mark.parametrize("topic", ["bad topic", "x" * 128, ""])
def test_invalid_topic_names_are_refused_before_any_request(server: FakeServer, topic: str) -> None:
    with RemotingProducer(server.addr, "g") as p:
        [result] = p.send([OutgoingMessage(topic, b"x")])
    assert isinstance(result, MessageRejectedError) and not server.requests


def test_a_message_over_the_size_limit_fails_alone(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g", max_message_bytes=1000) as p:
        results = p.send([OutgoingMessage("T", b"x" * 2000), OutgoingMessage("T", b"small")])
    assert isinstance(results[0], MessageRejectedError) and isinstance(results[1], Receipt)


def test_no_answer_times_out_and_the_next_send_uses_a_new_connection(server: FakeServer) -> None:
    silent = True

    def maybe_silent(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        return [(r, None if silent else (0, {"queueOffset": "0"}, b"")) for r in reqs]

    server.on_batch = maybe_silent
    with RemotingProducer(server.addr, "g", timeout_ms=300) as p:
        t = time.monotonic()
        [result] = p.send(_msgs("T", 1))
        assert isinstance(result, RequestTimeoutError) and result.retriable
        assert 0.25 < time.monotonic() - t < 2.0
        silent = False
        [result] = p.send(_msgs("T", 1))
        assert isinstance(result, Receipt)
    assert server.connections == 3, "NameServer, broker, broker again"


def test_a_connection_the_server_closed_is_reopened_before_the_next_send(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g") as p:
        assert isinstance(p.send(_msgs("T", 1))[0], Receipt)
        server.drop_connections()
        time.sleep(0.1)
        assert isinstance(p.send(_msgs("T", 1))[0], Receipt), "an idle connection closed by the peer is not a failure"
    assert server.connections == 3, "NameServer, broker, broker again"


def test_routes_are_refreshed_and_the_last_one_is_kept_when_the_nameserver_drops_it(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g", route_ttl_s=0.0, route_retry_s=0.0) as p:
        assert len(p.route("T").queues) == 4
        server.routes["T"] = 8
        assert len(p.route("T").queues) == 8, "a new queue count shows once the TTL passed"
        del server.routes["T"]  # as the NameServer does while the topic's only broker is down
        assert len(p.route("T").queues) == 8
        assert isinstance(p.send(_msgs("T", 1))[0], Receipt)


def test_sink_counts_refused_messages_without_opening_the_breaker(server: FakeServer) -> None:
    def busy_u(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        return [(r, (2, {}, b"") if r.ext["b"] == "U" else (0, {"queueOffset": "0"}, b"")) for r in reqs]

    server.on_batch = busy_u
    cfg = RocketMQConfig(namesrv=server.addr, breaker_failures=3, breaker_open_seconds=60)
    sink = RocketMQSink(cfg, producer=None)  # type: ignore[arg-type]  # no dead letters here
    due = int(time.time() * 1000)
    try:
        missing = [Message("MISSING", b"x", due) for _ in range(5)]
        assert sink.send_batch(missing + [Message("T", b"ok", due)]) == [False] * 5 + [True]
        assert sink.send_batch(missing) == [False] * 5
        assert not sink.breaker.is_open, "a topic that does not exist says nothing about the broker"
        assert sink.counters == {"sent": 1, "failed": 10, "refused": 0, "rejected": 10, "dead_lettered": 0}
        assert sink.send_batch([Message("U", b"busy", due)] * 3) == [False] * 3
        assert sink.breaker.is_open, "a busy broker is"
        assert sink.send_batch([Message("T", b"held", due)]) == [False] and sink.counters["refused"] == 1
    finally:
        sink.close()


def test_an_unreachable_nameserver_is_a_retriable_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    with RemotingProducer(addr, "g", timeout_ms=500) as p:
        [result] = p.send(_msgs("T", 1))
    assert isinstance(result, ConnectionFailedError) and result.retriable


def test_the_second_nameserver_answers_when_the_first_is_down(server: FakeServer) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with RemotingProducer(f"{dead};{server.addr}", "g") as p:
        assert isinstance(p.send(_msgs("T", 1))[0], Receipt)


def test_garbage_from_the_peer_is_a_protocol_error(server: FakeServer) -> None:
    def garbage(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        for s in server._socks:
            s.sendall(struct.pack(">ii", 8, (1 << 24) | 4) + b"\x00" * 4)  # binary header: not ours
        return []

    server.on_batch = garbage
    with RemotingProducer(server.addr, "g", timeout_ms=500) as p:
        [result] = p.send(_msgs("T", 1))
    assert isinstance(result, ProtocolError) and "type 1" in str(result)


def test_ids_are_distinct_and_carry_the_clients_layout(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g") as p:
        receipts = [r for _ in range(20) for r in p.send(_msgs("T", 256)) if isinstance(r, Receipt)]
    ids = [r.msg_id for r in receipts]
    assert len(ids) == len(set(ids)) == 20 * 256
    assert {i[:8] for i in ids} == {"7F000001"}  # the IPv4 address the NameServer saw: loopback
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_sends_from_several_threads_share_connections_safely(server: FakeServer) -> None:
    results: list[Receipt | RemotingError] = []
    lock = threading.Lock()
    with RemotingProducer(server.addr, "g", max_batch_messages=16) as p:
        def work() -> None:
            for _ in range(10):
                r = p.send(_msgs("T", 40) + _msgs("U", 10))
                with lock:
                    results.extend(r)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    errors = {repr(r)[:200] for r in results if not isinstance(r, Receipt)}
    assert len(results) == 4 * 10 * 50 and not errors, errors


# -- against the real local RocketMQ ---------------------------------------------------------------


class Inbox:
    """Collects received messages; `wait(n)` until n arrived."""

    def __init__(self) -> None:
        self.items: list[ReceivedMessage] = []
        self.cond = threading.Condition()

    def __call__(self, msg: ReceivedMessage) -> bool:
        with self.cond:
            self.items.append(msg)
            self.cond.notify_all()
        return True

    def wait(self, n: int, timeout: float = 60.0) -> list[ReceivedMessage]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.items) >= n, timeout)
            time.sleep(0.5)  # anything delivered twice would show up now
            return list(self.items)


def consume(mq: LocalRocketMQ, topics: list[str]) -> tuple[NativePushConsumer, Inbox]:
    inbox = Inbox()
    consumer = NativePushConsumer(f"test_remoting_{uuid.uuid4().hex[:8]}", mq.namesrv_addr, inbox)
    for t in topics:
        consumer.subscribe(t)
    consumer.start()
    return consumer, inbox


def _topic(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.mark.rocketmq
def test_round_trip_binary_bodies_tags_keys_and_unicode_properties(rocketmq: LocalRocketMQ) -> None:
    topic = _topic("RT")
    rocketmq.create_topics([topic])
    sent = [OutgoingMessage(topic, bytes([0, 255, i]) + f"ü{i}".encode() + b"\x00", tags=f"tag{i % 3}",
                            keys=f"k{i} order-{i}", properties={"customer": "Zoë 名前", "n": str(i),
                                                                "TW_ORIGINAL_MSG_ID": f"{i:032X}"})
            for i in range(50)] + [OutgoingMessage(topic, b"", properties={"empty_body": "yes"})]
    with RemotingProducer(rocketmq.namesrv_addr, "test_rt") as p:
        receipts = p.send_batch(topic, sent)
    consumer, inbox = consume(rocketmq, [topic])
    try:
        got = inbox.wait(len(sent))
    finally:
        consumer.shutdown()
    assert len(got) == len(sent), "each message stored separately, once"
    by_id = {m.msg_id: m for m in got}
    assert set(by_id) == {r.msg_id for r in receipts}
    for r, s in zip(receipts, sent):
        m = by_id[r.msg_id]
        assert (m.topic, m.body, m.tags, m.keys) == (topic, s.body, s.tags or "", s.keys or "")
        assert {k: m.properties[k] for k in s.properties} == s.properties
        assert (m.queue_id, m.queue_offset) == (r.queue_id, r.queue_offset)


@pytest.mark.rocketmq
def test_the_broker_stores_what_the_native_client_would(rocketmq: LocalRocketMQ) -> None:
    """Same property names on the consumer's side, for a wire batch and a native single send."""
    topic = _topic("SAME")
    rocketmq.create_topics([topic])
    msg = OutgoingMessage(topic, b"body", tags="t", keys="a b", properties={"TW_DUE_MS": "1", "x": "y"})
    producer = NativeProducer(f"test_same_{uuid.uuid4().hex[:6]}", rocketmq.namesrv_addr)
    with producer, RemotingProducer(rocketmq.namesrv_addr, "test_same") as p:
        native_id = producer.send(msg).msg_id
        [wire] = p.send_batch(topic, [msg])
    consumer, inbox = consume(rocketmq, [topic])
    try:
        got = {m.msg_id: m for m in inbox.wait(2)}
    finally:
        consumer.shutdown()
    native, ours = got[native_id], got[wire.msg_id]
    assert set(native.properties) == set(ours.properties)
    differ = {k for k in native.properties if native.properties[k] != ours.properties[k]}
    assert differ == {"UNIQ_KEY"}
    assert (ours.body, ours.tags, ours.keys) == (native.body, native.tags, native.keys)


def _cfg(mq: LocalRocketMQ, **kw: Any) -> RocketMQConfig:
    run = uuid.uuid4().hex[:8]
    return RocketMQConfig(namesrv=mq.namesrv_addr, producer_group=f"test_sink_{run}", dead_letter_topic=f"DLQ_{run}",
                          **kw)


@pytest.mark.rocketmq
def test_sink_sends_several_topics_in_one_call(rocketmq: LocalRocketMQ) -> None:
    topics = [_topic(f"MULTI{i}") for i in range(3)]
    rocketmq.create_topics(topics)
    due = int(time.time() * 1000)
    msgs = [Message(topics[i % 3], f"m{i}".encode(), due, f"t{i}", (f"k{i}",), {"i": str(i)}, f"{i:032X}")
            for i in range(300)]
    sink = RocketMQSink(_cfg(rocketmq), producer=None)  # type: ignore[arg-type]  # no dead letters here
    try:
        assert sink.send_batch(msgs) == [True] * 300
    finally:
        sink.close()
    assert sink.counters["sent"] == 300
    consumer, inbox = consume(rocketmq, topics)
    try:
        got = inbox.wait(300)
    finally:
        consumer.shutdown()
    assert sorted((m.topic, m.body) for m in got) == sorted((m.topic, m.body) for m in msgs)
    for m in got:
        i = int(m.body[1:])
        assert m.tags == f"t{i}" and m.keys == f"k{i}" and m.properties["i"] == str(i)
        assert m.properties["TW_ORIGINAL_MSG_ID"] == f"{i:032X}" and m.properties["TW_DUE_MS"] == str(due)
    assert len({m.msg_id for m in got}) == 300


@pytest.mark.rocketmq
def test_sink_sends_stored_records_in_batches_built_from_their_bytes(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    """`send_records`: one call of many rows (the column path) over two topics, and one of two rows
    (the scalar path); the broker stores each under the id derived from its record, with its answer."""
    import numpy as np

    from forwarder.contract import delivered_id
    from storage import Record, ScheduleStore

    topics = [_topic("REC0"), _topic("REC1")]
    rocketmq.create_topics(topics)
    due = int(time.time() * 1000) + 60_000
    recs = [Record(f"{i:032X}:ab", topics[i % 2], f"r{i}".encode() * (i % 5), due + i, tags=f"t{i}",
                   keys=(f"k{i}",) if i % 3 else (), properties={"p": "ü"} if i == 7 else {}) for i in range(80)]
    sink = RocketMQSink(_cfg(rocketmq), producer=None)  # type: ignore[arg-type]  # no dead letters here
    try:
        with ScheduleStore(tmp_path / "data") as store:
            locs = store.append(recs, due - 60_000).locations
            raw = store.read_record_bytes(locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16),
                                          locs["offset"].astype(np.uint32))
            many = sink.send_records(raw.select(np.arange(78)))
            few = sink.send_records(raw.select(np.arange(78, 80)), {"TW_LEASE_EPOCH": "3"})
    finally:
        sink.close()
    assert isinstance(many, SendResults) and isinstance(few, SendResults)
    assert list(many) == [True] * 78 and list(few) == [True] * 2
    assert many.answers is not None and few.answers is not None
    assert (many.answers["queue_offset"] >= 0).all() and (few.answers["queue_offset"] >= 0).all()
    # each topic's rows, as the cut grouped them, for the shaper's counts: every row once
    assert many.by_topic == {t: list(range(k, 78, 2)) for k, t in enumerate(topics)}
    assert few.by_topic == {topics[0]: [0], topics[1]: [1]}
    consumer, inbox = consume(rocketmq, topics)
    try:
        got = {m.msg_id: m for m in inbox.wait(80)}
    finally:
        consumer.shutdown()
    assert len(got) == 80
    for i, r in enumerate(recs):
        m = got[delivered_id(r.msg_id, r.due_ms)]
        assert (m.topic, m.body, m.tags, m.keys) == (r.topic, r.body, r.tags, " ".join(r.keys))
        assert m.properties["TW_ORIGINAL_MSG_ID"] == r.msg_id and m.properties["TW_DUE_MS"] == str(r.due_ms)
        assert m.properties.get("p") == ("ü" if i == 7 else None)
        assert m.properties.get("TW_LEASE_EPOCH") == ("3" if i >= 78 else None)


@pytest.mark.rocketmq
def test_a_topic_that_does_not_exist_is_created_by_a_broker_that_allows_it(rocketmq: LocalRocketMQ) -> None:
    """The local broker runs with autoCreateTopicEnable (the native client behaves the same way)."""
    topic = _topic("AUTO")
    with RemotingProducer(rocketmq.namesrv_addr, "test_auto", route_retry_s=0.2) as p:
        [first] = p.send_batch(topic, [OutgoingMessage(topic, b"first")])
        assert p.route(topic).via_default_topic
        deadline = time.monotonic() + 30
        while p.route(topic).via_default_topic and time.monotonic() < deadline:
            time.sleep(0.2)
        route = p.route(topic)
        assert not route.via_default_topic and len(route.queues) == 4, "the topic's own route once it exists"
        [second] = p.send_batch(topic, [OutgoingMessage(topic, b"second")])
    assert first.status == second.status == SendStatus.OK


@pytest.mark.rocketmq
@pytest.mark.slow
def test_broker_down_fails_the_batch_and_sending_resumes_after_restart(rocketmq: LocalRocketMQ) -> None:
    topic = _topic("RESTART")
    rocketmq.create_topics([topic], queues=4)
    sink = RocketMQSink(_cfg(rocketmq, breaker_failures=1000, send_timeout_ms=2000), producer=None,  # type: ignore[arg-type]
                        sender=RemotingProducer(rocketmq.namesrv_addr, "test_restart", timeout_ms=2000,
                                                route_ttl_s=1.0, route_retry_s=0.2, broker_backoff_s=0.2))
    due = int(time.time() * 1000)

    def batch(tag: str, n: int = 10) -> list[Message]:
        return [Message(topic, f"{tag}-{i}".encode(), due, tag) for i in range(n)]

    try:
        assert sink.send_batch(batch("before")) == [True] * 10
        old_route = sink.sender.route(topic)
        rocketmq.stop_broker(kill=True)
        try:
            assert sink.send_batch(batch("down")) == [False] * 10  # an answer, not an exception
            assert sink.counters["rejected"] == 0, "a broker that is down is a retriable failure"
            time.sleep(1.5)  # past the route's TTL: the NameServer has no route any more, the last one is kept
            assert sink.send_batch(batch("down")) == [False] * 10
        finally:
            rocketmq.start_broker()
        # After the restart the broker re-registers and the route grows: the sender picks both up.
        rocketmq.create_topics([topic], queues=8)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(sink.send_batch(batch("after"))):
            time.sleep(0.2)
        assert sink.send_batch(batch("after")) == [True] * 10
        while time.monotonic() < deadline and len(sink.sender.route(topic).queues) < 8:
            time.sleep(0.2)
        assert sink.sender.route(topic).fetched > old_route.fetched and len(sink.sender.route(topic).queues) == 8
        for _ in range(8):
            assert sink.send_batch(batch("spread", 2)) == [True] * 2
    finally:
        sink.close()
    consumer, inbox = consume(rocketmq, [topic])
    try:
        got = inbox.wait(10 + 20 + 16)
    finally:
        consumer.shutdown()
    assert {m.body for m in got if m.tags == "before"} == {f"before-{i}".encode() for i in range(10)}
    assert not [m for m in got if m.tags == "down"]
    assert {m.queue_id for m in got if m.tags == "spread"} == set(range(8)), "round robin over the new queues"


def test_a_fence_that_closes_before_the_write_sends_nothing(server: FakeServer) -> None:
    from forwarder.rocketmq import FencedError
    from forwarder.rocketmq.codec import encode_message

    with RemotingProducer(server.addr, "g") as p:
        ids = p.new_ids(3)
        encoded = [encode_message(m, i) for m, i in zip(_msgs("T", 3), ids)]
        asked: list[int] = []

        def closed() -> bool:
            asked.append(1)
            return False

        out = p.send_encoded(["T"] * 3, encoded, ids, fence=closed)
        assert asked and all(isinstance(o, FencedError) for o in out)
        assert server.batches() == [], "nothing reached the broker"
        assert p.send_encoded(["T"] * 3, encoded, ids, fence=lambda: True) == [None] * 3
    assert len(server.batches()) == 1


def test_the_fence_is_asked_once_the_request_is_encoded_right_before_the_write(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause between the fence's last look at the clock and the write lets a replica whose lease
    ran out write after its successor took over: the fence is asked last, once the request's bytes
    are ready (it was asked before the header was encoded), and a closed one writes nothing."""
    import forwarder.rocketmq.connection as connection
    from forwarder.rocketmq.codec import encode_message

    events: list[str] = []
    real_encode = connection.encode_request

    def encoding(*args: Any, **kwargs: Any) -> bytes:
        events.append("encode")
        return real_encode(*args, **kwargs)

    def fence(open_: bool) -> Callable[[], bool]:
        def asked() -> bool:
            events.append("fence")
            return open_
        return asked

    monkeypatch.setattr(connection, "encode_request", encoding)
    with RemotingProducer(server.addr, "g") as p:
        ids = p.new_ids(2)
        encoded = [encode_message(m, i) for m, i in zip(_msgs("T", 2), ids)]
        p.send_encoded(["T"] * 2, encoded, ids, fence=fence(True))
        assert "fence" in events and events[-1] == "fence", events
        assert events.count("encode") >= 1 and events.index("fence") > events.index("encode")
        events.clear()
        out = p.send_encoded(["T"] * 2, encoded, ids, fence=fence(False))
        assert events[-1] == "fence" and all(o is not None for o in out)
    assert len(server.batches()) == 1, "the fenced batch reached the broker"


def test_stored_records_go_through_the_sink_fenced_at_the_write_and_refused_per_row(server: FakeServer,
                                                                                   tmp_path: Path) -> None:
    """`RocketMQSink.send_records` on the one-pass batches: a closed fence sends nothing, an open one
    sends each row under its derived id (the fenced rows come back held); a row too large fails
    alone, a row for a topic that is no target is refused the general path's way."""
    import numpy as np

    from forwarder.contract import delivered_id
    from storage import Record, ScheduleStore

    recs = [Record(f"id-{i}", "T", b"x" * (5000 if i == 1 else 10), 1_800_000_000_000 + i, tags="t") for i in range(4)]
    sink = RocketMQSink(RocketMQConfig(namesrv=server.addr), None,  # type: ignore[arg-type]
                        sender=RemotingProducer(server.addr, "g", max_message_bytes=1000))
    try:
        with ScheduleStore(tmp_path / "data") as store:
            locs = store.append(recs + [Record("sys", "TW_DLQ", b"x", 1_800_000_000_009)], 1_800_000_000_000).locations
            raw = store.read_record_bytes(locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16),
                                          locs["offset"].astype(np.uint32))
        rows = raw.select(np.arange(4))
        held = sink.send_records(rows, fence=lambda: False)
        assert isinstance(held, SendResults) and list(held) == [False] * 4 and server.batches() == []
        assert held.errors is not None and "FencedError" in str(held.errors[0]) and "MessageRejected" in str(held.errors[1])
        # the rows the fence stopped are held (no attempt spent); the one refused before it, not
        assert held.held is not None and held.held.tolist() == [True, False, True, True]
        sent = sink.send_records(rows, fence=lambda: True)
        assert isinstance(sent, SendResults) and list(sent) == [True, False, True, True]
        assert sent.by_topic == {"T": [0, 2, 3, 1]}  # the row too large too: the cut's batches, then its refused
        [req] = server.batches()
        assert [p["UNIQ_KEY"] for _, p in decode_batch(req.body)] == [delivered_id(r.msg_id, r.due_ms)
                                                                      for r in recs if r.msg_id != "id-1"]
        # a row for the dead-letter topic: refused alone, the rest sent the general way
        assert list(sink.send_records(raw)) == [True, False, True, True, False]
        assert len(server.batches()) == 2
    finally:
        sink.close()
