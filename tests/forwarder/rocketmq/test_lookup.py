"""Look-ups by UNIQ_KEY without a broker: the delivered copies' derived ids, and the answers of
QUERY_MESSAGE read into exact matches, "missing" and "unknown"."""
from __future__ import annotations

import calendar
import re
import time

import pytest
from hypothesis import given, strategies as st

from forwarder.contract import delivered_id
from forwarder.rocketmq import KeyLookup, LookupState, MessageLookup, ProtocolError, UNIQ_KEY
from forwarder.rocketmq.codec import derived_id
from forwarder.rocketmq.errors import BrokerUnavailableError, ConnectionFailedError, TopicNotFoundError
from forwarder.rocketmq.lookup import MAX_ROUTES, UNIQUE_KEY_QUERY_MAX, answer_copies, query_broker
from forwarder.rocketmq.protocol import QUERY_NOT_FOUND, SUCCESS, SYSTEM_ERROR
from tests.forwarder.rocketmq.test_codec import stored

DUE = 1_800_000_000_000
HEX32 = re.compile(r"[0-9A-F]{32}")


def nearly_time(uniq: str, now_ms: int, zone_offset_ms: int) -> int:
    """What RocketMQ's MessageClientIDSetter.getNearlyTimeFromID gives for `uniq`, read at `now_ms`
    on a host `zone_offset_ms` ahead of UTC (its month starts that much before UTC's)."""
    span = int(uniq[20:28], 16)
    local = time.gmtime((now_ms + zone_offset_ms) // 1000)
    month_start = calendar.timegm((local.tm_year, local.tm_mon, 1, 0, 0, 0)) * 1000 - zone_offset_ms
    if month_start + span >= now_ms:
        y, m = (local.tm_year - 1, 12) if local.tm_mon == 1 else (local.tm_year, local.tm_mon - 1)
        month_start = calendar.timegm((y, m, 1, 0, 0, 0)) * 1000 - zone_offset_ms
    return month_start + span


@given(st.text(min_size=1, max_size=80), st.integers(1_000_000_000_000, 4_000_000_000_000))
def test_a_delivered_id_is_32_upper_hex_digits_and_a_function_of_id_and_due_alone(original: str, due: int) -> None:
    uniq = delivered_id(original, due)
    assert HEX32.fullmatch(uniq)
    assert uniq == delivered_id(original, due)  # no clock, host, pid or counter in it


def test_delivered_ids_differ_between_messages() -> None:
    ids = {delivered_id(f"{i:032X}:{i * 7919 & 0xFFFFFFFF:08x}", DUE) for i in range(100_000)}
    assert len(ids) == 100_000
    assert delivered_id("A:1", DUE) != delivered_id("A:2", DUE)


def test_a_delivered_id_is_pinned() -> None:
    # a replica of another version must derive the same id: the derivation may never drift
    assert delivered_id("7F00000100012A9F0000000000000001:0badcafe", DUE) == derived_id(
        b"7F00000100012A9F0000000000000001:0badcafe", DUE)
    assert delivered_id("7F00000100012A9F0000000000000001:0badcafe", DUE) == "B2999F06BC15F9441446473D4E00E71E"


@pytest.mark.parametrize("zone_h", [-12, -5, 0, 1, 8, 14])
@pytest.mark.parametrize("late_ms", [1, 1000, 3_600_000, 20 * 86_400_000])
def test_rocketmq_tools_search_from_before_the_due_time_in_every_time_zone(zone_h: int, late_ms: int) -> None:
    # mqadmin queryMsgByUniqueKey searches from getNearlyTimeFromID(id) - 1 s: it must not start after the send
    for due in (DUE, calendar.timegm((2027, 3, 1, 0, 0, 0)) * 1000, calendar.timegm((2027, 3, 31, 23, 0, 0)) * 1000):
        uniq = delivered_id("some:id", due)
        decoded = nearly_time(uniq, due + late_ms, zone_h * 3_600_000)
        assert decoded - 1000 <= due
        assert due - decoded <= 26 * 3_600_000  # and not a month early


def answer(*messages: tuple[str, str]) -> bytes:
    """A QUERY_MESSAGE body of stored messages (topic, UNIQ_KEY)."""
    return b"".join(stored(b"x", t, {UNIQ_KEY: k} if k else {}, queue_offset=i) for i, (t, k) in enumerate(messages))


def test_only_an_exact_topic_and_uniq_key_match_counts() -> None:
    key = "A" * 31 + "1"
    body = answer(("T", "0" * 32), ("OTHER", key), ("T", key.lower()), ("T", ""), ("T", key), ("T", key))
    got = answer_copies(SUCCESS, None, body, "T", key, "b1")
    assert isinstance(got, list)
    assert [c.queue_offset for c in got] == [4, 5]  # both copies: a duplicate shows as two
    assert {c.broker for c in got} == {"b1"}


def test_not_found_is_no_copy_and_an_error_code_is_an_error() -> None:
    assert answer_copies(QUERY_NOT_FOUND, "can not find message", b"", "T", "K", "b1") == []
    assert isinstance(answer_copies(SYSTEM_ERROR, "boom", b"", "T", "K", "b1"), BrokerUnavailableError)
    assert isinstance(answer_copies(SUCCESS, None, b"\x00\x00\x00\x10garbage", "T", "K", "b1"), ProtocolError)


def test_an_answer_full_of_other_messages_cannot_say_missing() -> None:
    full = answer(*[("T", f"{i:032X}") for i in range(UNIQUE_KEY_QUERY_MAX)])
    assert isinstance(answer_copies(SUCCESS, None, full, "T", "F" * 32, "b1"), ProtocolError)
    assert answer_copies(SUCCESS, None, full[:-1] and answer(("T", "1" * 32)), "T", "F" * 32, "b1") == []


def test_states() -> None:
    assert KeyLookup("k").state is LookupState.MISSING
    assert KeyLookup("k", errors=("b2 down",)).state is LookupState.UNKNOWN
    found = answer_copies(SUCCESS, None, answer(("T", "k")), "T", "k", "b1")
    assert isinstance(found, list)
    assert KeyLookup("k", tuple(found), ("b2 down",)).state is LookupState.FOUND


def test_a_window_from_0_or_backwards_is_refused() -> None:
    with MessageLookup("127.0.0.1:1") as lookup:
        with pytest.raises(ValueError):
            lookup.lookup("T", ["k"], 0, DUE)
        with pytest.raises(ValueError):
            lookup.lookup("T", ["k"], DUE, DUE - 1)


def test_an_unreachable_nameserver_leaves_every_key_unknown() -> None:
    with MessageLookup("127.0.0.1:1", timeout_ms=500) as lookup:
        got = lookup.lookup("T", ["a", "b", "a"], DUE - 2000, DUE)
    assert list(got) == ["a", "b"]
    assert all(r.state is LookupState.UNKNOWN and "ConnectionFailedError" in r.errors[0] for r in got.values())


class _DeadConnection:
    def submit(self, requests: object, deadline: float) -> list[int]:
        raise ConnectionFailedError("connection reset")


def test_a_broker_failing_mid_query_leaves_the_rest_unknown() -> None:
    got = query_broker(_DeadConnection(), "b1", "T", ["a", "b"], DUE - 2000, DUE, time.monotonic() + 1)  # type: ignore[arg-type]
    assert all(isinstance(v, ConnectionFailedError) for v in got.values())


def test_a_route_naming_no_broker_leaves_every_key_unknown_never_missing() -> None:
    with MessageLookup("127.0.0.1:1", timeout_ms=500) as lookup:
        lookup._namesrv.route_document = lambda topic: {"queueDatas": [], "brokerDatas": []}  # type: ignore[method-assign]
        with pytest.raises(TopicNotFoundError):
            lookup.brokers("T")
        got = lookup.lookup("T", ["a"], DUE - 2000, DUE)
    assert got["a"].state is LookupState.UNKNOWN and "TopicNotFoundError" in got["a"].errors[0]


def _one_broker_route(topic: str) -> dict[str, object]:
    """A route of one broker holding 4 queues of `topic`."""
    return {"brokerDatas": [{"brokerName": "broker-a", "brokerAddrs": {"0": "127.0.0.1:10911"}}],
            "queueDatas": [{"brokerName": "broker-a", "perm": 6, "writeQueueNums": 4, "readQueueNums": 4}]}


def test_the_route_table_holds_the_topics_in_use_not_every_topic_ever_looked_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    asked: list[str] = []

    def route(topic: str) -> dict[str, object]:
        asked.append(topic)
        return _one_broker_route(topic)

    with MessageLookup("127.0.0.1:1", route_ttl_s=30.0) as lookup:
        lookup._namesrv.route_document = route  # type: ignore[method-assign]
        for i in range(100_000):
            lookup.brokers(f"REPLY_{i:06d}")
            if i % 1000 == 0:
                lookup.brokers("ORDERS")
        assert asked.count("ORDERS") == 1  # in use all along, within its ttl: looked up once
        assert len(lookup._routes) <= MAX_ROUTES
        clock[0] += 30.0  # every route expired: the next look-up lets them go
        lookup.brokers("ORDERS")
        assert list(lookup._routes) == ["ORDERS"]
