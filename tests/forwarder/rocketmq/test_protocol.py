"""The protocol: frames pinned in bytes, and response codes mapped to typed errors."""
from __future__ import annotations

import json
import struct
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forwarder.rocketmq import (BrokerBusyError, BrokerError, BrokerUnavailableError, ConnectionFailedError,
                                MessageRejectedError, ProtocolError, RemotingError, RequestTimeoutError,
                                TopicNotFoundError, error_for_code)
from forwarder.rocketmq.protocol import decode_request, decode_response, encode_request, take_frame


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


def test_a_header_with_non_ascii_values_is_utf8_json_that_reads_back_as_the_standard_library_reads_it() -> None:
    ext = MappingProxyType({"a": "grüppe-組", "b": "T", "k": "x\"\\\n\u2028"})  # any Mapping, not only dicts
    frame = encode_request(12, 3, ext, b"")
    (length, info) = struct.unpack_from(">ii", frame)
    header = frame[8:8 + info]
    assert length == 4 + len(header) and b"\\u" not in header  # UTF-8 as it is, as fastjson writes it
    assert json.loads(header) == {"code": 12, "language": "PYTHON", "version": 479, "opaque": 3, "flag": 0,
                                  "extFields": dict(ext)}
    assert list(json.loads(header)) == ["code", "language", "version", "opaque", "flag", "extFields"]


def test_a_response_as_a_rocketmq_5_broker_writes_it_decodes() -> None:
    # a SEND_BATCH_MESSAGE answer in the shape a RocketMQ 5 broker writes it (fastjson: keys sorted, UTF-8)
    header = (b'{"code":0,"extFields":{"msgId":"7F00000100002A9F0000000000000000,7F00000100002A9F00000000000000C8",'
              b'"queueId":"3","queueOffset":"41","MSG_REGION":"DefaultRegion","TRACE_ON":"true","transactionId":""},'
              b'"flag":1,"language":"JAVA","opaque":9,"remark":"r\xc3\xa9","serializeTypeCurrentRPC":"JSON",'
              b'"version":479}')
    resp = decode_response(struct.pack(">i", len(header)) + header + b"BODY", "broker")
    assert resp is not None
    assert (resp.code, resp.opaque, resp.remark, resp.body) == (0, 9, "ré", b"BODY")
    assert resp.ext["queueOffset"] == "41" and resp.ext["msgId"].count(",") == 1


@pytest.mark.parametrize("header", [b"{not json", b"[1,2]", b'{"code":"\xff"}'], ids=["syntax", "array", "not-utf8"])
def test_a_header_that_is_not_a_json_object_is_a_protocol_error(header: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_response(struct.pack(">i", len(header)) + header, "peer")


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=6)


@given(st.dictionaries(st.sampled_from(["code", "opaque", "flag", "remark", "extFields", "language"]), _JSON))
def test_any_json_object_header_decodes_or_is_a_protocol_error(header: dict[str, object]) -> None:
    """A peer's header fields of any JSON type: a Request, a Response, or a ProtocolError (which the
    connection's readers handle), never a ValueError or TypeError that ends the thread reading it."""
    raw = json.dumps(header).encode()
    frame = struct.pack(">i", len(raw)) + raw
    for decode in (decode_response, decode_request):
        try:
            got = decode(frame, "peer")
        except ProtocolError:
            continue
        if got is not None:
            assert type(got.code) is int and type(got.opaque) is int and isinstance(got.ext, dict)


@pytest.mark.parametrize("header", [{"code": "0", "flag": 1}, {"code": 0, "flag": "1"}, {"code": 0, "flag": 1, "opaque": None},
                                    {"code": 0, "flag": 1, "extFields": [1]}, {"code": 0, "flag": 1, "remark": 7}],
                         ids=["code", "flag", "opaque", "ext", "remark"])
def test_a_header_field_of_the_wrong_type_is_a_protocol_error(header: dict[str, object]) -> None:
    raw = json.dumps(header).encode()
    with pytest.raises(ProtocolError, match="peer sent a header whose"):
        decode_response(struct.pack(">i", len(raw)) + raw, "peer")
