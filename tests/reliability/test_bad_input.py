"""A corpus of malformed delay messages through the real broker: each is dead-lettered with its
reason, none reaches a target topic, and the engine keeps delivering good messages."""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.errors import SendError
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.config import RocketMQConfig
from timewheel.config import EngineConfig
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from tests.polling import wait_for
from tests.stored_copies import StoredCopies

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]
HOUR = 3_600_000


def _raw_send(producer: NativeProducer, topic: str, body: bytes, props: dict[bytes, bytes]) -> str | None:
    """Send with property bytes exactly as given (invalid UTF-8, separators): what a buggy or
    hostile producer can put on the wire. None if the client or the broker refuses it on the way in:
    then it can never reach the engine."""
    try:
        return producer.send_unchecked(topic, body, props).msg_id
    except SendError:
        return None


def corpus(target: str, now: int) -> list[tuple[str, dict[str, str], bytes, str]]:
    """(case, properties, body, expected reason fragment): at least 20 ways to break the contract."""
    t = {"TW_TARGET_TOPIC": target}
    later = str(now + 5000)
    return [
        ("no target", {"TW_DELAY_MS": "1000"}, b"x", "no TW_TARGET_TOPIC"),
        ("blank target", {"TW_TARGET_TOPIC": "  ", "TW_DELAY_MS": "1"}, b"x", "no TW_TARGET_TOPIC"),
        ("target with a space", {"TW_TARGET_TOPIC": "A B", "TW_DELAY_MS": "1"}, b"x", "not a valid topic"),
        ("target with a slash", {"TW_TARGET_TOPIC": "a/b", "TW_DELAY_MS": "1"}, b"x", "not a valid topic"),
        ("target too long", {"TW_TARGET_TOPIC": "T" * 200, "TW_DELAY_MS": "1"}, b"x", "not a valid topic"),
        ("target with unicode", {"TW_TARGET_TOPIC": "ORDÉRS", "TW_DELAY_MS": "1"}, b"x", "not a valid topic"),
        ("no due time", dict(t), b"x", "no due time"),
        ("deliver-at words", {**t, "TW_DELIVER_AT_MS": "tomorrow"}, b"x", "not an integer"),
        ("deliver-at float", {**t, "TW_DELIVER_AT_MS": "1.7e12"}, b"x", "not an integer"),
        ("deliver-at ISO", {**t, "TW_DELIVER_AT_MS": "2027-01-01T00:00:00Z"}, b"x", "not an integer"),
        ("deliver-at negative", {**t, "TW_DELIVER_AT_MS": "-5"}, b"x", "negative"),
        ("deliver-at overflow", {**t, "TW_DELIVER_AT_MS": "9" * 25}, b"x", "not an integer"),
        ("deliver-at past max", {**t, "TW_DELIVER_AT_MS": str(now + 5 * HOUR)}, b"x", "maximum delay"),
        ("delay words", {**t, "TW_DELAY_MS": "five minutes"}, b"x", "not an integer"),
        ("delay negative", {**t, "TW_DELAY_MS": "-1000"}, b"x", "negative"),
        ("delay past max", {**t, "TW_DELAY_MS": str(5 * HOUR)}, b"x", "maximum delay"),
        ("delay hex", {**t, "TW_DELAY_MS": "0x10"}, b"x", "not an integer"),
        ("startdelivertime words", {**t, "__STARTDELIVERTIME": "soon"}, b"x", "not an integer"),
        ("startdelivertime past max", {**t, "__STARTDELIVERTIME": str(now + 9 * HOUR)}, b"x", "maximum delay"),
        ("huge body", {**t, "TW_DELIVER_AT_MS": later}, b"B" * (70 * 1024), "exceeds the maximum"),
        ("empty delay", {**t, "TW_DELAY_MS": ""}, b"x", "no due time"),  # empty values are dropped on the wire
    ]


@pytest.fixture(scope="module")
def pipeline(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}", dead_letter_topic=f"TW_DLQ_{run}",
                         consumer_group=f"tw_ingest_{run}", producer_group=f"tw_delivery_{run}")
    target, evil = f"GOOD_{run}", f"EVIL_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target, evil])
    got: list[ReceivedMessage] = []
    lock = threading.Lock()

    def inbox(m: ReceivedMessage) -> bool:
        with lock:
            got.append(m)
        return True

    consumer = NativePushConsumer(f"bad_input_{run}", rocketmq.namesrv_addr, inbox)
    for topic in (target, evil, cfg.dead_letter_topic):
        consumer.subscribe(topic)
    consumer.start()
    service = Service(Settings(engine=EngineConfig(tmp_path_factory.mktemp("bad"), max_delay_ms=2 * HOUR,
                                                   max_body_bytes=64 * 1024),
                               rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0"))).start()
    # its own client instance: the clients of one instance share connections, and a hostile send the
    # broker refuses stalled the consumer above for about 20 s
    producer = NativeProducer(f"bad_producer_{run}", rocketmq.namesrv_addr, instance_name=f"bad_input_{run}")
    producer.start()
    yield cfg, target, evil, producer, got, lock, service
    producer.shutdown()
    service.stop()
    consumer.shutdown()


def test_corpus_is_dead_lettered_with_reasons_and_good_messages_still_flow(pipeline: tuple) -> None:
    cfg, target, evil, producer, got, lock, service = pipeline
    now = time.time_ns() // 1_000_000
    cases = corpus(target, now)
    assert len(cases) >= 20
    expected: dict[str, tuple[str, str]] = {}
    for case, props, body, reason in cases:
        res = producer.send(OutgoingMessage(cfg.delay_topic, body, None, None, props))
        expected[res.msg_id] = (case, reason)
    # bytes the typed client refuses to build: invalid UTF-8, and separators that try to redirect
    bad_utf8 = _raw_send(producer, cfg.delay_topic, b"x", {b"TW_TARGET_TOPIC": target.encode(),
                                                            b"TW_DELAY_MS": b"1", b"note": b"\xff\xfe\xfd"})
    if bad_utf8 is not None:  # this client and broker refuse it on the way in; if one day they
        expected[bad_utf8] = ("invalid UTF-8 property", "not valid UTF-8")  # do not, it is dead-lettered
    inject = _raw_send(producer, cfg.delay_topic, b"inject", {
        b"TW_TARGET_TOPIC": target.encode(), b"TW_DELAY_MS": b"1",
        b"note": b"x\x02TW_TARGET_TOPIC\x01" + evil.encode()})
    good = producer.send(OutgoingMessage(cfg.delay_topic, b"good-after-bad", None, None,
                                         {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "500"}))

    def dead() -> dict[str, ReceivedMessage]:
        with lock:
            return {m.properties.get("TW_ORIGINAL_MSG_ID", ""): m for m in got if m.topic == cfg.dead_letter_topic}

    assert wait_for(lambda: set(expected) <= set(dead()), 90), \
        f"not dead-lettered: {[expected[k][0] for k in set(expected) - set(dead())]}"
    for msg_id, (case, reason) in expected.items():
        assert reason in dead()[msg_id].properties["TW_DEAD_LETTER_REASON"], case
    assert wait_for(lambda: any(m.body == b"good-after-bad" and m.topic == target for m in list(got)), 60)
    time.sleep(2)
    with lock:
        on_evil = [m for m in got if m.topic == evil]
        on_target = [m.properties.get("TW_ORIGINAL_MSG_ID", "").split(":")[0] for m in got if m.topic == target]
    assert not set(expected) & set(on_target), "nothing malformed reaches a target topic"
    assert good.msg_id in on_target
    # Separator bytes inside a property value are, in RocketMQ's property encoding, the same bytes
    # as a second TW_TARGET_TOPIC property: the broker stores the message with that target, and
    # the engine follows what the broker stored, once. What it guarantees is its own side: the
    # message it delivers cannot be redirected or re-delayed by property content (outgoing
    # properties with separator bytes are refused), and the message goes to one topic only.
    # once = one copy stored there; the test's push consumer may hand a stored copy over twice
    on_evil_copies: StoredCopies[str] = StoredCopies()
    for m in on_evil:
        on_evil_copies.add(m.properties.get("TW_ORIGINAL_MSG_ID", "").split(":")[0], m)
    evil_ids = sorted(on_evil_copies.keys())
    assert evil_ids in ([], [inject]) and not on_evil_copies.duplicates(), \
        f"only the injected message, once: {evil_ids} {on_evil_copies.described()}"
    assert (inject in on_target) + (inject in evil_ids) + (inject in dead()) <= 1
    ingest = service.stats()["ingest"]
    assert isinstance(ingest, dict)
    # a body too large once inflated is parked raw (never inflated past the limit), the rest by the contract
    assert ingest["dead_lettered"] + ingest["dead_lettered_raw"] >= len(expected)
