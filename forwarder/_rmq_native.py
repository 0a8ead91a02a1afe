"""Typed ctypes bindings for what rocketmq-client-python 0.5.0rc2's wrapper leaves out.

The wheel bundles `librocketmq.so` built from rocketmq-client-cpp's 1.2.4 code line (C API in its
`include/C*.h`). Its Python wrapper sends one message at a time, reads bodies and properties as
NUL-terminated strings, and cannot list a received message's properties. This module adds:

- `NativeProducer`: sync send with binary bodies, and `SendAsync` with completion callbacks and
  a bound on messages in flight. `SendBatchMessage` is bound but private: against a Java broker
  this client's batches are stored as one single message (see `NativeProducer._send_batch`);
- `NativePushConsumer`: a push consumer with thread count, per-queue cache and batch size set,
  handing the callback a `ReceivedMessage` (binary-safe body, every property);
- `read_message()` / `message_body()` / `message_properties()` for any received message handle
  (a `rocketmq.client.RecvMessage` included).

ctypes releases the GIL during every foreign call here, so sends from several threads run in
parallel; callbacks from the library's threads take the GIL back for the Python part only.

Two reads go past the C API, because it has no call for them: the body (`GetMessageBody` stops at
the first NUL byte) and the full property map (only single look-ups exist). Both call exported C++
members of `rocketmq::MQMessage` of this exact build (old-ABI, copy-on-write `std::string`), and
the property map is found at an offset checked against the map's own invariants before first use;
a build that does not match raises `NativeLayoutError` instead of reading garbage.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from ctypes import POINTER, Structure, c_char, c_char_p, c_int, c_longlong, c_size_t, c_void_p
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from rocketmq import ffi as _wrapper_ffi

from forwarder.errors import NativeClientError, NativeLayoutError, SendError

__all__ = [
    "LIBRARY_PATH",
    "ConsumeCallback",
    "LogLevel",
    "NativeProducer",
    "NativePushConsumer",
    "OutgoingMessage",
    "ReceivedMessage",
    "SendCallback",
    "SendResult",
    "SendStatus",
    "SYSTEM_PROPERTIES",
    "message_body",
    "message_properties",
    "read_message",
    "user_properties",
]

_log = logging.getLogger(__name__)

#: The shared library these bindings call (the one bundled with the wrapper's wheel).
LIBRARY_PATH: str = _wrapper_ffi._DYLIB_PATH

# A CDLL of our own over the same loaded library: the function objects (and so their argtypes)
# are separate from the wrapper's, whose prototypes for the async callbacks are wrong.
_lib = ctypes.CDLL(LIBRARY_PATH)

# -- C types (CCommon.h, CSendResult.h, CMQException.h) ---------------------------------------

_MAX_MESSAGE_ID_LENGTH = 256


class _CSendResult(Structure):
    """CSendResult: status, client message id (UNIQ_KEY), queue offset."""

    _fields_ = [("sendStatus", c_int), ("msgId", c_char * _MAX_MESSAGE_ID_LENGTH), ("offset", c_longlong)]


class _CMQException(Structure):
    """CMQException as the 1.2.x headers define it (the wrapper's copy has wrong field sizes)."""

    _fields_ = [
        ("error", c_int),
        ("line", c_int),
        ("file", c_char * 256),
        ("msg", c_char * 512),
        ("type", c_char * 128),
    ]


class SendStatus(enum.IntEnum):
    """CSendStatus: how the broker stored a message that it accepted."""

    OK = 0
    FLUSH_DISK_TIMEOUT = 1
    FLUSH_SLAVE_TIMEOUT = 2
    SLAVE_NOT_AVAILABLE = 3


class LogLevel(enum.IntEnum):
    """CLogLevel of the client's own log (written under ~/logs/rocketmq-cpp/)."""

    FATAL = 1
    ERROR = 2
    WARN = 3
    INFO = 4
    DEBUG = 5
    TRACE = 6


class _Model(enum.IntEnum):
    """CMessageModel."""

    BROADCASTING = 0
    CLUSTERING = 1


_OK = 0
_CONSUME_SUCCESS = 0
_RECONSUME_LATER = 1

# Callback types: by-value structs, as the C headers declare them.
_ON_SEND_SUCCESS = ctypes.CFUNCTYPE(None, _CSendResult, c_void_p, c_void_p)
_ON_SEND_EXCEPTION = ctypes.CFUNCTYPE(None, _CMQException, c_void_p, c_void_p)
_ON_MESSAGE = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p)


def _proto(name: str, restype: Any, *argtypes: Any) -> Any:
    """Fetch one exported function and declare its prototype; fail loudly if it is missing."""
    try:
        fn = getattr(_lib, name)
    except AttributeError as e:
        raise NativeLayoutError(f"{LIBRARY_PATH} does not export {name}") from e
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


# CMessage.h
_CreateMessage = _proto("CreateMessage", c_void_p, c_char_p)
_DestroyMessage = _proto("DestroyMessage", c_int, c_void_p)
_SetMessageTags = _proto("SetMessageTags", c_int, c_void_p, c_char_p)
_SetMessageKeys = _proto("SetMessageKeys", c_int, c_void_p, c_char_p)
_SetByteMessageBody = _proto("SetByteMessageBody", c_int, c_void_p, c_char_p, c_int)
_SetMessageProperty = _proto("SetMessageProperty", c_int, c_void_p, c_char_p, c_char_p)
# CBatchMessage.h
_CreateBatchMessage = _proto("CreateBatchMessage", c_void_p)
_AddMessage = _proto("AddMessage", c_int, c_void_p, c_void_p)
_DestroyBatchMessage = _proto("DestroyBatchMessage", c_int, c_void_p)
# CProducer.h
_CreateProducer = _proto("CreateProducer", c_void_p, c_char_p)
_StartProducer = _proto("StartProducer", c_int, c_void_p)
_ShutdownProducer = _proto("ShutdownProducer", c_int, c_void_p)
_SetProducerNameServerAddress = _proto("SetProducerNameServerAddress", c_int, c_void_p, c_char_p)
_SetProducerInstanceName = _proto("SetProducerInstanceName", c_int, c_void_p, c_char_p)
_SetProducerSendMsgTimeout = _proto("SetProducerSendMsgTimeout", c_int, c_void_p, c_int)
_SetProducerCompressLevel = _proto("SetProducerCompressLevel", c_int, c_void_p, c_int)
_SetProducerMaxMessageSize = _proto("SetProducerMaxMessageSize", c_int, c_void_p, c_int)
_SetProducerLogLevel = _proto("SetProducerLogLevel", c_int, c_void_p, c_int)
_SendMessageSync = _proto("SendMessageSync", c_int, c_void_p, c_void_p, POINTER(_CSendResult))
_SendBatchMessage = _proto("SendBatchMessage", c_int, c_void_p, c_void_p, POINTER(_CSendResult))
_SendAsync = _proto("SendAsync", c_int, c_void_p, c_void_p, _ON_SEND_SUCCESS, _ON_SEND_EXCEPTION, c_void_p)
# CPushConsumer.h
_CreatePushConsumer = _proto("CreatePushConsumer", c_void_p, c_char_p)
_DestroyPushConsumer = _proto("DestroyPushConsumer", c_int, c_void_p)
_StartPushConsumer = _proto("StartPushConsumer", c_int, c_void_p)
_ShutdownPushConsumer = _proto("ShutdownPushConsumer", c_int, c_void_p)
_SetPushConsumerNameServerAddress = _proto("SetPushConsumerNameServerAddress", c_int, c_void_p, c_char_p)
_SetPushConsumerInstanceName = _proto("SetPushConsumerInstanceName", c_int, c_void_p, c_char_p)
_SetPushConsumerMessageModel = _proto("SetPushConsumerMessageModel", c_int, c_void_p, c_int)
_SetPushConsumerThreadCount = _proto("SetPushConsumerThreadCount", c_int, c_void_p, c_int)
_SetPushConsumerMessageBatchMaxSize = _proto("SetPushConsumerMessageBatchMaxSize", c_int, c_void_p, c_int)
_SetPushConsumerMaxCacheMessageSize = _proto("SetPushConsumerMaxCacheMessageSize", c_int, c_void_p, c_int)
_SetPushConsumerLogLevel = _proto("SetPushConsumerLogLevel", c_int, c_void_p, c_int)
_Subscribe = _proto("Subscribe", c_int, c_void_p, c_char_p, c_char_p)
_RegisterMessageCallback = _proto("RegisterMessageCallback", c_int, c_void_p, _ON_MESSAGE)
_RegisterMessageCallbackOrderly = _proto("RegisterMessageCallbackOrderly", c_int, c_void_p, _ON_MESSAGE)
# CMessageExt.h
_GetMessageTopic = _proto("GetMessageTopic", c_char_p, c_void_p)
_GetMessageTags = _proto("GetMessageTags", c_char_p, c_void_p)
_GetMessageKeys = _proto("GetMessageKeys", c_char_p, c_void_p)
_GetMessageProperty = _proto("GetMessageProperty", c_char_p, c_void_p, c_char_p)
_GetMessageId = _proto("GetMessageId", c_char_p, c_void_p)
_GetMessageQueueId = _proto("GetMessageQueueId", c_int, c_void_p)
_GetMessageReconsumeTimes = _proto("GetMessageReconsumeTimes", c_int, c_void_p)
_GetMessageBornTimestamp = _proto("GetMessageBornTimestamp", c_longlong, c_void_p)
_GetMessageStoreTimestamp = _proto("GetMessageStoreTimestamp", c_longlong, c_void_p)
_GetMessageQueueOffset = _proto("GetMessageQueueOffset", c_longlong, c_void_p)
_GetMessageCommitLogOffset = _proto("GetMessageCommitLogOffset", c_longlong, c_void_p)
# CErrorMessage.h: the message of the calling thread's last failure (thread-local in the library).
_GetLatestErrorMessage = _proto("GetLatestErrorMessage", c_char_p)

# C++ members used past the C API (see the module docstring). Old-ABI mangled names.
_MQMessage_getBody = _proto("_ZNK8rocketmq9MQMessage7getBodyEv", c_void_p, c_void_p)
_MQDecoder_properties2String = _proto(
    "_ZN8rocketmq9MQDecoder24messageProperties2StringERKSt3mapISsSsSt4lessISsESaISt4pairIKSsSsEEE",
    c_void_p,
    c_void_p,  # hidden pointer to the std::string the function constructs (returned by value)
    c_void_p,  # const std::map<std::string, std::string>&
)
_string_destructor = _proto("_ZNSsD1Ev", None, c_void_p)  # std::string::~string() (old ABI)

# rocketmq::MQDecoder's separators inside the serialized property string.
_NAME_VALUE_SEPARATOR = "\x01"
_PROPERTY_SEPARATOR = "\x02"


def _last_error() -> str:
    """Return the library's last error message on this thread ("" if none)."""
    raw = _GetLatestErrorMessage()
    return raw.decode("utf-8", errors="replace") if raw else ""


def _check(status: int, what: str) -> None:
    """Raise NativeClientError unless `status` is OK."""
    if status != _OK:
        raise NativeClientError(f"{what} failed (status {status}): {_last_error() or 'no detail'}", status=status)


def _text(value: str, what: str) -> bytes:
    """Encode a C string argument, refusing NUL (the library would cut the value there)."""
    raw = value.encode("utf-8")
    if b"\x00" in raw:
        raise ValueError(f"{what} contains a NUL character: {value!r}")
    return raw


# -- reading std::string / std::map of this build ------------------------------------------------

# Old-ABI std::string is one pointer to its characters; the length is stored 24 bytes before them
# (in the copy-on-write _Rep header: length, capacity, refcount).
_COW_LENGTH_OFFSET = 24


def _read_std_string(addr: int) -> bytes:
    """Return the bytes of the old-ABI std::string object at `addr`."""
    data = c_void_p.from_address(addr).value
    if not data:
        return b""
    length = c_size_t.from_address(data - _COW_LENGTH_OFFSET).value
    return ctypes.string_at(data, length)


class _MessageLayout:
    """Where MQMessage keeps its property map in this build, found once and checked on each use."""

    def __init__(self) -> None:
        self._props_offset: int | None = None
        self._lock = threading.Lock()

    def properties_address(self, handle: int) -> int:
        """Return the address of the message's std::map of properties."""
        offset = self._props_offset
        if offset is None:
            offset = self._discover(handle)
        addr = handle + offset
        if not self._looks_like_map(addr):
            raise NativeLayoutError("a received message's property map failed its layout check")
        return addr

    def _discover(self, handle: int) -> int:
        """Locate the map: after m_body come m_transactionId (in some builds) and m_properties."""
        with self._lock:
            if self._props_offset is not None:
                return self._props_offset
            body_offset = _MQMessage_getBody(handle) - handle
            if not 0 < body_offset < 256:
                raise NativeLayoutError(f"unexpected MQMessage layout (body at offset {body_offset})")
            for offset in (body_offset + 16, body_offset + 8):
                if self._looks_like_map(handle + offset) and self._agrees(handle, handle + offset):
                    self._props_offset = offset
                    return offset
            raise NativeLayoutError("cannot find MQMessage's property map in this build of librocketmq")

    @staticmethod
    def _looks_like_map(addr: int) -> bool:
        """Check libstdc++ _Rb_tree header invariants at `addr` (+8: header node, +40: size)."""
        header = addr + 8
        parent = c_void_p.from_address(header + 8).value
        left = c_void_p.from_address(header + 16).value
        right = c_void_p.from_address(header + 24).value
        count = c_size_t.from_address(header + 32).value
        if count == 0:
            return not parent and left == header and right == header
        # A non-empty tree's root points back at the header; the leftmost/rightmost are set.
        return bool(parent and left and right) and c_void_p.from_address(parent + 8).value == header

    @staticmethod
    def _agrees(handle: int, map_addr: int) -> bool:
        """Cross-check one property read through the map against the C API's look-up."""
        props = _properties_at(map_addr)
        for name, value in props.items():
            got = _GetMessageProperty(handle, name.encode("utf-8"))
            return got is not None and got.decode("utf-8", errors="replace") == value
        return True


_LAYOUT = _MessageLayout()


def _properties_at(map_addr: int) -> dict[str, str]:
    """Serialize the map with the library's own MQDecoder and split it back into a dict."""
    # Room for the returned std::string object (one pointer); the function constructs it there.
    slot = (c_char * 16)()
    slot_addr = ctypes.addressof(slot)
    _MQDecoder_properties2String(slot_addr, map_addr)
    try:
        raw = _read_std_string(slot_addr)
    finally:
        _string_destructor(slot_addr)
    return split_properties(raw.decode("utf-8", errors="replace"))


def join_properties(props: Mapping[str, str]) -> str:
    """Properties serialized as RocketMQ carries them (name \\x01 value \\x02, repeated)."""
    return "".join([f"{k}{_NAME_VALUE_SEPARATOR}{v}{_PROPERTY_SEPARATOR}" for k, v in props.items()])


def split_properties(text: str) -> dict[str, str]:
    """RocketMQ's serialized properties (name \\x01 value \\x02, repeated) as a dict."""
    props: dict[str, str] = {}
    for pair in text.split(_PROPERTY_SEPARATOR):
        if pair:
            name, _, value = pair.partition(_NAME_VALUE_SEPARATOR)
            props[name] = value
    return props


class _HasHandle(Protocol):
    """Anything carrying a native message handle, as the wrapper's RecvMessage does."""

    _handle: int


def _handle_of(msg: int | _HasHandle) -> int:
    """Return the CMessageExt* of a handle or of a wrapper RecvMessage."""
    return msg if isinstance(msg, int) else int(msg._handle)


def message_body(msg: int | _HasHandle) -> bytes:
    """Return a received message's body, NUL bytes included (GetMessageBody stops at the first)."""
    return _read_std_string(_MQMessage_getBody(_handle_of(msg)))


def message_properties(msg: int | _HasHandle) -> dict[str, str]:
    """Return every property of a received message, system ones (UNIQ_KEY, KEYS, TAGS...) included."""
    handle = _handle_of(msg)
    return _properties_at(_LAYOUT.properties_address(handle))


#: Property names RocketMQ reserves (org.apache.rocketmq.common.message.MessageConst, 5.3.3).
#: A received message carries several (UNIQ_KEY, KEYS, TAGS, WAIT, CLUSTER, MSG_REGION, TRACE_ON...);
#: copying them onto a new message would be wrong, and TIMER_* or DELAY would delay it again.
SYSTEM_PROPERTIES: frozenset[str] = frozenset(
    "KEYS TAGS WAIT DELAY RETRY_TOPIC REAL_TOPIC REAL_QID TRAN_MSG PGROUP MIN_OFFSET MAX_OFFSET BUYER_ID "
    "ORIGIN_MESSAGE_ID TRANSFER_FLAG CORRECTION_FLAG MQ2_FLAG RECONSUME_TIME MSG_REGION TRACE_ON UNIQ_KEY "
    "EXTEND_UNIQ_INFO MAX_RECONSUME_TIMES CONSUME_START_TIME INNER_NUM INNER_BASE "
    "CHECK_IMMUNITY_TIME_IN_SECONDS TRAN_PREPARED_QUEUE_OFFSET __transactionId__ TRANSACTION_CHECK_TIMES "
    "INSTANCE_ID CORRELATION_ID REPLY_TO_CLIENT TTL ARRIVE_TIME PUSH_REPLY_TIME CLUSTER MSG_TYPE POP_CK "
    "POP_CK_OFFSET 1ST_POP_TIME __SHARDINGKEY PROPERTY_FORWARD_QUEUE_ID REDIRECT INNER_MULTI_DISPATCH "
    "INNER_MULTI_QUEUE_OFFSET TRACE_CONTEXT TIMER_DELAY_SEC TIMER_DELIVER_MS __BORNHOST BORN_TIMESTAMP "
    "TIMER_ENQUEUE_MS TIMER_DEQUEUE_MS TIMER_ROLL_TIMES TIMER_OUT_MS TIMER_DEL_UNIQKEY TIMER_DELAY_LEVEL "
    "TIMER_DELAY_MS __CRC32# DLQ_ORIGIN_TOPIC DLQ_ORIGIN_MESSAGE_ID".split()
)
_TRANSIENT_PREFIX = "__RMQ.TRANSIENT."


def user_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """Return the properties a producer set itself: everything but RocketMQ's reserved names."""
    return {
        k: v for k, v in properties.items() if k not in SYSTEM_PROPERTIES and not k.startswith(_TRANSIENT_PREFIX)
    }


def _decode(raw: bytes | None) -> str:
    """Decode a C string from the library ('' for NULL)."""
    return raw.decode("utf-8", errors="replace") if raw else ""


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """A message as a consumer received it, copied out of the library's memory."""

    topic: str
    body: bytes
    tags: str
    keys: str
    msg_id: str  # the producer's UNIQ_KEY (32 hex digits); the broker's offset id if absent
    properties: dict[str, str]  # all of them, system properties included
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    reconsume_times: int
    born_timestamp: int  # epoch ms, producer clock
    store_timestamp: int  # epoch ms, broker clock


def read_message(msg: int | _HasHandle) -> ReceivedMessage:
    """Copy a received message (a CMessageExt* or a wrapper RecvMessage) into a ReceivedMessage."""
    h = _handle_of(msg)
    return ReceivedMessage(
        topic=_decode(_GetMessageTopic(h)),
        body=message_body(h),
        tags=_decode(_GetMessageTags(h)),
        keys=_decode(_GetMessageKeys(h)),
        msg_id=_decode(_GetMessageId(h)),
        properties=message_properties(h),
        queue_id=_GetMessageQueueId(h),
        queue_offset=_GetMessageQueueOffset(h),
        commit_log_offset=_GetMessageCommitLogOffset(h),
        reconsume_times=_GetMessageReconsumeTimes(h),
        born_timestamp=_GetMessageBornTimestamp(h),
        store_timestamp=_GetMessageStoreTimestamp(h),
    )


# -- producer -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """A message to send: topic, binary body, optional tags, keys and user properties."""

    topic: str
    body: bytes
    tags: str | None = None
    keys: str | None = None  # several keys separated by spaces, as RocketMQ indexes them
    properties: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SendResult:
    """What the broker answered to a send: status, the message's UNIQ_KEY, its queue offset."""

    status: SendStatus
    msg_id: str
    queue_offset: int


#: Called once per async send, from a library thread: (result, None) or (None, error).
SendCallback = Callable[[SendResult | None, SendError | None], None]


def _build(msg: OutgoingMessage) -> int:
    """Create a native CMessage for `msg`; the caller destroys it."""
    handle = _CreateMessage(_text(msg.topic, "topic"))
    if not handle:
        raise NativeClientError("CreateMessage returned NULL")
    try:
        if msg.tags:
            _check(_SetMessageTags(handle, _text(msg.tags, "tags")), "SetMessageTags")
        if msg.keys:
            _check(_SetMessageKeys(handle, _text(msg.keys, "keys")), "SetMessageKeys")
        for name, value in msg.properties.items():
            _check(_SetMessageProperty(handle, _property_text(name), _property_text(value)), "SetMessageProperty")
        _check(_SetByteMessageBody(handle, msg.body, len(msg.body)), "SetByteMessageBody")
    except BaseException:
        _DestroyMessage(handle)
        raise
    return handle


def _property_text(value: str) -> bytes:
    """Encode a property name or value, refusing the bytes RocketMQ's property encoding reserves."""
    raw = _text(value, "property")
    # Properties travel as name\x01value\x02...: these two bytes would split or drop properties.
    if b"\x01" in raw or b"\x02" in raw:
        raise ValueError(f"property text contains \\x01 or \\x02, which RocketMQ cannot carry: {value!r}")
    return raw


def _result(c: _CSendResult) -> SendResult:
    """Convert a CSendResult."""
    return SendResult(SendStatus(c.sendStatus), c.msgId.decode("ascii", errors="replace"), c.offset)


class NativeProducer:
    """A RocketMQ producer with sync, batch and async sends of binary messages."""

    def __init__(
        self,
        group: str,
        namesrv_addr: str,
        *,
        send_timeout_ms: int = 3000,
        max_message_size: int = 4 * 1024 * 1024,
        compress_level: int | None = None,
        instance_name: str | None = None,
        log_level: LogLevel | None = None,
        max_inflight: int = 2048,
    ) -> None:
        """Create (not start) a producer; `max_inflight` bounds async sends awaiting an answer."""
        handle = _CreateProducer(_text(group, "group"))
        if not handle:
            raise NativeClientError("CreateProducer returned NULL")
        self._handle: int | None = handle
        self._started = False
        _check(_SetProducerNameServerAddress(handle, _text(namesrv_addr, "namesrv_addr")), "set namesrv")
        _check(_SetProducerSendMsgTimeout(handle, send_timeout_ms), "set send timeout")
        # The client's own limit defaults to 128 KiB (the broker's is 4 MiB).
        _check(_SetProducerMaxMessageSize(handle, max_message_size), "set max message size")
        if compress_level is not None:
            _check(_SetProducerCompressLevel(handle, compress_level), "set compress level")
        if instance_name is not None:
            _check(_SetProducerInstanceName(handle, _text(instance_name, "instance_name")), "set instance")
        if log_level is not None:
            _check(_SetProducerLogLevel(handle, int(log_level)), "set log level")
        # Async bookkeeping: token -> callback. The token travels as the C call's userData.
        self._pending: dict[int, SendCallback] = {}
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._next_token = 1
        # The C function pointers must outlive every send that may still call them back.
        self._on_success = _ON_SEND_SUCCESS(self._async_success)
        self._on_exception = _ON_SEND_EXCEPTION(self._async_exception)

    # lifecycle

    def start(self) -> None:
        """Start the producer (connects lazily: the first send of a topic looks up its route)."""
        _check(_StartProducer(self._require()), "StartProducer")
        self._started = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` for async sends in flight, then stop and free the producer."""
        if self._handle is None:
            return
        self.flush(timeout)
        handle, self._handle = self._handle, None
        # DestroyProducer is not called: in this build it deletes its wrapper struct through a
        # DefaultMQProducer pointer and crashes the process. A producer object is leaked instead.
        if self._started:
            _check(_ShutdownProducer(handle), "ShutdownProducer")

    def __enter__(self) -> NativeProducer:
        """Start and return self."""
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Shut down."""
        self.shutdown()

    def _require(self) -> int:
        """Return the native handle, or raise once shut down."""
        if self._handle is None:
            raise NativeClientError("the producer is shut down")
        return self._handle

    # sends

    def send(self, msg: OutgoingMessage) -> SendResult:
        """Send one message and wait for the broker's answer (retried by the client, up to 5 times)."""
        handle = self._require()
        cmsg = _build(msg)
        try:
            result = _CSendResult()
            status = _SendMessageSync(handle, cmsg, ctypes.byref(result))
            if status != _OK:
                raise SendError(f"send to {msg.topic} failed: {_last_error() or 'no detail'}", status=status)
            return _result(result)
        finally:
            _DestroyMessage(cmsg)

    def _send_batch(self, msgs: Sequence[OutgoingMessage]) -> SendResult:
        """SendBatchMessage, kept only to measure and demonstrate it: do not use it to deliver.

        This client marks a batch with the header field batch="1", which a Java broker parses as
        false: the broker stores the whole encoded batch as ONE message (its body is the batch
        encoding, its own tags/keys/properties are lost). The result's msg_id is empty.
        """
        handle = self._require()
        if not msgs:
            raise ValueError("a batch needs at least one message")
        topic = msgs[0].topic
        if any(m.topic != topic for m in msgs):
            raise ValueError("all messages of a batch must have the same topic")
        batch = _CreateBatchMessage()
        if not batch:
            raise NativeClientError("CreateBatchMessage returned NULL")
        try:
            for msg in msgs:
                cmsg = _build(msg)
                try:
                    # AddMessage copies the message into the batch.
                    _check(_AddMessage(batch, cmsg), "AddMessage")
                finally:
                    _DestroyMessage(cmsg)
            result = _CSendResult()
            status = _SendBatchMessage(handle, batch, ctypes.byref(result))
            if status != _OK:
                # SendBatchMessage records no error text: the thread's last message is stale.
                raise SendError(f"batch send of {len(msgs)} messages to {topic} failed", status=status)
            return _result(result)
        finally:
            _DestroyBatchMessage(batch)

    def send_async(self, msg: OutgoingMessage, callback: SendCallback) -> None:
        """Send without waiting; `callback` runs once, on a library thread, with the outcome.

        Blocks while `max_inflight` sends await their answer. The client retries an async send
        only on the same broker, once; callbacks must be quick (they hold the client's I/O thread).
        """
        handle = self._require()
        cmsg = _build(msg)
        self._slots.acquire()
        with self._pending_lock:
            token = self._next_token
            self._next_token += 1
            self._pending[token] = callback
        try:
            status = _SendAsync(handle, cmsg, self._on_success, self._on_exception, c_void_p(token))
        except BaseException:
            self._complete(token, None, SendError(f"async send to {msg.topic} was interrupted"))
            raise
        finally:
            # The request is encoded and the client keeps its own copy of the message.
            _DestroyMessage(cmsg)
        if status != _OK:
            # The library may already have reported this failure through the exception callback;
            # _complete() runs a callback once only.
            detail = _last_error() or "no detail"
            self._complete(token, None, SendError(f"async send to {msg.topic} failed: {detail}", status=status))

    @property
    def inflight(self) -> int:
        """Async sends still waiting for their answer."""
        with self._pending_lock:
            return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no async send is in flight; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _async_success(self, result: _CSendResult, _msg: int | None, token: int | None) -> None:
        """Library callback: an async send was stored."""
        self._complete(token or 0, _result(result), None)

    def _async_exception(self, exc: _CMQException, _msg: int | None, token: int | None) -> None:
        """Library callback: an async send failed."""
        detail = exc.msg.decode("utf-8", errors="replace") or "no detail"
        self._complete(token or 0, None, SendError(f"async send failed: {detail}", status=exc.error))

    def _complete(self, token: int, result: SendResult | None, error: SendError | None) -> None:
        """Run the callback of `token` once and free its slot."""
        with self._pending_lock:
            callback = self._pending.pop(token, None)
            if callback is None:
                return
            if not self._pending:
                self._idle.notify_all()
        self._slots.release()
        try:
            callback(result, error)
        except Exception:
            # An exception must not unwind into the library's thread.
            _log.exception("send callback failed")


# -- push consumer --------------------------------------------------------------------------------

#: Called for each message; True acknowledges it, False (or an exception) asks for redelivery.
ConsumeCallback = Callable[[ReceivedMessage], bool]


class NativePushConsumer:
    """A push consumer (clustering) whose callback receives complete `ReceivedMessage`s.

    The library hands a pulled batch (up to 32 messages per queue) to one consume thread, one
    message at a time; a failure sends that message and the rest of the batch back for retry
    (`%RETRY%<group>`), the ones already acknowledged stay done.
    """

    def __init__(
        self,
        group: str,
        namesrv_addr: str,
        on_message: ConsumeCallback,
        *,
        thread_count: int | None = None,
        max_cache_per_queue: int | None = None,
        batch_max_size: int | None = None,
        orderly: bool = False,
        broadcasting: bool = False,
        instance_name: str | None = None,
        log_level: LogLevel | None = None,
    ) -> None:
        """Create (not start) a consumer; subscribe() before start()."""
        handle = _CreatePushConsumer(_text(group, "group"))
        if not handle:
            raise NativeClientError("CreatePushConsumer returned NULL")
        self._handle: int | None = handle
        self._started = False
        self._on_message = on_message
        _check(_SetPushConsumerNameServerAddress(handle, _text(namesrv_addr, "namesrv_addr")), "set namesrv")
        model = _Model.BROADCASTING if broadcasting else _Model.CLUSTERING
        _check(_SetPushConsumerMessageModel(handle, int(model)), "set message model")
        if thread_count is not None:
            # Default: the number of CPUs. Each thread runs the Python callback under the GIL.
            _check(_SetPushConsumerThreadCount(handle, thread_count), "set thread count")
        if max_cache_per_queue is not None:
            # Default 1000 messages per queue before pulling pauses.
            _check(_SetPushConsumerMaxCacheMessageSize(handle, max_cache_per_queue), "set max cache")
        if batch_max_size is not None:
            # Honoured by the orderly consumer only: the concurrent one always hands over the
            # whole pulled batch, one message per callback.
            _check(_SetPushConsumerMessageBatchMaxSize(handle, batch_max_size), "set batch size")
        if instance_name is not None:
            _check(_SetPushConsumerInstanceName(handle, _text(instance_name, "instance_name")), "set instance")
        if log_level is not None:
            _check(_SetPushConsumerLogLevel(handle, int(log_level)), "set log level")
        self._callback = _ON_MESSAGE(self._dispatch)  # kept alive as long as the consumer
        register = _RegisterMessageCallbackOrderly if orderly else _RegisterMessageCallback
        _check(register(handle, self._callback), "register callback")

    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Subscribe to `topic` (tags expression like "a || b", or "*"); call before start()."""
        _check(_Subscribe(self._require(), _text(topic, "topic"), _text(expression, "expression")), "Subscribe")

    def start(self) -> None:
        """Start pulling; the callback then runs on the library's consume threads."""
        _check(_StartPushConsumer(self._require()), "StartPushConsumer")
        self._started = True

    def shutdown(self, *, destroy: bool = True) -> None:
        """Stop pulling, persist offsets and (unless `destroy` is False) free the consumer.

        A long-running service leaves `destroy` False: under load a consume thread can still be
        returning from its callback when the library frees the consumer, and the process aborts
        ("mutex lock failed"); the consumer object is leaked instead, once, at exit.
        """
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        try:
            if self._started:
                _check(_ShutdownPushConsumer(handle), "ShutdownPushConsumer")
        finally:
            if destroy:
                _DestroyPushConsumer(handle)

    def __enter__(self) -> NativePushConsumer:
        """Start and return self."""
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Shut down."""
        self.shutdown()

    def _require(self) -> int:
        """Return the native handle, or raise once shut down."""
        if self._handle is None:
            raise NativeClientError("the consumer is shut down")
        return self._handle

    def _dispatch(self, _consumer: int | None, msg: int | None) -> int:
        """Library callback: decode one message and run the user's callback."""
        try:
            ok = self._on_message(read_message(msg or 0))
        except Exception:
            # An exception must not unwind into the library's thread; redeliver instead.
            _log.exception("consume callback failed; the message will be redelivered")
            return _RECONSUME_LATER
        return _CONSUME_SUCCESS if ok else _RECONSUME_LATER
