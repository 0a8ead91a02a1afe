"""The protocol: frames pinned in bytes, and response codes mapped to typed errors."""
from __future__ import annotations

import json
import struct

import pytest

from forwarder.rocketmq import (BrokerBusyError, BrokerError, BrokerUnavailableError, ConnectionFailedError,
                                MessageRejectedError, ProtocolError, RemotingError, RequestTimeoutError,
                                TopicNotFoundError, error_for_code)
from forwarder.rocketmq.protocol import decode_response, encode_request, take_frame


def test_a_request_frame_is_length_header_info_json_header_body() -> None:
    frame = encode_request(320, 7, {"a": "g"}, b"BODY")
    header = json.dumps({"code": 320, "language": "PYTHON", "version": 479, "opaque": 7, "flag": 0,
                         "extFields": {"a": "g"}}, separators=(",", ":")).encode()
    assert frame == struct.pack(">ii", 4 + len(header) + 4, len(header)) + header + b"BODY"


def _response(opaque: int, code: int, body: bytes, flag: int = 1) -> bytes:
    header = json.dumps({"code": code, "flag": flag, "opaque": opaque, "remark": "r", "extFields": {"k": "v"}}).encode()
    return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body


def test_frames_are_cut_from_a_stream_only_when_whole() -> None:
    buf = bytearray(_response(1, 0, b"one") + _response(2, 17, b"two")[:-1])
    first = take_frame(buf, "peer")
    assert first is not None and take_frame(buf, "peer") is None
    resp = decode_response(first, "peer")
    assert resp is not None and (resp.opaque, resp.code, resp.remark, resp.ext, resp.body) == (1, 0, "r", {"k": "v"},
                                                                                             b"one")


def test_a_frame_the_peer_sends_as_a_request_is_not_a_response() -> None:
    buf = bytearray(_response(1, 0, b"", flag=0))
    frame = take_frame(buf, "peer")
    assert frame is not None and decode_response(frame, "peer") is None


@pytest.mark.parametrize("raw", [
    pytest.param(struct.pack(">i", 17 * 1024 * 1024), id="length-over-the-servers-limit"),
    pytest.param(struct.pack(">i", 2), id="length-shorter-than-header-info"),
])
def test_an_impossible_length_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        take_frame(bytearray(raw), "peer")


@pytest.mark.parametrize("code,cls,retriable", [
    (1, BrokerUnavailableError, True),  # SYSTEM_ERROR
    (2, BrokerBusyError, True),  # SYSTEM_BUSY
    (14, BrokerUnavailableError, True),  # SERVICE_NOT_AVAILABLE
    (16, BrokerUnavailableError, True),  # NO_PERMISSION
    (215, BrokerBusyError, True),  # FLOW_CONTROL
    (501, BrokerUnavailableError, True),  # NOT_LEADER_FOR_QUEUE
    (13, MessageRejectedError, False),  # MESSAGE_ILLEGAL
    (17, TopicNotFoundError, False),  # TOPIC_NOT_EXIST
    (29, MessageRejectedError, False),  # INVALID_PARAMETER
    (12345, BrokerError, False),
])
def test_response_codes_map_to_typed_errors(code: int, cls: type[BrokerError], retriable: bool) -> None:
    err = error_for_code(code, "why", "broker-a")
    assert type(err) is cls and err.retriable is retriable and err.code == code and "why" in str(err)


@pytest.mark.parametrize("cls", [ConnectionFailedError, RequestTimeoutError, ProtocolError])
def test_transport_errors_are_retriable(cls: type[RemotingError]) -> None:
    assert cls("x").retriable
