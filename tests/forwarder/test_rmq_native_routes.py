"""The native producer's sync send when the client says "No route info": tried again, then a clear error.

The client gives up on a topic's route when the NameServer answers slowly (a loaded machine). It says
"No route info" also when each of its own tries failed: an attempt that took the send timeout may have
been stored, and is not tried again; nor is anything else it reports.
"""
from __future__ import annotations

import socket
import time

import pytest

from forwarder import _rmq_library, _rmq_native
from forwarder._rmq_native import NO_ROUTE_BACKOFF_S, NO_ROUTE_RETRIES, LogLevel, NativeProducer
from forwarder.errors import SendError
from forwarder.rocketmq import OutgoingMessage


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_without_a_name_server_a_send_is_tried_again_then_fails_saying_so() -> None:
    producer = NativeProducer("tw_no_route", f"127.0.0.1:{_closed_port()}", log_level=LogLevel.ERROR)
    producer.start()
    try:
        start = time.monotonic()
        with pytest.raises(SendError) as info:
            producer.send(OutgoingMessage("NOWHERE", b"x"))
        took = time.monotonic() - start
    finally:
        producer.shutdown()
    # the real client's words are the ones the retry looks for
    assert f"tried {NO_ROUTE_RETRIES + 1} times" in str(info.value) and "No route info" in str(info.value)
    assert info.value.retriable
    assert took >= NO_ROUTE_BACKOFF_S * NO_ROUTE_RETRIES * (NO_ROUTE_RETRIES + 1) / 2


_NO_ROUTE_DETAIL = "msg: No route info of this topic: T,error:-1"


def _client_refusing(monkeypatch: pytest.MonkeyPatch, refusals: int, detail: str = _NO_ROUTE_DETAIL,
                     each_s: float = 0.0) -> list[int]:
    """The client's sync send refuses `refusals` times with `detail`, each after `each_s`, then stores
    ("stored"); the retry does not wait. Returns the list that grows by one a call."""
    calls: list[int] = []

    def send_sync(handle: int, msg: int, result: object) -> int:
        calls.append(1)
        time.sleep(each_s)
        return 0 if len(calls) > refusals else 1

    monkeypatch.setattr(_rmq_native, "_SendMessageSync", send_sync)
    monkeypatch.setattr(_rmq_native, "_last_error", lambda: detail)
    monkeypatch.setattr(_rmq_native, "_result", lambda result: "stored")
    monkeypatch.setattr(_rmq_native, "NO_ROUTE_BACKOFF_S", 0.0)
    return calls


@pytest.mark.parametrize("refusals, sent", [(1, True), (NO_ROUTE_RETRIES, True), (NO_ROUTE_RETRIES + 1, False)])
def test_a_route_that_appears_within_the_retries_gets_the_message_sent(
        monkeypatch: pytest.MonkeyPatch, refusals: int, sent: bool) -> None:
    calls = _client_refusing(monkeypatch, refusals)
    producer = NativeProducer("tw_route_later", f"127.0.0.1:{_closed_port()}", log_level=LogLevel.ERROR)
    try:
        if sent:
            assert producer.send(OutgoingMessage("T", b"x")) == "stored"
        else:
            with pytest.raises(SendError, match=f"tried {NO_ROUTE_RETRIES + 1} times"):
                producer.send(OutgoingMessage("T", b"x"))
    finally:
        producer.shutdown()
    assert len(calls) == min(refusals + 1, NO_ROUTE_RETRIES + 1)


def test_other_refusals_are_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _client_refusing(monkeypatch, 99, "msg: wait response timeout,error:-1")
    producer = NativeProducer("tw_timeout", f"127.0.0.1:{_closed_port()}", log_level=LogLevel.ERROR)
    try:
        with pytest.raises(SendError) as info:
            producer.send(OutgoingMessage("T", b"x"))
    finally:
        producer.shutdown()
    assert len(calls) == 1 and "tried" not in str(info.value)


def test_an_unchecked_send_puts_property_bytes_as_given_and_is_retried_like_send(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hostile = {b"TW_TARGET_TOPIC": b"T", b"note": b"\xff\xfe x\x02TW_TARGET_TOPIC\x01EVIL"}
    given: list[tuple[bytes, bytes]] = []
    real_set = _rmq_library._SetMessageProperty

    def set_property(handle: int, name: bytes, value: bytes) -> int:
        given.append((name, value))
        return int(real_set(handle, name, value))

    monkeypatch.setattr(_rmq_library, "_SetMessageProperty", set_property)
    calls = _client_refusing(monkeypatch, 1)
    producer = NativeProducer("tw_unchecked", f"127.0.0.1:{_closed_port()}", log_level=LogLevel.ERROR)
    try:
        with pytest.raises(ValueError, match="cannot carry"):  # the typed send refuses these bytes
            producer.send(OutgoingMessage("T", b"x", None, None, {"note": "x\x02TW_TARGET_TOPIC\x01EVIL"}))
        assert not calls
        assert producer.send_unchecked("T", b"x", hostile) == "stored"
    finally:
        producer.shutdown()
    assert given == list(hostile.items())
    assert len(calls) == 2  # one "no route", then stored


def test_a_no_route_answer_after_the_send_timeout_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # each try as long as a send that timed out: the broker may have stored it
    calls = _client_refusing(monkeypatch, 99, each_s=0.06)
    producer = NativeProducer("tw_slow_refusal", f"127.0.0.1:{_closed_port()}", send_timeout_ms=50,
                              log_level=LogLevel.ERROR)
    try:
        with pytest.raises(SendError) as info:
            producer.send(OutgoingMessage("T", b"x"))
    finally:
        producer.shutdown()
    assert len(calls) == 1 and "tried" not in str(info.value) and "No route info" in str(info.value)
