"""RocketMQ's remoting frames: request and response codes, and the one encoder and decoder of frames.

Wire format (apache/rocketmq `RemotingCommand`, JSON header serialization; integers big-endian)

    frame (every request and every response)
      length          int32   bytes after this field: 4 + header length + body length
      header_info     int32   serialize type << 24 | header length (type 0 = JSON; the broker
                              answers in the type of the request, so JSON is all we read)
      header          bytes   UTF-8 JSON: code, language, version, opaque, flag, remark, extFields
                              (compact, keys in that order, non-ASCII as UTF-8: what fastjson, the
                              servers' parser, reads; orjson writes and reads it)
      body            bytes   whatever is left of `length`

    header
      code            the request code (below), or the response code (0 success, see
                      `error_for_code` for the rest)
      opaque          chosen by the client per request; the response carries it back
      flag            bit 0 set: a response; bit 1 set: a one-way request
      version         the client's protocol version; NameServers answer routes in standard JSON only
                      to clients of version >= 401 (V4_9_4), so we claim 479 (V5_3_3)
      extFields       string -> string: the request's "custom header"

Every module of the client builds requests as (code, extFields, body) and reads `Response`s; only
this one knows how they look on the wire.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from forwarder.rocketmq.errors import (BrokerBusyError, BrokerError, BrokerUnavailableError, MessageRejectedError,
                                       ProtocolError, TopicNotFoundError)

# -- request codes (apache/rocketmq RequestCode) ---------------------------------------------

PULL_MESSAGE = 11
QUERY_MESSAGE = 12  # by index key: topic, key, maxNum, beginTimestamp, endTimestamp
QUERY_CONSUMER_OFFSET = 14
UPDATE_CONSUMER_OFFSET = 15
UPDATE_AND_CREATE_TOPIC = 17
UPDATE_AND_CREATE_TOPIC_LIST = 18  # RocketMQ 5 only
GET_BROKER_CONFIG = 26  # body: the broker's settings as a Java properties text
GET_MAX_OFFSET = 30
GET_MIN_OFFSET = 31
HEART_BEAT = 34
UNREGISTER_CLIENT = 35
GET_CONSUMER_LIST_BY_GROUP = 38
NOTIFY_CONSUMER_IDS_CHANGED = 40  # broker -> client
GET_ROUTEINFO_BY_TOPIC = 105
GET_BROKER_CLUSTER_INFO = 106
RESET_CONSUMER_CLIENT_OFFSET = 220  # broker -> client
GET_CONSUMER_STATUS_FROM_CLIENT = 221  # broker -> client
GET_CONSUMER_RUNNING_INFO = 307  # broker -> client (asked for by an admin tool)
SEND_BATCH_MESSAGE = 320

# -- response codes (apache/rocketmq ResponseCode) -------------------------------------------

SUCCESS = 0
SYSTEM_ERROR = 1
SYSTEM_BUSY = 2
REQUEST_CODE_NOT_SUPPORTED = 3
FLUSH_DISK_TIMEOUT = 10
SLAVE_NOT_AVAILABLE = 11
FLUSH_SLAVE_TIMEOUT = 12
MESSAGE_ILLEGAL = 13
SERVICE_NOT_AVAILABLE = 14
VERSION_NOT_SUPPORTED = 15
NO_PERMISSION = 16
TOPIC_NOT_EXIST = 17
PULL_NOT_FOUND = 19
PULL_RETRY_IMMEDIATELY = 20
PULL_OFFSET_MOVED = 21
QUERY_NOT_FOUND = 22
INVALID_PARAMETER = 29
FLOW_CONTROL = 215
NOT_LEADER_FOR_QUEUE = 501

REMOTING_VERSION = 479  # V5_3_3; anything >= 401 (V4_9_4) gets routes as standard JSON
_LANGUAGE = "PYTHON"
_RESPONSE_FLAG = 1  # bit 0 of `flag`
_ONEWAY_FLAG = 2  # bit 1 of `flag`: the sender wants no answer
_JSON_SERIALIZE = 0  # serialize type in the top byte of header_info
_HEADER_LENGTH_MASK = 0xFFFFFF
MAX_FRAME_BYTES = 16 * 1024 * 1024  # the servers' own limit (NettyDecoder): more means a corrupt stream

#: the start of every frame
_FRAME_HEAD = struct.Struct(
    ">"
    "i"  # length: bytes after this field (header_info, header, body)
    "i"  # header_info: serialize type << 24 | header length
)
#: the length field alone: how much of a frame to wait for
_FRAME_LENGTH = struct.Struct(">i")

#: Broker and NameServer response codes -> the error they mean (unknown codes: BrokerError).
_ERRORS: dict[int, type[BrokerError]] = {
    SYSTEM_ERROR: BrokerUnavailableError,
    SYSTEM_BUSY: BrokerBusyError,
    FLOW_CONTROL: BrokerBusyError,
    SERVICE_NOT_AVAILABLE: BrokerUnavailableError,
    # The Java client retries it on another broker: write permission is withdrawn while a broker
    # is drained, and the route then leads elsewhere.
    NO_PERMISSION: BrokerUnavailableError,
    NOT_LEADER_FOR_QUEUE: BrokerUnavailableError,
    TOPIC_NOT_EXIST: TopicNotFoundError,
    MESSAGE_ILLEGAL: MessageRejectedError,
    INVALID_PARAMETER: MessageRejectedError,
    REQUEST_CODE_NOT_SUPPORTED: MessageRejectedError,
    VERSION_NOT_SUPPORTED: MessageRejectedError,
}


def error_for_code(code: int, remark: str | None, where: str) -> BrokerError:
    """The typed error for a non-success response `code` from `where`."""
    cls = _ERRORS.get(code, BrokerError)
    return cls(f"{where} answered code {code}: {remark or 'no remark'}", code=code, remark=remark)


@dataclass(frozen=True, slots=True)
class Response:
    """A decoded response frame."""

    code: int
    opaque: int
    remark: str | None
    ext: dict[str, str]
    body: bytes


def ext_int(resp: Response, name: str, default: int) -> int:
    """A response's extField as a number (`default` when absent); ProtocolError when it is not one
    (a broker's odd answer: the caller retries it as any other protocol fault)."""
    value = resp.ext.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"the broker answered {name}={value!r}, not a number") from None


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request frame that a peer (a broker asking its client) sent us."""

    code: int
    opaque: int
    oneway: bool  # the peer wants no answer
    ext: dict[str, str]
    body: bytes


#: What a client answers a peer's request: (response code, remark, body); None: no answer at all.
Reply = tuple[int, str | None, bytes]


def encode_request(code: int, opaque: int, ext: Mapping[str, str], body: bytes) -> bytes:
    """One request frame with a JSON header."""
    header = orjson.dumps(
        {"code": code, "language": _LANGUAGE, "version": REMOTING_VERSION, "opaque": opaque, "flag": 0,
         "extFields": ext if type(ext) is dict else dict(ext)})  # orjson writes dicts, not any Mapping
    head = _FRAME_HEAD.pack(_FRAME_HEAD.size - _FRAME_LENGTH.size + len(header) + len(body),
                            (_JSON_SERIALIZE << 24) | len(header))
    return head + header + body


def encode_response(code: int, opaque: int, remark: str | None, body: bytes) -> bytes:
    """One response frame (to a request the peer sent) with a JSON header."""
    header: dict[str, Any] = {"code": code, "language": _LANGUAGE, "version": REMOTING_VERSION, "opaque": opaque,
                              "flag": _RESPONSE_FLAG}
    if remark is not None:
        header["remark"] = remark
    raw = orjson.dumps(header)
    return _FRAME_HEAD.pack(_FRAME_HEAD.size - _FRAME_LENGTH.size + len(raw) + len(body),
                            (_JSON_SERIALIZE << 24) | len(raw)) + raw + body


def take_frame(buf: bytearray, peer: str) -> bytes | None:
    """Cut the first whole frame (after its length field) off `buf`; None while it is incomplete."""
    if len(buf) < _FRAME_LENGTH.size:
        return None
    (length,) = _FRAME_LENGTH.unpack_from(buf)
    if not _FRAME_LENGTH.size <= length <= MAX_FRAME_BYTES:
        foreign = _foreign_protocol(bytes(buf[:_FRAME_LENGTH.size]))
        if foreign is not None:
            raise ProtocolError(f"{peer} does not speak RocketMQ (it answered like {foreign[0]}): {foreign[1]}")
        raise ProtocolError(f"{peer} sent a frame length of {length}, expected "
                            f"{_FRAME_LENGTH.size} to {MAX_FRAME_BYTES}")
    end = _FRAME_LENGTH.size + length
    if len(buf) < end:
        return None
    frame = bytes(buf[_FRAME_LENGTH.size:end])
    del buf[:end]
    return frame


_CHECK_ADDRESS = "check the NameServer address (--namesrv) and the broker addresses it names"
_CHECK_TLS = "if it expects TLS, set tls = true under [rocketmq]; else " + _CHECK_ADDRESS
#: the first bytes other services answer with -> (what the peer is likely to be, what to check)
_FOREIGN_STARTS: tuple[tuple[bytes, str, str], ...] = (
    (b"HTTP", "HTTP", _CHECK_ADDRESS),
    (b"SSH-", "SSH", _CHECK_ADDRESS),
    # TLS records: an alert (0x15) or a handshake (0x16), version 3.x
    (b"\x15\x03", "TLS", _CHECK_TLS),
    (b"\x16\x03", "TLS", _CHECK_TLS),
)


def _foreign_protocol(start: bytes) -> tuple[str, str] | None:
    """(protocol, what to check) for a stream starting with `start` that another protocol's server
    sent, when it is one we recognise."""
    for prefix, name, check in _FOREIGN_STARTS:
        if start.startswith(prefix):
            return name, check
    return None


def decode_frame(frame: bytes, peer: str) -> tuple[int, dict[str, Any], bytes]:
    """Split a frame (without its length field) into (flag, header, body); ProtocolError if malformed."""
    if len(frame) < _FRAME_LENGTH.size:
        raise ProtocolError(f"{peer} sent a frame of {len(frame)} bytes, shorter than its header length field")
    (info,) = _FRAME_LENGTH.unpack_from(frame)
    serialize, header_len = info >> 24, info & _HEADER_LENGTH_MASK
    if serialize != _JSON_SERIALIZE:
        raise ProtocolError(f"{peer} sent a header serialized as type {serialize}, expected {_JSON_SERIALIZE} (JSON)")
    end = _FRAME_LENGTH.size + header_len
    if end > len(frame):
        raise ProtocolError(f"{peer} sent a header of {header_len} bytes in a frame of {len(frame)}")
    try:
        header = orjson.loads(memoryview(frame)[_FRAME_LENGTH.size:end])
    except orjson.JSONDecodeError as e:  # a ValueError, invalid UTF-8 included
        raise ProtocolError(f"{peer} sent a header that is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(f"{peer} sent a header that is not a JSON object: {header!r:.100}")
    flag = header.get("flag", 0)
    if type(flag) is not int:
        raise ProtocolError(f"{peer} sent a header whose flag is not an integer: {flag!r:.40}")
    return flag, header, frame[end:]


def decode_request(frame: bytes, peer: str) -> Request | None:
    """The request a frame carries; None for a response frame."""
    flag, header, body = decode_frame(frame, peer)
    if flag & _RESPONSE_FLAG:
        return None
    code, opaque, _, ext = _fields(header, -1, peer)
    return Request(code, opaque, bool(flag & _ONEWAY_FLAG), {str(k): str(v) for k, v in ext.items()}, body)


def decode_response(frame: bytes, peer: str) -> Response | None:
    """The response a frame carries; None for a frame the peer sent as a request of its own."""
    flag, header, body = decode_frame(frame, peer)
    if not flag & _RESPONSE_FLAG:
        return None
    return Response(*_fields(header, SYSTEM_ERROR, peer), body)


def _fields(header: dict[str, Any], no_code: int, peer: str) -> tuple[int, int, str | None, dict[str, Any]]:
    """A header's code, opaque, remark and extFields, each of the type the protocol gives it; a
    ProtocolError names the first that is not (the connection is then made again, as for any
    malformed frame, where a ValueError would have ended the thread reading it)."""
    code, opaque, remark = header.get("code", no_code), header.get("opaque", -1), header.get("remark")
    ext = header.get("extFields") or {}
    if type(code) is not int or type(opaque) is not int:
        raise ProtocolError(f"{peer} sent a header whose code or opaque is not an integer: "
                            f"code {code!r:.40}, opaque {opaque!r:.40}")
    if remark is not None and type(remark) is not str:
        raise ProtocolError(f"{peer} sent a header whose remark is not a string: {remark!r:.40}")
    if type(ext) is not dict:
        raise ProtocolError(f"{peer} sent a header whose extFields is not an object: {ext!r:.40}")
    return code, opaque, remark, ext
