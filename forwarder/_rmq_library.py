"""ctypes bindings of the librocketmq.so bundled with rocketmq-client-python 0.5.0rc2: its C API, and
complete reads of received messages.

The wheel bundles `librocketmq.so` built from rocketmq-client-cpp's 1.2.4 code line (C API in its
`include/C*.h`). Its Python wrapper reads bodies and properties as NUL-terminated strings and cannot
list a received message's properties; `read_message()` / `message_body()` / `message_properties()`
read any received message handle (a `rocketmq.client.RecvMessage` included) completely. The clients
built on these bindings are in `forwarder._rmq_native`.

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
import threading
from collections.abc import Mapping
from ctypes import POINTER, Structure, c_char, c_char_p, c_int, c_longlong, c_size_t, c_void_p
from typing import Any, Protocol

from rocketmq import ffi as _wrapper_ffi

from forwarder.errors import NativeClientError, NativeLayoutError
from forwarder.rocketmq.message import (OutgoingMessage, ReceivedMessage, SendResult, SendStatus,
                                        split_properties)

__all__ = ["LIBRARY_PATH", "LogLevel", "message_body", "message_properties", "read_message"]

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
            body_offset = (_MQMessage_getBody(handle) or 0) - handle
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
        return parent is not None and bool(left and right) and c_void_p.from_address(parent + 8).value == header

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


def _decode(raw: bytes | None) -> str:
    """Decode a C string from the library ('' for NULL)."""
    return raw.decode("utf-8", errors="replace") if raw else ""


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


def _build(msg: OutgoingMessage) -> int:
    """Create a native CMessage for `msg`; the caller destroys it."""
    properties = {_property_text(name): _property_text(value) for name, value in msg.properties.items()}
    return _build_unchecked(msg.topic, msg.body, properties, tags=msg.tags, keys=msg.keys)


def _build_unchecked(topic: str, body: bytes, properties: Mapping[bytes, bytes], *, tags: str | None = None,
                     keys: str | None = None) -> int:
    """Create a native CMessage with property bytes exactly as given (`_build` refuses invalid text
    and RocketMQ's separator bytes first); the caller destroys it."""
    handle = _CreateMessage(_text(topic, "topic"))
    if not handle:
        raise NativeClientError("CreateMessage returned NULL")
    try:
        if tags:
            _check(_SetMessageTags(handle, _text(tags, "tags")), "SetMessageTags")
        if keys:
            _check(_SetMessageKeys(handle, _text(keys, "keys")), "SetMessageKeys")
        for name, value in properties.items():
            _check(_SetMessageProperty(handle, name, value), "SetMessageProperty")
        _check(_SetByteMessageBody(handle, body, len(body)), "SetByteMessageBody")
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
