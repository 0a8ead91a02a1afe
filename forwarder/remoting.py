"""RocketMQ's remoting protocol spoken directly: topic routes from the NameServer and batch sends.

Why: through the bundled client a single send costs ~100 µs of CPU inside the library, which caps
delivery at ~6-8k msg/s on two cores, and the client's own batch send is stored by a Java broker as
ONE message (its batch flag travels as "1", which Java parses as false). One SEND_BATCH_MESSAGE
request instead stores up to ~128 messages in one round trip, each under its own id, with its own
tags, keys and properties, for well under 10 µs of Python per message.

`RemotingProducer.send()` takes messages for any number of topics, groups them by topic, cuts each
group into batches (at most `max_batch_messages` messages and `max_batch_bytes` bytes), gives each
batch the next writable queue of its topic (round robin over all brokers' queues), writes every
request before reading any answer (pipelined, matched by opaque), and answers per message with a
`Receipt` or the typed error of its batch. It never retries a request the broker may have stored:
the caller retries (at-least-once); only batches whose broker could not even be connected to are
moved to another broker at once.

Wire format (apache/rocketmq `RemotingCommand`, JSON header serialization; integers big-endian)

    frame (every request and every response)
      length          int32   bytes after this field: 4 + header length + body length
      header_info     int32   serialize type << 24 | header length (type 0 = JSON; the broker
                              answers in the type of the request, so JSON is all we read)
      header          bytes   UTF-8 JSON: code, language, version, opaque, flag, remark, extFields
      body            bytes   whatever is left of `length`

    header
      code            request code (105 GET_ROUTEINFO_BY_TOPIC, 320 SEND_BATCH_MESSAGE), or the
                      response code (0 success, see `_ERRORS` for the rest)
      opaque          chosen by the client per request; the response carries it back
      flag            bit 0 set: a response; bit 1 set: a one-way request
      version         the client's protocol version; NameServers answer routes in standard JSON only
                      to clients of version >= 401 (V4_9_4), so we claim 479 (V5_3_3)
      extFields       string -> string: the request's "custom header"

    GET_ROUTEINFO_BY_TOPIC request: extFields topic, acceptStandardJsonOnly. Response code 17 when
    the NameServer knows no route, else a TopicRouteData body:
      {"brokerDatas": [{"brokerName": "b", "brokerAddrs": {"0": "host:port", "1": ...}}],
       "queueDatas": [{"brokerName": "b", "writeQueueNums": 4, "perm": 6, ...}], ...}
    brokerAddrs key "0" is the master, the only one a producer writes to; perm & 2: writable.

    SEND_BATCH_MESSAGE request: SendMessageRequestHeaderV2 in extFields, one letter a field:
      a producer group   b topic   c default topic (TBW102)   d queues of an auto-created topic
      e queue id   f sysFlag 0   g born timestamp (epoch ms)   h flag 0   i properties of the batch
      j reconsume times 0   k unit mode false   m batch true   n broker name
    body: the messages one after another (MessageDecoder.encodeMessage), each:
      total_size      int32   bytes of this message's encoding, this field included
      magic           int32   0 (the broker writes its own)
      body_crc        int32   0 (the broker computes it)
      flag            int32   0 (the message's user flag)
      body_length     int32
      body            bytes
      props_length    int16   bytes of properties; at most 32767
      properties      UTF-8   name \\x01 value \\x02, repeated: every message carries UNIQ_KEY (its id),
                              WAIT=true, TAGS and KEYS when set, and the user's properties, exactly
                              the properties the bundled client sends for a single message
    response: code 0 (or 10/11/12: stored, but not flushed or replicated in time), extFields
    queueId, queueOffset (of the first message; the others follow in order), msgId (offset ids).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
import select
import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from forwarder._rmq_native import OutgoingMessage, SendStatus, join_properties
from forwarder.errors import ForwarderError

__all__ = [
    "BrokerBusyError",
    "BrokerError",
    "BrokerUnavailableError",
    "Connection",
    "ConnectionFailedError",
    "MessageRejectedError",
    "ProtocolError",
    "Receipt",
    "RemotingError",
    "RemotingProducer",
    "RequestTimeoutError",
    "Response",
    "TopicNotFoundError",
    "TopicRoute",
    "encode_message",
    "error_for_code",
]

log = logging.getLogger("timewheel.remoting")

# -- protocol constants (apache/rocketmq RequestCode, ResponseCode, MixAll, PermName) ----------

GET_ROUTEINFO_BY_TOPIC = 105
SEND_BATCH_MESSAGE = 320

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
INVALID_PARAMETER = 29
FLOW_CONTROL = 215
NOT_LEADER_FOR_QUEUE = 501

#: Response codes that mean "stored", with the status a send result reports for them.
_STORED = {
    SUCCESS: SendStatus.OK,
    FLUSH_DISK_TIMEOUT: SendStatus.FLUSH_DISK_TIMEOUT,
    FLUSH_SLAVE_TIMEOUT: SendStatus.FLUSH_SLAVE_TIMEOUT,
    SLAVE_NOT_AVAILABLE: SendStatus.SLAVE_NOT_AVAILABLE,
}

_REMOTING_VERSION = 479  # V5_3_3; anything >= 401 (V4_9_4) gets routes as standard JSON
_LANGUAGE = "PYTHON"
_RESPONSE_FLAG = 1  # bit 0 of `flag`
_JSON_SERIALIZE = 0  # serialize type in the top byte of header_info
_HEADER_LENGTH_MASK = 0xFFFFFF

_MASTER_ID = "0"  # brokerAddrs key of a broker set's master
_PERM_WRITE = 1 << 1
_PERM_READ = 1 << 2
DEFAULT_TOPIC = "TBW102"  # the broker creates a missing topic from this one's config when allowed
DEFAULT_TOPIC_QUEUES = 4  # queues of a topic the broker creates on first send (as the clients ask)

_UNIQ_KEY = "UNIQ_KEY"
_WAIT = "WAIT"
_TAGS = "TAGS"
_KEYS = "KEYS"
# Bytes that would split a property (\x01, \x02), or cut it short in the C++ clients (\x00).
_RESERVED_CHARS = re.compile("[\x00-\x02]")
_TOPIC_NAME = re.compile(r"^[%|a-zA-Z0-9_-]{1,127}$")  # the broker's TopicValidator

_MAX_PROPERTIES_BYTES = 32767  # props_length is a signed 16-bit field
BROKER_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # broker default maxMessageSize: the limit of one batch body

# -- byte layouts ----------------------------------------------------------------------------

#: the start of every frame
_FRAME_HEAD = struct.Struct(
    ">"
    "i"  # length: bytes after this field (header_info, header, body)
    "i"  # header_info: serialize type << 24 | header length
)
#: the length field alone: how much of a frame to wait for
_FRAME_LENGTH = struct.Struct(">i")
#: one message of a batch body, up to its body
_MESSAGE_HEAD = struct.Struct(
    ">"
    "i"  # total_size: this message's encoding, this field included
    "i"  # magic: 0, the broker writes its own
    "i"  # body_crc: 0, the broker computes it
    "i"  # flag: the user flag, 0
    "i"  # body_length
)
#: after the body: the length of the properties that follow
_PROPERTIES_LENGTH = struct.Struct(">h")
_MESSAGE_OVERHEAD = _MESSAGE_HEAD.size + _PROPERTIES_LENGTH.size
#: UNIQ_KEY's fixed part (20 hex digits)
_ID_PREFIX = struct.Struct(
    ">"
    "4s"  # IPv4 address of this host, as the brokers see it
    "H"  # pid, low 16 bits
    "I"  # random salt (the Java client uses its class loader's hash)
)
#: UNIQ_KEY's per-message part (12 hex digits)
_ID_SUFFIX = struct.Struct(
    ">"
    "I"  # ms since the start of the month, local time
    "H"  # counter, wraps
)
_COUNTER_MASK = 0xFFFF

_RECV_CHUNK = 256 * 1024
_MAX_FRAME_BYTES = 16 * 1024 * 1024  # the servers' own limit (NettyDecoder): more means a corrupt stream


# -- errors ----------------------------------------------------------------------------------


class RemotingError(ForwarderError):
    """A request to the NameServer or a broker failed; `retriable` says whether trying later may help."""

    retriable: ClassVar[bool] = True

    def __init__(self, message: str, *, code: int | None = None, remark: str | None = None) -> None:
        super().__init__(message)
        #: the response code, when the server answered one
        self.code = code
        #: the server's explanation, when it gave one
        self.remark = remark


class ConnectionFailedError(RemotingError):
    """Could not connect, or the connection broke: the broker may be down or restarting."""


class RequestTimeoutError(RemotingError):
    """No answer within the timeout; the request may or may not have been carried out."""


class ProtocolError(RemotingError):
    """The peer sent something that is not a remoting frame; the connection was dropped."""


class BrokerError(RemotingError):
    """The server answered with a response code that is not success (see `_ERRORS`)."""

    retriable: ClassVar[bool] = False


class BrokerBusyError(BrokerError):
    """The broker sheds load (system busy, flow control, page cache busy): send again later."""

    retriable: ClassVar[bool] = True


class BrokerUnavailableError(BrokerError):
    """The broker cannot take writes now (system error, not writable, not the leader, store down)."""

    retriable: ClassVar[bool] = True


class TopicNotFoundError(BrokerError):
    """The topic does not exist (and the broker is not allowed to create it)."""


class MessageRejectedError(BrokerError):
    """The message or request is invalid (too large, bad properties, bad topic): resending cannot help."""


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


# -- frames ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    """A decoded response frame."""

    code: int
    opaque: int
    remark: str | None
    ext: dict[str, str]
    body: bytes


def _encode_request(code: int, opaque: int, ext: Mapping[str, str], body: bytes) -> bytes:
    """One request frame with a JSON header."""
    header = json.dumps(
        {"code": code, "language": _LANGUAGE, "version": _REMOTING_VERSION, "opaque": opaque, "flag": 0,
         "extFields": ext},
        separators=(",", ":"),
    ).encode()
    head = _FRAME_HEAD.pack(_FRAME_HEAD.size - _FRAME_LENGTH.size + len(header) + len(body),
                            (_JSON_SERIALIZE << 24) | len(header))
    return head + header + body


def _decode_frame(frame: bytes, peer: str) -> tuple[int, dict[str, Any], bytes]:
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
        header = json.loads(frame[_FRAME_LENGTH.size:end])
    except ValueError as e:
        raise ProtocolError(f"{peer} sent a header that is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(f"{peer} sent a header that is not a JSON object: {header!r:.100}")
    return int(header.get("flag", 0)), header, frame[end:]


# -- messages --------------------------------------------------------------------------------


class _IdMaker:
    """Message ids (UNIQ_KEY) laid out as RocketMQ's clients make them, so tools can read them back.

    32 hex digits: IPv4 (4 bytes), pid (2), a random salt (4), ms since the start of the current
    month in local time (4; how the Java client's MessageClientIDSetter decodes it), a counter (2).
    """

    def __init__(self, ip: bytes) -> None:
        self._prefix = _ID_PREFIX.pack(ip, os.getpid() & _COUNTER_MASK, random.getrandbits(32)).hex().upper()
        self._counter = itertools.count(random.getrandbits(16))  # next() is atomic under the GIL
        self._month_start_ms, self._next_month_ms = _month_bounds(time.time())

    def next_ids(self, n: int) -> list[str]:
        """`n` new ids (one clock read for all of them: the counter keeps them apart)."""
        now = int(time.time() * 1000)
        if now >= self._next_month_ms:
            self._month_start_ms, self._next_month_ms = _month_bounds(now / 1000)
        prefix, since, counter = self._prefix, now - self._month_start_ms, self._counter
        return [prefix + _ID_SUFFIX.pack(since, next(counter) & _COUNTER_MASK).hex().upper() for _ in range(n)]


def _month_bounds(now_s: float) -> tuple[int, int]:
    """Epoch ms of the start of this month and of the next, local time."""
    t = time.localtime(now_s)
    start = time.mktime((t.tm_year, t.tm_mon, 1, 0, 0, 0, 0, 0, -1))
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    end = time.mktime((year, month, 1, 0, 0, 0, 0, 0, -1))
    return int(start * 1000), int(end * 1000)


def encode_message(msg: OutgoingMessage, msg_id: str) -> bytes:
    """Encode one message of a batch body; MessageRejectedError if RocketMQ cannot carry it."""
    props = dict(msg.properties)
    if msg.tags:
        props[_TAGS] = msg.tags
    if msg.keys:
        props[_KEYS] = msg.keys
    # One search over every name and value (the ones added below are known to be clean).
    if _RESERVED_CHARS.search("".join(itertools.chain.from_iterable(props.items()))):
        name, value = next((k, v) for k, v in props.items() if _RESERVED_CHARS.search(k + v))
        raise MessageRejectedError(f"property {name!r}={value!r:.100} contains \\x00, \\x01 or \\x02, which "
                                   f"RocketMQ uses as separators", code=MESSAGE_ILLEGAL)
    props[_WAIT] = "true"
    props[_UNIQ_KEY] = msg_id
    properties = join_properties(props).encode()
    if len(properties) > _MAX_PROPERTIES_BYTES:
        raise MessageRejectedError(f"properties of {len(properties)} bytes exceed RocketMQ's {_MAX_PROPERTIES_BYTES}",
                                   code=MESSAGE_ILLEGAL)
    body = msg.body
    return b"".join((_MESSAGE_HEAD.pack(_MESSAGE_OVERHEAD + len(body) + len(properties), 0, 0, 0, len(body)), body,
                     _PROPERTIES_LENGTH.pack(len(properties)), properties))


@dataclass(frozen=True, slots=True)
class Receipt:
    """Where the broker stored one message."""

    msg_id: str  # the UNIQ_KEY consumers see as the message id
    topic: str
    broker: str
    queue_id: int
    queue_offset: int
    status: SendStatus  # OK, or stored but not flushed / replicated in time


# -- routes ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopicRoute:
    """The writable (or, parsed with `readable=True`, readable) queues of a topic and the master
    address of each broker holding some."""

    topic: str
    queues: tuple[tuple[str, int], ...]  # (broker name, queue id), brokers in name order
    brokers: Mapping[str, str]  # broker name -> master "host:port"
    fetched: float  # time.monotonic() of the look-up
    via_default_topic: bool = False  # no route of its own yet: sent where the broker may create it

    @classmethod
    def parse(cls, topic: str, data: Mapping[str, Any], fetched: float, *, via_default_topic: bool = False,
              max_queues: int | None = None, readable: bool = False) -> TopicRoute:
        """Build from a TopicRouteData document (only masters of writable, or readable, queue sets count)."""
        masters = {b["brokerName"]: b["brokerAddrs"][_MASTER_ID] for b in data.get("brokerDatas", ())
                   if _MASTER_ID in (b.get("brokerAddrs") or {})}
        perm, count = (_PERM_READ, "readQueueNums") if readable else (_PERM_WRITE, "writeQueueNums")
        queues: list[tuple[str, int]] = []
        brokers: dict[str, str] = {}
        for qd in sorted(data.get("queueDatas", ()), key=lambda q: q["brokerName"]):
            name = qd["brokerName"]
            if not qd.get("perm", 0) & perm or name not in masters:
                continue
            n = int(qd.get(count, 0))
            if max_queues is not None:
                n = min(n, max_queues)
            queues += [(name, q) for q in range(n)]
            brokers[name] = masters[name]
        return cls(topic, tuple(queues), brokers, fetched, via_default_topic)


# -- connections -----------------------------------------------------------------------------


class Connection:
    """One TCP connection to a NameServer or broker; requests are pipelined and matched by opaque.

    Not thread-safe by itself: callers hold `lock` from `submit` to the matching `collect`.
    """

    def __init__(self, addr: str, timeout: float) -> None:
        self.addr = addr
        self.lock = threading.Lock()
        host, _, port = addr.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        except (OSError, ValueError) as e:
            raise ConnectionFailedError(f"cannot connect to {addr}: {e}") from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._opaque = itertools.count(1)
        self._buf = bytearray()
        self.closed = False

    @property
    def local_ip(self) -> str:
        """The address this side of the connection has (what the peer sees)."""
        return str(self._sock.getsockname()[0])

    def alive(self) -> bool:
        """False once the peer closed the connection (a restarted broker, an idle timeout).

        A connection another thread is using counts as alive: that thread finds out if it is not.
        Peeking under its feet would race it for the bytes, then wait out its socket timeout.
        """
        if self.closed:
            return False
        if not self.lock.acquire(blocking=False):
            return True
        try:
            if self._poll.poll(0):  # readable while nothing is awaited: end of stream, or a stray frame
                try:
                    if not self._sock.recv(1, socket.MSG_PEEK):
                        self.close()
                except OSError:
                    self.close()
        finally:
            self.lock.release()
        return not self.closed

    def submit(self, requests: Sequence[tuple[int, Mapping[str, str], bytes]], deadline: float) -> list[int]:
        """Write requests (code, extFields, body) in one go; return their opaques."""
        opaques = [next(self._opaque) for _ in requests]
        data = b"".join(_encode_request(code, o, ext, body) for o, (code, ext, body) in zip(opaques, requests))
        try:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            self._sock.sendall(data)
        except TimeoutError as e:
            self.close()
            raise RequestTimeoutError(f"writing {len(requests)} request(s) to {self.addr} timed out") from e
        except OSError as e:
            self.close()
            raise ConnectionFailedError(f"connection to {self.addr} broke while writing: {e}") from e
        return opaques

    def collect(self, opaques: Iterable[int], deadline: float) -> dict[int, Response | RemotingError]:
        """Read until every opaque is answered; on failure the unanswered ones get the error."""
        waiting = set(opaques)
        out: dict[int, Response | RemotingError] = {}
        try:
            while waiting:
                resp = self.read_response(deadline)
                if resp.opaque in waiting:
                    waiting.discard(resp.opaque)
                    out[resp.opaque] = resp
                # else: the answer to a request given up on earlier; nobody waits for it any more
        except RemotingError as e:
            self.close()
            out.update((o, e) for o in waiting)
        return out

    def request(self, code: int, ext: Mapping[str, str], body: bytes, deadline: float) -> Response:
        """One request and its response; raises the RemotingError instead of returning it."""
        with self.lock:
            [opaque] = self.submit([(code, ext, body)], deadline)
            answer = self.collect([opaque], deadline)[opaque]
        if isinstance(answer, RemotingError):
            raise answer
        return answer

    def readable(self, timeout: float) -> bool:
        """Whether a frame may be read now: bytes are buffered, or arrive within `timeout` seconds."""
        return bool(self._buf) or bool(self._poll.poll(timeout * 1000))

    def read_response(self, deadline: float) -> Response:
        """The next response frame (frames the peer sends as requests are skipped)."""
        while True:
            frame = self._read_frame(deadline)
            flag, header, body = _decode_frame(frame, self.addr)
            if flag & _RESPONSE_FLAG:
                ext = header.get("extFields") or {}
                return Response(int(header.get("code", SYSTEM_ERROR)), int(header.get("opaque", -1)),
                                 header.get("remark"), ext, body)

    def _read_frame(self, deadline: float) -> bytes:
        """Bytes of the next frame after its length field."""
        buf = self._buf
        while True:
            if len(buf) >= _FRAME_LENGTH.size:
                (length,) = _FRAME_LENGTH.unpack_from(buf)
                if not _FRAME_LENGTH.size <= length <= _MAX_FRAME_BYTES:
                    raise ProtocolError(f"{self.addr} sent a frame length of {length}, expected "
                                        f"{_FRAME_LENGTH.size} to {_MAX_FRAME_BYTES}")
                end = _FRAME_LENGTH.size + length
                if len(buf) >= end:
                    frame = bytes(buf[_FRAME_LENGTH.size:end])
                    del buf[:end]
                    return frame
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeoutError(f"no answer from {self.addr} in time")
            try:
                self._sock.settimeout(left)
                chunk = self._sock.recv(_RECV_CHUNK)
            except TimeoutError as e:
                raise RequestTimeoutError(f"no answer from {self.addr} in time") from e
            except OSError as e:
                raise ConnectionFailedError(f"connection to {self.addr} broke while reading: {e}") from e
            if not chunk:
                raise ConnectionFailedError(f"{self.addr} closed the connection")
            buf += chunk

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if not self.closed:
            self.closed = True
            try:
                self._sock.close()
            except OSError:
                pass


# -- the producer ----------------------------------------------------------------------------


@dataclass
class _Batch:
    """One SEND_BATCH_MESSAGE request in the making: its messages' positions, ids and bytes."""

    topic: str
    index: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    queue: tuple[str, int] = ("", -1)


class RemotingProducer:
    """Sends messages to RocketMQ topics in SEND_BATCH_MESSAGE requests; thread-safe.

    Routes are looked up on the NameServer on first use, cached for `route_ttl_s` and refreshed
    sooner after a failure (at most every `route_retry_s`); while the NameServer cannot be reached
    or no longer lists a route it had (it drops a broker that stopped), the last route is kept.
    One persistent connection per broker. A topic without a route is sent through the default
    topic's route when `auto_create_topics` (as the bundled client does), so a broker configured
    with autoCreateTopicEnable creates it; otherwise it fails with TopicNotFoundError.
    """

    def __init__(
        self,
        namesrv: str,
        group: str,
        *,
        timeout_ms: int = 3000,
        route_ttl_s: float = 30.0,
        route_retry_s: float = 1.0,
        broker_backoff_s: float = 1.0,
        max_batch_messages: int = 128,
        max_batch_bytes: int = 1024 * 1024,
        max_message_bytes: int = BROKER_MAX_MESSAGE_BYTES,
        auto_create_topics: bool = True,
    ) -> None:
        """Configure (connects lazily); `namesrv` is "host:port", several separated by ';'."""
        self.namesrv_addrs = [a.strip() for a in namesrv.split(";") if a.strip()]
        if not self.namesrv_addrs:
            raise ValueError(f"no NameServer address in {namesrv!r}")
        if max_batch_messages < 1 or max_batch_bytes < 1:
            raise ValueError("max_batch_messages and max_batch_bytes must be positive")
        self.group = group
        self.timeout = timeout_ms / 1000
        self.route_ttl_s = route_ttl_s
        self.route_retry_s = route_retry_s
        self.broker_backoff_s = broker_backoff_s
        self.max_batch_messages = max_batch_messages
        self.max_batch_bytes = max_batch_bytes
        self.max_message_bytes = max_message_bytes
        self.auto_create_topics = auto_create_topics
        self._lock = threading.Lock()  # routes, connections, queue cursors, back-offs
        self._routes: dict[str, TopicRoute] = {}
        self._stale: set[str] = set()  # topics whose route must be looked up again before use
        self._route_tried: dict[str, float] = {}  # topic -> monotonic time of the last look-up
        self._cursor: dict[str, int] = defaultdict(lambda: random.randrange(1 << 16))
        self._down_until: dict[str, float] = {}  # broker name -> no new connection before this
        self._conns: dict[str, Connection] = {}
        self._namesrv_lock = threading.Lock()
        self._namesrv: Connection | None = None
        self._namesrv_next = 0
        self._ids: _IdMaker | None = None
        self._closed = False

    # -- sending --

    def send(self, messages: Sequence[OutgoingMessage]) -> list[Receipt | RemotingError]:
        """Send messages of any topics; per message, its Receipt or the error of its batch."""
        if self._closed:
            raise ConnectionFailedError("the producer is closed")
        if not messages:
            return []
        deadline = time.monotonic() + self.timeout
        routes: dict[str, TopicRoute | RemotingError] = {}
        for topic in dict.fromkeys(m.topic for m in messages):
            try:
                if not _TOPIC_NAME.match(topic):
                    raise MessageRejectedError(f"{topic!r} is not a valid topic name", code=INVALID_PARAMETER)
                routes[topic] = self._route(topic)
            except RemotingError as e:
                routes[topic] = e
        out: list[Receipt | RemotingError | None] = [None] * len(messages)
        plans: dict[str, list[_Batch]] = defaultdict(list)  # broker address -> its batches
        for batch in self._cut(messages, routes, out):
            route = routes[batch.topic]
            assert isinstance(route, TopicRoute)  # messages of failed topics are not cut into batches
            try:
                plans[self._place(route, batch)].append(batch)
            except RemotingError as e:
                _fail(out, [batch], e)
        self._exchange(plans, out, deadline)
        return [r if r is not None else ConnectionFailedError("not sent") for r in out]

    def send_batch(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Receipt]:
        """Send messages of one topic in as few requests as the limits allow; raise the first error."""
        if any(m.topic != topic for m in messages):
            raise ValueError(f"every message must be for topic {topic}")
        receipts: list[Receipt] = []
        for r in self.send(messages):
            if isinstance(r, RemotingError):
                raise r
            receipts.append(r)
        return receipts

    def _cut(self, messages: Sequence[OutgoingMessage], routes: Mapping[str, TopicRoute | RemotingError],
             out: list[Receipt | RemotingError | None]) -> list[_Batch]:
        """Encode every message of a routable topic; cut batches per topic within the count and byte limits."""
        ids = self._id_maker().next_ids(len(messages))
        open_batch: dict[str, _Batch] = {}
        batches: list[_Batch] = []
        for i, (m, msg_id) in enumerate(zip(messages, ids)):
            route = routes[m.topic]
            if isinstance(route, RemotingError):
                out[i] = route
                continue
            try:
                data = encode_message(m, msg_id)
                if len(data) > self.max_message_bytes:
                    raise MessageRejectedError(f"message of {len(data)} bytes exceeds the maximum of "
                                               f"{self.max_message_bytes}", code=MESSAGE_ILLEGAL)
            except MessageRejectedError as e:
                out[i] = e
                continue
            b = open_batch.get(m.topic)
            if b is None or len(b.index) >= self.max_batch_messages or b.size + len(data) > self.max_batch_bytes:
                b = open_batch[m.topic] = _Batch(m.topic)
                batches.append(b)
            b.index.append(i)
            b.ids.append(msg_id)
            b.parts.append(data)
            b.size += len(data)
        return batches

    def _place(self, route: TopicRoute, batch: _Batch) -> str:
        """Give the batch the topic's next writable queue on a reachable broker; return its address."""
        tried: set[str] = set()
        while True:
            with self._lock:
                now = time.monotonic()
                candidates = [q for q in route.queues if q[0] not in tried]
                healthy = [q for q in candidates if self._down_until.get(q[0], 0.0) <= now] or candidates
                if not healthy:
                    raise ConnectionFailedError(f"no reachable broker for topic {route.topic} "
                                                f"(tried {', '.join(sorted(tried)) or 'none'})")
                cursor = self._cursor[route.topic]
                self._cursor[route.topic] = cursor + 1
                batch.queue = healthy[cursor % len(healthy)]
            name = batch.queue[0]
            try:
                return self._connection(name, route.brokers[name]).addr
            except ConnectionFailedError as e:
                # Nothing was sent: safe to try another broker of the topic at once.
                tried.add(name)
                self._mark_stale(route.topic)
                log.debug("%s; trying another broker of %s", e, route.topic)
                if len(tried) >= len(route.brokers):
                    raise

    def _exchange(self, plans: Mapping[str, list[_Batch]], out: list[Receipt | RemotingError | None],
                  deadline: float) -> None:
        """Write every broker's requests, then read every answer (locks taken in address order)."""
        born = str(int(time.time() * 1000))
        held: list[tuple[Connection, list[_Batch], list[int] | RemotingError]] = []
        try:
            for addr in sorted(plans):
                conn = self._conns.get(addr)
                if conn is None:  # closed meanwhile
                    _fail(out, plans[addr], ConnectionFailedError(f"connection to {addr} was closed"))
                    continue
                conn.lock.acquire()
                requests = [(SEND_BATCH_MESSAGE, self._header(b, born), b"".join(b.parts)) for b in plans[addr]]
                try:
                    held.append((conn, plans[addr], conn.submit(requests, deadline)))
                except RemotingError as e:
                    held.append((conn, plans[addr], e))
            for conn, batches, opaques in held:
                if isinstance(opaques, RemotingError):
                    self._settle(conn, batches, [opaques] * len(batches), out)
                else:
                    answers = conn.collect(opaques, deadline)
                    self._settle(conn, batches, [answers[o] for o in opaques], out)
        finally:
            for conn, _, _ in held:
                conn.lock.release()

    def _settle(self, conn: Connection, batches: Sequence[_Batch], answers: Sequence[Response | RemotingError],
                out: list[Receipt | RemotingError | None]) -> None:
        """Turn each batch's answer into per-message receipts or errors."""
        for b, answer in zip(batches, answers):
            if isinstance(answer, RemotingError):
                if isinstance(answer, ConnectionFailedError):
                    self._broker_failed(b.queue[0], b.topic)
                _fail(out, [b], answer)
                continue
            status = _STORED.get(answer.code)
            if status is None:
                err = error_for_code(answer.code, answer.remark, f"broker {b.queue[0]} ({conn.addr}) for {b.topic}")
                if err.retriable or isinstance(err, TopicNotFoundError):
                    self._mark_stale(b.topic)
                _fail(out, [b], err)
                continue
            try:
                queue_id = int(answer.ext.get("queueId", b.queue[1]))
                first = int(answer.ext.get("queueOffset", -1))
            except ValueError:
                queue_id, first = b.queue[1], -1
            for k, (i, msg_id) in enumerate(zip(b.index, b.ids)):
                out[i] = Receipt(msg_id, b.topic, b.queue[0], queue_id, first + k if first >= 0 else -1, status)

    def _header(self, b: _Batch, born: str) -> dict[str, str]:
        """SendMessageRequestHeaderV2 of a batch (see the module docstring)."""
        return {
            "a": self.group,
            "b": b.topic,
            "c": DEFAULT_TOPIC,
            "d": str(DEFAULT_TOPIC_QUEUES),
            "e": str(b.queue[1]),
            "f": "0",
            "g": born,
            "h": "0",
            # The batch's own properties, as the Java client's MessageBatch has them; the broker
            # stores each message with its own properties only.
            "i": join_properties({_WAIT: "true"}),
            "j": "0",
            "k": "false",
            "m": "true",
            "n": b.queue[0],
        }

    # -- routes --

    def route(self, topic: str) -> TopicRoute:
        """The topic's route: cached, looked up when missing, stale or older than `route_ttl_s`."""
        return self._route(topic)

    def _route(self, topic: str) -> TopicRoute:
        now = time.monotonic()
        with self._lock:
            cached = self._routes.get(topic)
            ttl = self.route_retry_s if cached is not None and cached.via_default_topic else self.route_ttl_s
            due = cached is None or topic in self._stale or now - cached.fetched >= ttl
            if not due or (cached is not None and now - self._route_tried.get(topic, 0.0) < self.route_retry_s):
                assert cached is not None
                return cached
            self._route_tried[topic] = now
        try:
            route = self._lookup(topic)
        except RemotingError as e:
            # NameServer unreachable, or it dropped the route of a broker that went down: the last
            # route is the best guess, and that broker's connection tells the truth.
            keep = cached is not None and (
                e.retriable or (isinstance(e, TopicNotFoundError) and not cached.via_default_topic))
            if not keep:
                raise
            assert cached is not None
            log.debug("route look-up of %s failed (%s); keeping the last route", topic, e)
            return cached
        with self._lock:
            self._routes[topic] = route
            self._stale.discard(topic)
        return route

    def _lookup(self, topic: str) -> TopicRoute:
        """Ask the NameServer; fall back to the default topic's route when allowed."""
        data = self.route_document(topic)
        if data is not None:
            route = _parse_route(topic, data)
            if not route.queues:
                raise TopicNotFoundError(f"topic {topic} has no writable queue on any master broker",
                                         code=TOPIC_NOT_EXIST)
            return route
        if self.auto_create_topics:
            default = self.route_document(DEFAULT_TOPIC)
            if default is not None:
                route = _parse_route(topic, default, via_default_topic=True, max_queues=DEFAULT_TOPIC_QUEUES)
                if route.queues:
                    return route
        raise TopicNotFoundError(
            f"topic {topic} does not exist: the NameServer has no route for it"
            + (" and the brokers do not create topics on first send (autoCreateTopicEnable)" if self.auto_create_topics
               else ""), code=TOPIC_NOT_EXIST)

    def route_document(self, topic: str) -> dict[str, Any] | None:
        """The NameServer's TopicRouteData for `topic`, or None if it has none."""
        ext = {"topic": topic, "acceptStandardJsonOnly": "true"}
        errors: list[str] = []
        with self._namesrv_lock:
            for _ in range(len(self.namesrv_addrs)):
                try:
                    if self._namesrv is None or not self._namesrv.alive():
                        addr = self.namesrv_addrs[self._namesrv_next % len(self.namesrv_addrs)]
                        self._namesrv = Connection(addr, self.timeout)
                    resp = self._namesrv.request(GET_ROUTEINFO_BY_TOPIC, ext, b"", time.monotonic() + self.timeout)
                except (ConnectionFailedError, RequestTimeoutError, ProtocolError) as e:
                    errors.append(str(e))
                    if self._namesrv is not None:
                        self._namesrv.close()
                    self._namesrv = None
                    self._namesrv_next += 1
                    continue
                if resp.code == TOPIC_NOT_EXIST:
                    return None
                if resp.code != SUCCESS:
                    raise error_for_code(resp.code, resp.remark, f"NameServer {self._namesrv.addr}")
                try:
                    data: dict[str, Any] = json.loads(resp.body)
                except ValueError as e:
                    raise ProtocolError(f"route of {topic} from {self._namesrv.addr} is not JSON: {e}") from e
                return data
        raise ConnectionFailedError(f"no NameServer answered for {topic}: {'; '.join(errors)}")

    def _mark_stale(self, topic: str) -> None:
        with self._lock:
            self._stale.add(topic)

    # -- connections --

    def _connection(self, broker: str, addr: str) -> Connection:
        """The live connection to `addr`, opened (again) if needed, unless the broker failed moments ago."""
        with self._lock:
            conn = self._conns.get(addr)
            if conn is not None and conn.alive():
                return conn
            if time.monotonic() < self._down_until.get(broker, 0.0):
                # Connecting to a dead host can take the whole timeout: not again at once.
                raise ConnectionFailedError(f"broker {broker} at {addr} failed moments ago")
        try:
            fresh = Connection(addr, self.timeout)
        except ConnectionFailedError:
            with self._lock:
                self._down_until[broker] = time.monotonic() + self.broker_backoff_s
            raise
        with self._lock:
            if self._closed:
                fresh.close()
                raise ConnectionFailedError("the producer is closed")
            self._conns[addr] = fresh
        if conn is not None:
            log.info("reconnected to broker %s at %s", broker, addr)
        return fresh

    def _broker_failed(self, broker: str, topic: str) -> None:
        """Avoid the broker for a moment and look the topic's route up again before its next use."""
        with self._lock:
            self._down_until[broker] = time.monotonic() + self.broker_backoff_s
            self._stale.add(topic)

    def _id_maker(self) -> _IdMaker:
        """Ids carry this host's address as the brokers see it (taken from the NameServer connection)."""
        if self._ids is None:
            ip = b"\x7f\x00\x00\x01"
            with self._namesrv_lock:
                if self._namesrv is not None and not self._namesrv.closed:
                    try:
                        ip = socket.inet_aton(self._namesrv.local_ip)
                    except OSError:
                        pass  # not IPv4: keep loopback's, the id stays well-formed
            self._ids = _IdMaker(ip)
        return self._ids

    def close(self) -> None:
        """Close every connection; sends afterwards fail."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            with c.lock:
                c.close()
        with self._namesrv_lock:
            if self._namesrv is not None:
                self._namesrv.close()
                self._namesrv = None

    def __enter__(self) -> RemotingProducer:
        """Return self."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close."""
        self.close()


def _parse_route(topic: str, data: dict[str, Any], **options: Any) -> TopicRoute:
    """TopicRoute.parse, with a route document of an unexpected shape as a ProtocolError."""
    try:
        return TopicRoute.parse(topic, data, time.monotonic(), **options)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(f"the NameServer's route of {topic} has an unexpected shape: {e!r}") from e


def _fail(out: list[Receipt | RemotingError | None], batches: Iterable[_Batch], error: RemotingError) -> None:
    """Every message of the batches gets `error`."""
    for b in batches:
        for i in b.index:
            out[i] = error
