"""Control messages on the delay topic: recognised, checked, applied before the batch is acknowledged,
never scheduled, dead-lettered with a reason when malformed."""
from __future__ import annotations

from typing import Any, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits, ContractViolation
from forwarder.control import CANCEL_ID, CANCEL_KEY, CONTROL_TAG, cancel_message, split_control, to_cancel
from forwarder.ingest import DelayTopicIngest
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, encode_message
from timewheel import Message
from timewheel.cancels import CancelRequest

NOW = 1_800_000_000_000


def received(props: dict[str, str], *, born: int = NOW - 10, body: bytes = b"", keys: str = "") -> ReceivedMessage:
    return ReceivedMessage("TW_DELAY", body, "", keys, "0A0000010000000000000000000000AB", dict(props), 0, 0, 0, 0,
                           born, NOW)


@pytest.mark.parametrize("props,want", [
    ({CANCEL_ID: "7F0000010A2B18B4AAC2" + "0" * 12}, CancelRequest("7F0000010A2B18B4AAC2" + "0" * 12, None, NOW - 10)),
    ({CANCEL_ID: "ABC:0badc0de"}, CancelRequest("ABC:0badc0de", None, NOW - 10)),
    ({CANCEL_KEY: " order-17 "}, CancelRequest(None, "order-17", NOW - 10)),
    ({CANCEL_KEY: "订单-1", "note": "x"}, CancelRequest(None, "订单-1", NOW - 10)),
])
def test_a_cancel_is_read_from_its_properties(props: dict[str, str], want: CancelRequest) -> None:
    assert to_cancel(received(props), NOW) == want


def test_a_cancel_without_a_born_time_counts_as_sent_now() -> None:
    assert to_cancel(received({CANCEL_KEY: "k"}, born=0), NOW).born_ms == NOW


@pytest.mark.parametrize("props,reason", [
    ({CANCEL_ID: "a", CANCEL_KEY: "b"}, "exactly one"),
    ({CANCEL_ID: "  "}, "non-empty"),
    ({CANCEL_KEY: "a\x01b"}, "no message can carry it"),
    ({CANCEL_KEY: "bad\ufffd"}, "not UTF-8"),
    ({CANCEL_ID: "x" * 70_000}, "at most"),
    ({CANCEL_ID: "a", "TW_TARGET_TOPIC": "ORDERS"}, "carries no TW_TARGET_TOPIC"),
])
def test_a_malformed_cancel_is_a_contract_violation(props: dict[str, str], reason: str) -> None:
    with pytest.raises(ContractViolation, match=reason):
        to_cancel(received(props), NOW)


_props = st.dictionaries(st.sampled_from(["TW_TARGET_TOPIC", "TW_DELAY_MS", CANCEL_ID, CANCEL_KEY, "a"]),
                         st.text(max_size=3), max_size=4)


@given(st.lists(_props, max_size=10))
def test_split_keeps_order_and_loses_nothing(batch_props: list[dict[str, str]]) -> None:
    batch = [received(p, born=i + 1) for i, p in enumerate(batch_props)]
    delay, control = split_control(batch)
    assert [m.born_timestamp for m in delay] == [m.born_timestamp for m in batch
                                                 if CANCEL_ID not in m.properties and CANCEL_KEY not in m.properties]
    assert sorted(m.born_timestamp for m in delay + control) == [m.born_timestamp for m in batch]


_text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30).filter(
    lambda t: t.strip(" ") == t and "\ufffd" not in t)


@given(st.one_of(st.tuples(_text, st.none()), st.tuples(st.none(), _text.filter(lambda t: " " not in t))))
def test_what_cancel_message_sends_reads_back_as_the_same_cancel(named: tuple[str | None, str | None]) -> None:
    msg_id, key = named
    out = cancel_message("TW_DELAY", msg_id, key)
    assert out.topic == "TW_DELAY" and out.tags == CONTROL_TAG and "TW_TARGET_TOPIC" not in out.properties
    encode_message(out, "0A" * 16)  # RocketMQ can carry it
    assert to_cancel(received(dict(out.properties)), NOW) == CancelRequest(msg_id, key, NOW - 10)


class _Sched:
    def __init__(self) -> None:
        self.stored: list[Message] = []
        self.cancels: list[CancelRequest] = []
        self.events: list[str] = []

    def schedule(self, messages: Sequence[Message], origins: object = None) -> list[str]:
        self.stored.extend(messages)
        self.events.append("schedule")
        return [m.msg_id or "" for m in messages]

    def cancel(self, requests: Sequence[CancelRequest]) -> int:
        self.cancels.extend(requests)
        self.events.append("cancel")
        return 0


class _Dlq:
    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []

    def send_batch(self, topic: str, messages: list[OutgoingMessage]) -> list[Any]:
        self.sent.extend(messages)
        return []


def _ingest(sched: _Sched) -> tuple[DelayTopicIngest, _Dlq]:
    dlq = _Dlq()
    ing = DelayTopicIngest(RocketMQConfig(namesrv="127.0.0.1:1"), ContractLimits(10**9, 1 << 20), lambda: NOW,
                           dlq)  # type: ignore[arg-type]
    ing._schedule, ing._cancel = sched.schedule, sched.cancel
    ing._accepting.set()
    return ing, dlq


def test_ingest_applies_cancels_first_and_schedules_only_delay_messages() -> None:
    sched = _Sched()
    ing, dlq = _ingest(sched)
    batch = [received({"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1000"}, body=b"m"),
             received({CANCEL_ID: "X"}), received({CANCEL_KEY: "k", CANCEL_ID: "y"}), received({CANCEL_KEY: "k"})]
    assert ing._on_batch(batch) is True
    assert [m.body for m in sched.stored] == [b"m"]
    assert sched.cancels == [CancelRequest("X", None, NOW - 10), CancelRequest(None, "k", NOW - 10)]
    assert sched.events == ["cancel", "schedule"]
    [dl] = dlq.sent
    assert "exactly one" in dl.properties["TW_DEAD_LETTER_REASON"]
    assert ing.counters["cancels_received"] == 2 and ing.counters["dead_lettered"] == 1


def test_a_failed_cancel_hands_the_batch_back() -> None:
    sched = _Sched()

    def broken(requests: Sequence[CancelRequest]) -> int:
        raise OSError("disk full")

    ing, _ = _ingest(sched)
    ing._cancel = broken
    assert ing._on_batch([received({CANCEL_ID: "X"}), received({"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "1"})]) is False
    assert sched.stored == [] and ing.counters["cancels_received"] == 0


@pytest.mark.parametrize("text", ["k", " k ", "k\tx", "tab\t", "\tlead", "a b", "", "   ", "x\x01y", "x\x00",
                                  "bad\ufffd", "ü-key", "k" * 70_000])
@pytest.mark.parametrize("kind", ["id", "key"])
def test_every_cancel_path_agrees_on_what_a_cancel_names(text: str, kind: str) -> None:
    """The topic's cancel path (a control message), the admin's (a CancelRequest, then the control
    message it sends) accept the same texts and name the same thing; ingest takes such a key."""
    from forwarder.control import CANCEL_ID, CANCEL_KEY, cancel_message, to_cancel
    from forwarder.rocketmq import ReceivedMessage
    from timewheel.cancels import CancelRequest

    name = CANCEL_ID if kind == "id" else CANCEL_KEY
    outcomes = []
    try:
        got = to_cancel(ReceivedMessage("TW_DELAY", b"", "", "", "C1", {name: text}, 0, 0, 0, 0, 1, 1), 1)
        outcomes.append(got.msg_id if kind == "id" else got.key)
    except ContractViolation:
        outcomes.append(None)
    try:
        req = CancelRequest(text, None, 1) if kind == "id" else CancelRequest(None, text, 1)
        outcomes.append(req.msg_id if kind == "id" else req.key)
        sent = cancel_message("TW_DELAY", req.msg_id, req.key)
        assert sent.properties[name] == outcomes[-1]
    except ValueError:
        outcomes.append(None)
    assert outcomes[0] == outcomes[1], outcomes
    if kind == "key" and outcomes[0] is not None:  # a message carrying that key is one ingest accepts
        from forwarder.contract import ContractLimits, to_message
        m = to_message(ReceivedMessage("TW_DELAY", b"b", "", f"other {outcomes[0]}", "M1",
                                       {"TW_TARGET_TOPIC": "T", "TW_DELAY_MS": "5"}, 0, 0, 0, 0, 1, 1), 1,
                       ContractLimits(3_600_000, 1024))
        assert outcomes[0] in m.keys
