"""Messages inside request and response bodies: the batch a producer sends, the messages a pull
returns, and the message ids (UNIQ_KEY) a producer gives them.

SEND_BATCH_MESSAGE body: the messages one after another (MessageDecoder.encodeMessage), each:
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

PULL_MESSAGE body: stored messages one after another (MessageDecoder), each:
    total_size i32, magic i32 (V1 0xdaa320a7: topic length 1 byte; V2 0xdaa320ab: 2 bytes),
    body_crc i32, queue_id i32, flag i32, queue_offset i64, physical_offset i64, sys_flag i32,
    born_timestamp i64, born_host (4+4 bytes, 16+4 when sys_flag & 0x10), store_timestamp i64,
    store_host (4+4, 16+4 when sys_flag & 0x20), reconsume_times i32, prepared_offset i64,
    body_length i32, body (compressed when sys_flag & 1: `compression`), topic_length, topic,
    props_length i16, properties (name \\x01 value \\x02 ...).
"""
from __future__ import annotations

import calendar
import hashlib
import itertools
import logging
import os
import random
import re
import struct
import time
from typing import Callable

from forwarder.rocketmq.compression import BodyDecodeError, BodyTooLargeError, InflateBudget, codec_of, decompress
from forwarder.rocketmq.errors import MessageDecodeError, MessageRejectedError
from forwarder.rocketmq.message import (KEYS, TAGS, UNIQ_KEY, WAIT, OutgoingMessage, ReceivedMessage,
                                        join_properties, split_properties)
from forwarder.rocketmq.protocol import MESSAGE_ILLEGAL

__all__ = ["BROKER_MAX_MESSAGE_BYTES", "IdMaker", "derived_id", "MAX_PROPERTIES_BYTES", "RESERVED_BYTES", "decode_messages",
           "encode_message", "encode_serialized"]

log = logging.getLogger("timewheel.remoting")

# Bytes that would split a property (\x01, \x02), or cut it short in the C++ clients (\x00).
_RESERVED_CHARS = re.compile("[\x00-\x02]")
_MAX_PROPERTIES_BYTES = 32767  # props_length is a signed 16-bit field
MAX_PROPERTIES_BYTES = _MAX_PROPERTIES_BYTES
#: `_RESERVED_CHARS` over UTF-8 bytes (no multi-byte sequence contains a byte below 0x80)
RESERVED_BYTES = re.compile(b"[\x00-\x02]")
BROKER_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # broker default maxMessageSize: the limit of one batch body

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

#: a stored message, from total_size to born_timestamp
_STORED_HEAD = struct.Struct(
    ">"
    "i"  # total_size
    "i"  # magic
    "i"  # body_crc
    "i"  # queue_id
    "i"  # flag
    "q"  # queue_offset
    "q"  # physical_offset (commit log)
    "i"  # sys_flag
    "q"  # born_timestamp
)
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_I16 = struct.Struct(">h")
_MAGIC_V1 = -626843481  # 0xdaa320a7
_MAGIC_V2 = -626843477  # 0xdaa320ab: topic length in 2 bytes (a topic over 127 bytes)
#: the smallest stored message: its fixed fields with empty body, topic and properties
_MIN_STORED = _STORED_HEAD.size + 8 + 8 + 8 + 4 + 8 + 4 + 1 + 2
_SYS_BORNHOST_V6 = 0x10
_SYS_STOREHOST_V6 = 0x20

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
_U32 = struct.Struct(">I")
#: the key of `derived_id`'s hash: ids derived here never equal ids derived another way from the same seed
_DERIVED_KEY = b"timewheel.uniq.v1"
#: how far a local clock's month start can lie after UTC's (UTC-12): `derived_id`'s time field is
#: that much early, so that a tool decoding it in any time zone begins its search before `at_ms`
_ZONE_MARGIN_MS = 12 * 3600 * 1000
_DERIVED_HASH = hashlib.blake2b(digest_size=12, key=_DERIVED_KEY)
#: `derived_id` as bytes: `IdMaker`'s layout with the hash in place of address, pid, salt and counter
_DERIVED_LAYOUT = struct.Struct(
    ">"
    "10s"  # the hash's first 10 bytes: address, pid and salt
    "I"  # ms since the start of the UTC month, 12 hours early
    "2s"  # the hash's last 2 bytes: the counter
)


def encode_message(msg: OutgoingMessage, msg_id: str) -> bytes:
    """Encode one message of a batch body; MessageRejectedError if RocketMQ cannot carry it."""
    props = dict(msg.properties)
    if msg.tags:
        props[TAGS] = msg.tags
    if msg.keys:
        props[KEYS] = msg.keys
    # One search over every name and value (the ones added below are known to be clean).
    if _RESERVED_CHARS.search("".join(itertools.chain.from_iterable(props.items()))):
        name, value = next((k, v) for k, v in props.items() if _RESERVED_CHARS.search(k + v))
        raise MessageRejectedError(f"property {name!r}={value!r:.100} contains \\x00, \\x01 or \\x02, which "
                                   f"RocketMQ uses as separators", code=MESSAGE_ILLEGAL)
    props[WAIT] = "true"
    props[UNIQ_KEY] = msg_id
    properties = join_properties(props).encode()
    if len(properties) > _MAX_PROPERTIES_BYTES:
        raise MessageRejectedError(f"properties of {len(properties)} bytes exceed RocketMQ's {_MAX_PROPERTIES_BYTES}",
                                   code=MESSAGE_ILLEGAL)
    body = msg.body
    return b"".join((_MESSAGE_HEAD.pack(_MESSAGE_OVERHEAD + len(body) + len(properties), 0, 0, 0, len(body)), body,
                     _PROPERTIES_LENGTH.pack(len(properties)), properties))


def encode_serialized(body: bytes | memoryview, properties: bytes) -> bytes:
    """One message of a batch body from properties already serialised and checked (name \\x01 value
    \\x02, repeated, WAIT and UNIQ_KEY included, at most 32767 bytes): `encode_message` without a dict."""
    return b"".join((_MESSAGE_HEAD.pack(_MESSAGE_OVERHEAD + len(body) + len(properties), 0, 0, 0, len(body)), body,
                     _PROPERTIES_LENGTH.pack(len(properties)), properties))


class _OverBudget(Exception):
    """A compressed body that would take the commit past its inflate budget."""


def decode_messages(body: bytes, max_body_bytes: int = BROKER_MAX_MESSAGE_BYTES, broker: str = "",
                    budget: InflateBudget | None = None) -> list[ReceivedMessage]:
    """The messages of a PULL_MESSAGE answer's body (from the broker named `broker`).

    A message whose body cannot be read back (an unknown codec, corrupt or over `max_body_bytes`
    once inflated) or whose topic or properties are not UTF-8 comes back `undecodable`, with its
    stored bytes as the body, so the caller can park it and move on. A fault in the framing itself
    raises MessageDecodeError carrying the messages before it and the rest of the body. With a
    `budget`, reading stops before the first message that would inflate past it: the messages
    before it come back, and the caller pulls the rest again in its next commit.
    """
    out: list[ReceivedMessage] = []
    mv = memoryview(body)
    p, n = 0, len(body)
    while p < n:
        total = _I32.unpack_from(mv, p)[0] if p + 4 <= n else 0
        if p + _STORED_HEAD.size > n or total < _MIN_STORED or p + total > n:
            raise MessageDecodeError(f"bad message frame at byte {p} of a {n}-byte pull body (size {total})",
                                     decoded=out, raw=bytes(mv[p:]))
        magic = _I32.unpack_from(mv, p + 4)[0]
        if magic not in (_MAGIC_V1, _MAGIC_V2):
            raise MessageDecodeError(f"bad magic {magic & 0xFFFFFFFF:#x} at byte {p} of a pull body",
                                     decoded=out, raw=bytes(mv[p:]))
        try:
            out.append(_decode_one(mv, p, total, magic, max_body_bytes, broker, budget))
        except _OverBudget:
            assert budget is not None
            budget.stopped = True
            break
        except (struct.error, IndexError) as e:
            raise MessageDecodeError(f"message at byte {p} of a pull body runs past its size {total}: {e}",
                                     decoded=out, raw=bytes(mv[p:])) from e
        p += total
    return out


def _decode_one(mv: memoryview, p: int, total: int, magic: int, max_body_bytes: int,
                broker: str = "", budget: InflateBudget | None = None) -> ReceivedMessage:
    """One stored message of `total` bytes at `p` (framing already checked)."""
    _, _, _crc, queue_id, _flag, queue_offset, phys, sys_flag, born = _STORED_HEAD.unpack_from(mv, p)
    end = p + total
    q = p + _STORED_HEAD.size + (20 if sys_flag & _SYS_BORNHOST_V6 else 8)
    (store_ts,) = _I64.unpack_from(mv, q)
    q += 8
    store_host = bytes(mv[q:q + (20 if sys_flag & _SYS_STOREHOST_V6 else 8)])
    q += len(store_host)
    (reconsume,) = _I32.unpack_from(mv, q)
    q += 4 + 8  # and the prepared transaction offset
    (body_len,) = _I32.unpack_from(mv, q)
    q += 4
    if body_len < 0 or q + body_len > end:
        raise IndexError(f"body of {body_len} bytes")
    stored_body = bytes(mv[q:q + body_len])
    q += body_len
    if magic == _MAGIC_V1:
        topic_len = mv[q]
        q += 1
    else:
        (topic_len,) = _I16.unpack_from(mv, q)
        q += 2
    raw_topic = bytes(mv[q:q + topic_len])
    q += topic_len
    (props_len,) = _I16.unpack_from(mv, q)
    q += 2
    if props_len < 0 or q + props_len > end:
        raise IndexError(f"properties of {props_len} bytes")
    raw_props = bytes(mv[q:q + props_len])
    problem: str | None = None
    try:
        topic = raw_topic.decode("utf-8")
        props = split_properties(raw_props.decode("utf-8"))
    except UnicodeDecodeError as e:
        topic = raw_topic.decode("utf-8", "replace")
        props = split_properties(raw_props.decode("utf-8", "replace"))
        problem = f"topic or properties are not UTF-8: {e}"
    msg_id = props.get(UNIQ_KEY) or (store_host + _I64.pack(phys)).hex().upper()
    msg_body = stored_body
    if problem is None:
        limit = max_body_bytes if budget is None else budget.limit(max_body_bytes)
        try:
            msg_body = decompress(stored_body, sys_flag, limit)
        except BodyTooLargeError as e:
            if limit < max_body_bytes:
                raise _OverBudget() from e  # too much for this commit, not for the engine
            problem = str(e)
        except BodyDecodeError as e:
            problem = str(e)
        if budget is not None and codec_of(sys_flag) is not None:
            budget.spend(len(msg_body))
    if problem is not None:
        msg_body = bytes(mv[p:end])  # the stored message, for whoever reads the dead letter
    return ReceivedMessage(topic, msg_body, props.get(TAGS, ""), props.get(KEYS, ""), msg_id, props, queue_id,
                           queue_offset, phys, reconsume, born, store_ts, problem, broker)


class IdMaker:
    """Message ids (UNIQ_KEY) laid out as RocketMQ's clients make them, so tools can read them back.

    32 hex digits: IPv4 (4 bytes), pid (2), a random salt (4), ms since the start of the current
    month in local time (4; how the Java client's MessageClientIDSetter decodes it), a counter (2).
    """

    def __init__(self, ip: bytes) -> None:
        """Ids for a host of IPv4 address `ip` (4 bytes)."""
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


def _reference_derived_id(seed: bytes, at_ms: int) -> str:
    """A message id (UNIQ_KEY) that is a function of `seed` and `at_ms` alone: 32 upper-case hex digits.

    Laid out as `IdMaker`'s: a keyed BLAKE2b of `seed` fills the address, pid, salt and counter
    fields (12 bytes, 96 bits: no collision among any number of messages worth counting), and the
    time field holds `at_ms` 12 hours early, in ms since the start of that UTC month. RocketMQ's
    tools read that field back (MessageClientIDSetter.getNearlyTimeFromID, in their local time zone)
    and search the index from one second before it (`mqadmin queryMsgByUniqueKey`, the dashboard):
    taken 12 hours early, and from UTC rather than the host's zone (replicas may differ in zone; the
    id may not), that start lies before `at_ms` in every time zone, so those tools find the message.
    """
    h = _DERIVED_HASH.copy()  # the key's block hashed once, not per id
    h.update(seed)
    d = h.digest()
    t = at_ms - _ZONE_MARGIN_MS
    start, end = _month_cache
    if not start <= t < end:
        start = _utc_month_start(t)
    return _DERIVED_LAYOUT.pack(d[:10], t - start, d[10:]).hex().upper()


_month_cache: tuple[int, int] = (0, 0)  # [start, end) in epoch ms of the last month asked for


def _utc_month_start(ms: int) -> int:
    """Epoch ms of the start of the UTC month holding `ms` (cached: nearly every call asks the same month)."""
    global _month_cache
    start, end = _month_cache
    if start <= ms < end:
        return start
    t = time.gmtime(ms // 1000)
    start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)) * 1000
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    _month_cache = (start, calendar.timegm((year, month, 1, 0, 0, 0)) * 1000)
    return start


def _compiled_derived_id() -> Callable[[bytes, int], str] | None:
    """The compiled `derived_id` (forwarder/rocketmq/_uniq_key.pyx) when it was built and agrees with
    the one above on a few seeds and times (its words are read in this machine's byte order)."""
    try:
        from forwarder.rocketmq import _uniq_key
    except ImportError:  # installed without a C compiler
        return None
    _uniq_key._init(_DERIVED_KEY, _reference_derived_id)
    probes = [(b"", 0), (b"m", 1_790_000_000_000), (bytes(range(256)) * 2, 4_102_444_799_999),
              (b"x" * 128, 1_000), (b"y" * 129, 951_868_800_000)]
    if any(_uniq_key.derived_id(s, t) != _reference_derived_id(s, t) for s, t in probes):
        log.warning("the compiled message-id hash disagrees with the Python one here; the Python one runs")
        return None
    return _uniq_key.derived_id


#: compiled where built (the same ids, byte for byte, as `_reference_derived_id`, whose docstring says
#: what an id is); `COMPILED_IDS` says which
derived_id: Callable[[bytes, int], str] = _compiled_derived_id() or _reference_derived_id
COMPILED_IDS = derived_id is not _reference_derived_id
