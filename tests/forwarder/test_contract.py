"""The producer contract: parsing delay messages, and what the delivered message carries."""
from __future__ import annotations

import pytest

from forwarder.rocketmq import ReceivedMessage
from forwarder.contract import ContractLimits, ContractViolation, delivered_id, to_dead_letter, to_message, to_outgoing
from timewheel import Message

LIMITS = ContractLimits(max_delay_ms=3_600_000, max_body_bytes=1024)
NOW = 1_800_000_000_000


def received(props: dict[str, str], body: bytes = b"b", born: int = NOW) -> ReceivedMessage:
    return ReceivedMessage("TW_DELAY", body, "tg", "k1 k2", "ID1", props, 0, 0, 0, 0, born, born)


def test_passthrough_and_due_time() -> None:
    m = to_message(received({"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1500", "UNIQ_KEY": "ID1", "WAIT": "true",
                             "custom": "v"}), NOW + 10, LIMITS)
    assert (m.topic, m.deliver_at_ms, m.tags, tuple(m.keys)) == ("ORDERS", NOW + 1500, "tg", ("k1", "k2"))
    assert m.msg_id is not None and m.msg_id.startswith("ID1:")
    assert m.properties == {"custom": "v"}


def test_start_deliver_time_is_accepted() -> None:
    m = to_message(received({"TW_TARGET_TOPIC": "T", "__STARTDELIVERTIME": str(NOW + 5)}), NOW, LIMITS)
    assert m.deliver_at_ms == NOW + 5


@pytest.mark.parametrize("props,reason", [
    ({"TW_DELAY_MS": "1"}, "no TW_TARGET_TOPIC"),
    ({"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "1", "x": "\ufffd"}, "not valid UTF-8"),
    ({"TW_TARGET_TOPIC": "T", "TW_DELIVER_AT_MS": str(NOW + 2 * 3_600_000)}, "maximum delay"),
])
def test_violations(props: dict[str, str], reason: str) -> None:
    with pytest.raises(ContractViolation, match=reason):
        to_message(received(props), NOW, LIMITS)


def test_delivered_message_carries_original_id_and_due_time() -> None:
    out = to_outgoing(Message("ORDERS", b"b", NOW, "tg", ("k1",), {"a": "1"}, "ID1"))
    assert out.properties == {"a": "1", "TW_ORIGINAL_MSG_ID": "ID1", "TW_DUE_MS": str(NOW)}
    assert (out.topic, out.keys, out.tags) == ("ORDERS", "k1", "tg")


def test_outgoing_properties_cannot_smuggle_separators() -> None:
    from forwarder._rmq_library import _build

    with pytest.raises(ValueError, match="x01"):
        _build(to_outgoing(Message("ORDERS", b"b", NOW, properties={"a": "x\x02TW_TARGET_TOPIC\x01EVIL"},
                                   msg_id="i")))


def test_same_rocketmq_id_with_different_content_is_two_messages() -> None:
    """The client has been seen to reuse a UNIQ_KEY across threads: both messages must be kept."""
    a = to_message(received({"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "5"}, body=b"one"), NOW, LIMITS)
    b = to_message(received({"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "5"}, body=b"two"), NOW, LIMITS)
    again = to_message(received({"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "5"}, body=b"one"), NOW + 3, LIMITS)
    assert a.msg_id != b.msg_id and a.msg_id == again.msg_id


def test_an_id_with_a_nul_or_separators_is_read_up_to_the_nul() -> None:
    """The bundled producer has sent a UNIQ_KEY ending in a NUL: the id must still be deliverable."""
    props = {"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "0"}
    clean = to_message(ReceivedMessage("TW_DELAY", b"b", "", "", "0100007F00003683 ", props, 0, 0, 77, 0, NOW, NOW),
                       NOW, LIMITS)
    dirty = to_message(ReceivedMessage("TW_DELAY", b"b", "", "", "0100007F00003683 \x00junk", props, 0, 0, 77, 0,
                                       NOW, NOW), NOW, LIMITS)
    assert dirty.msg_id == clean.msg_id and "\x00" not in (dirty.msg_id or "")
    sep = to_message(ReceivedMessage("TW_DELAY", b"b", "", "", "\x01\x02", props, 0, 0, 77, 0, NOW, NOW), NOW, LIMITS)
    assert sep.msg_id is not None and sep.msg_id.startswith(f"{77:016X}:")
    from forwarder.rocketmq import encode_message
    encode_message(to_outgoing(dirty), "0" * 32)  # the broker would take it: no separator in TW_ORIGINAL_MSG_ID


def test_messages_differing_only_in_a_property_get_different_ids_under_one_uniq_key() -> None:
    """The client can give two messages one UNIQ_KEY: a property must still keep them apart."""
    def one(n: str) -> str | None:
        props = {"TW_TARGET_TOPIC": "T", "TW_DELIVER_AT_MS": str(NOW + 5), "order": n}
        return to_message(ReceivedMessage("TW_DELAY", b"same", "", "", "ID1", props, 0, 0, 0, 0, NOW, NOW),
                          NOW, LIMITS).msg_id
    assert one("1") != one("2") and one("1") == one("1")


RESERVED = ContractLimits(max_delay_ms=3_600_000, max_body_bytes=1024, reserved_topics=frozenset({"TW_DELAY", "TW_DLQ"}))


@pytest.mark.parametrize("target", ["%DLQ%orders-group", "%RETRY%orders-group", "RMQ_SYS_TRANS_HALF_TOPIC",
                                    "SCHEDULE_TOPIC_XXXX", "TW_DLQ", "TW_DELAY", "ORDERS\n", "ORDERS|x", "%SYS%x",
                                    "rmq_sys_wheel_timer", "TBW102", "ORD ERS", "ＯＲＤＥＲＳ"])
def test_targets_that_are_not_the_producers_to_write_are_refused(target: str) -> None:
    props = {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "1", "TW_DEAD_LETTER_REASON": "forged"}
    with pytest.raises(ContractViolation, match="TW_TARGET_TOPIC"):
        to_message(received(props), NOW, RESERVED)


def test_a_forged_dead_letter_reason_is_not_carried_to_the_target() -> None:
    m = to_message(received({"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1", "TW_DEAD_LETTER_REASON": "forged"}),
                   NOW, RESERVED)
    assert m.properties is None or "TW_DEAD_LETTER_REASON" not in m.properties


@pytest.mark.parametrize("value", ["１２３４", "١٢٣", "12\u00a0", "9" * 19, "-" + "9" * 19, "1e3", "0x10", ""])
@pytest.mark.parametrize("name", ["TW_DELIVER_AT_MS", "TW_DELAY_MS", "__STARTDELIVERTIME"])
def test_times_are_ascii_int64_milliseconds(name: str, value: str) -> None:
    with pytest.raises(ContractViolation, match="integer number of milliseconds|maximum delay|negative"):
        to_message(received({"TW_TARGET_TOPIC": "ORDERS", name: value}), NOW, RESERVED)


@pytest.mark.parametrize("tags,keys", [("t\x00g", "k"), ("tg", "k\x00"), ("t\x01", "k"), ("tg", "k\x02 k2")])
def test_separators_in_tags_or_keys_break_the_contract_and_still_make_a_sendable_dead_letter(tags: str,
                                                                                           keys: str) -> None:
    msg = ReceivedMessage("TW_DELAY", b"b", tags, keys, "ID1", {"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1"},
                          0, 0, 0, 0, NOW, NOW)
    with pytest.raises(ContractViolation, match="tags or keys") as e:
        to_message(msg, NOW, RESERVED)
    dead = to_dead_letter("TW_DLQ", msg.body, msg.tags, msg.keys, msg.properties, e.value.reason)
    carried = (dead.tags or "") + (dead.keys or "") + "".join(k + v for k, v in dead.properties.items())
    assert not any(c in carried for c in "\x00\x01\x02")
    assert dead.properties["TW_DEAD_LETTER_REASON"]


def test_the_delivery_sink_refuses_topics_that_are_not_targets_without_sending() -> None:
    from forwarder.config import RocketMQConfig
    from forwarder.delivery import RocketMQSink
    from forwarder.rocketmq import Receipt

    class Sender:
        def __init__(self) -> None:
            self.topics: list[str] = []
            self.ids: list[str] = []

        def send(self, outgoing: list, ids: list[str]) -> list:
            self.topics += [o.topic for o in outgoing]
            self.ids += ids
            return [Receipt.__new__(Receipt) for _ in outgoing]

        def new_ids(self, n: int) -> list[str]:
            return ["FRESH"] * n

    sender = Sender()
    sink = RocketMQSink(RocketMQConfig(), None, sender=sender)  # type: ignore[arg-type]
    msgs = [Message("ORDERS", b"a", NOW, msg_id="A:1"), Message("%RETRY%other-group", b"b", NOW),
            Message("TW_DLQ", b"c", NOW), Message("RMQ_SYS_TRANS_HALF_TOPIC", b"d", NOW), Message("PAYMENTS", b"e", NOW)]
    assert sink.send_batch(msgs) == [True, False, False, False, True]
    assert sender.topics == ["ORDERS", "PAYMENTS"]
    # a stored message goes under the id derived from its own; one without an id (scheduled in
    # process) under a fresh one
    assert sender.ids == [delivered_id("A:1", NOW), "FRESH"]


def test_a_dead_letter_topic_equal_to_the_delay_topic_is_refused() -> None:
    from forwarder.config import RocketMQConfig
    from timewheel.errors import ConfigError

    with pytest.raises(ConfigError, match="rocketmq.dead_letter_topic"):
        RocketMQConfig(delay_topic="TW_DELAY", dead_letter_topic="TW_DELAY")
    with pytest.raises(ConfigError, match="rocketmq.access_key"):
        RocketMQConfig(secret_key="s")


def _sendable(dead: object) -> bytes:
    """The dead letter as the engine's sender encodes it (raises if RocketMQ could not carry it)."""
    from forwarder.rocketmq import encode_message
    return encode_message(dead, "0" * 32)  # type: ignore[arg-type]


@pytest.mark.parametrize("props,keys", [
    pytest.param({"BIG": "x" * 32_600}, "k", id="no-target-and-a-32.6KB-property"),
    pytest.param({"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1", "A": "x" * 32_700}, "k",
                 id="a-property-at-the-limit"),
    pytest.param({"TW_CANCEL_KEY": "k" * 31_700}, "k", id="a-31.7KB-cancel-key"),
    pytest.param({"NO": "target"}, "k" * 32_760, id="huge-keys"),
])
def test_a_dead_letter_always_fits_rocketmqs_limits(props: dict[str, str], keys: str) -> None:
    msg = ReceivedMessage("TW_DELAY", b"b" * 10, "tg", keys, "ID1" * 20, props, 3, 77, 0, 0, NOW, NOW)
    dead = to_dead_letter("TW_DLQ", msg.body, msg.tags, msg.keys, msg.properties, "why " * 400,
                          msg_id=msg.msg_id, queue_id=msg.queue_id, queue_offset=msg.queue_offset)
    _sendable(dead)
    p = dead.properties
    assert p["TW_ORIGINAL_MSG_ID"] == msg.msg_id and p["TW_DEAD_LETTER_REASON"].startswith("why")
    assert (p["TW_RAW_QUEUE_ID"], p["TW_RAW_QUEUE_OFFSET"], p["TW_BODY_TRUNCATED"]) == ("3", "77", "false")
    assert "properties" in p["TW_DEAD_LETTER_MINIMAL"]


def test_a_dead_letter_that_fits_keeps_the_properties_and_says_nothing_was_dropped() -> None:
    dead = to_dead_letter("TW_DLQ", b"b", "tg", "k", {"A": "1"}, "why", msg_id="ID1", queue_id=1, queue_offset=2)
    assert dead.properties["A"] == "1" and "TW_DEAD_LETTER_MINIMAL" not in dead.properties
    assert dead.keys == "k" and dead.tags == "tg"


def test_a_minimal_dead_letter_says_its_body_was_truncated() -> None:
    from forwarder.contract import DEAD_LETTER_MAX_BODY
    body = b"x" * (DEAD_LETTER_MAX_BODY + 5)
    dead = to_dead_letter("TW_DLQ", body, None, None, {"A": "x" * 32_760}, "why", msg_id="ID1")
    _sendable(dead)
    assert dead.properties["TW_BODY_TRUNCATED"] == "true"
    assert dead.properties["TW_TRUNCATED_FROM"] == str(len(body)) and len(dead.body) == DEAD_LETTER_MAX_BODY


@pytest.mark.parametrize("extra,keys", [
    pytest.param({"A": "x" * 32_700}, "k", id="properties-that-grow-past-the-limit-at-delivery"),
    pytest.param({}, "k" * 32_740, id="keys-that-grow-past-the-limit-at-delivery"),
])
def test_ingest_refuses_what_delivery_could_not_send(extra: dict[str, str], keys: str) -> None:
    msg = ReceivedMessage("TW_DELAY", b"b", "tg", keys, "ID1", {"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1",
                                                               **extra}, 0, 0, 0, 0, NOW, NOW)
    with pytest.raises(ContractViolation, match="32767"):
        to_message(msg, NOW, LIMITS)


def test_what_ingest_accepts_delivery_can_send_at_the_edge() -> None:
    from forwarder.contract import DELIVERY_PROPERTIES_BUDGET
    from forwarder.rocketmq import encode_message
    base = {"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1"}
    lo, hi = 0, 40_000  # the longest property value ingest accepts: delivery must send it with the stamps added
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            to_message(received({**base, "A": "x" * mid}), NOW, LIMITS)
            lo = mid
        except ContractViolation:
            hi = mid - 1
    m = to_message(received({**base, "A": "x" * lo}), NOW, LIMITS)
    out = to_outgoing(m)
    out.properties["TW_LEASE_EPOCH"] = str((1 << 63) - 1)  # type: ignore[index]  # a replica's stamp
    encode_message(out, "F" * 32)
    assert lo > 32_000 and DELIVERY_PROPERTIES_BUDGET < 32_767


@pytest.mark.parametrize("topic", ["%DLQ%orders", "%RETRY%group", "SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC",
                                   "TW_DELAY", "TW_DLQ"])
def test_replay_refuses_system_and_engine_topics_before_sending(topic: str) -> None:
    from forwarder.config import RocketMQConfig
    from forwarder.replay_sender import replay_sender_for

    sender = replay_sender_for(RocketMQConfig(namesrv="127.0.0.1:1"), "replay-test")()
    try:
        with pytest.raises(ContractViolation):  # refused here: nothing is connected to (port 1 is closed)
            sender.send(topic, b"b", None, [], {})
    finally:
        sender.close()


def test_a_producers_resend_of_a_delay_message_keeps_its_id() -> None:
    # A client's retry sends the same message (its UNIQ_KEY) born again: the id must not move with the
    # due time it makes, or the retry is stored and delivered a second time.
    props = {"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "5000"}
    first = to_message(received(props), NOW + 10, LIMITS)
    again = to_message(received(props, born=NOW + 400), NOW + 410, LIMITS)
    assert first.msg_id == again.msg_id
    assert (first.deliver_at_ms, again.deliver_at_ms) == (NOW + 5000, NOW + 5400)
    longer = to_message(received({**props, "TW_DELAY_MS": "5001"}), NOW + 10, LIMITS)
    assert longer.msg_id != first.msg_id, "another delay is another message"
    # a due time asked for as such stays in the id: the same instant by either name is one message
    at = to_message(received({"TW_TARGET_TOPIC": "T", "TW_DELIVER_AT_MS": str(NOW + 5000)}), NOW, LIMITS)
    assert at.msg_id != first.msg_id


def test_a_delay_message_without_a_born_time_counts_from_its_store_time() -> None:
    # Every pull (and every replica) reads the broker's store time alike; "now" would differ on each.
    m = ReceivedMessage("TW_DELAY", b"b", "", "", "ID1", {"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "100"},
                        0, 0, 0, 0, 0, NOW - 50)
    assert to_message(m, NOW, LIMITS).deliver_at_ms == NOW + 50
    assert to_message(m, NOW + 999, LIMITS).deliver_at_ms == NOW + 50
    neither = ReceivedMessage("TW_DELAY", b"b", "", "", "ID1", {"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "100"},
                              0, 0, 0, 0, -1, 0)
    assert to_message(neither, NOW, LIMITS).deliver_at_ms == NOW + 100
