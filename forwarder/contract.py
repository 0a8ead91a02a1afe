"""The producer contract of the delay topic: what a delay message must carry, and how it maps to a
`timewheel.Message` (ingest) and back to a RocketMQ message (delivery).

Properties of a delay message:
    TW_TARGET_TOPIC    required: the topic to deliver to
    TW_DELIVER_AT_MS   epoch ms to deliver at, or
    TW_DELAY_MS        ms after the message was born (producer's timestamp), or
    __STARTDELIVERTIME epoch ms (Aliyun RocketMQ's convention)
Tags, keys, body and every other user property pass through; the delivered message also carries
TW_ORIGINAL_MSG_ID (the delay message's id and a checksum of its content: `<UNIQ_KEY>:<crc>`), so
consumers can dedupe, and TW_DUE_MS, its due time.
"""
from __future__ import annotations

import itertools
import re

import crc32c
from dataclasses import dataclass
from typing import Mapping

from forwarder.rocketmq.message import (NAME_VALUE_SEPARATOR, PROPERTY_SEPARATOR, OutgoingMessage, ReceivedMessage,
                                        join_properties, user_properties)
from timewheel.message import Message

TARGET_TOPIC = "TW_TARGET_TOPIC"
DELIVER_AT_MS = "TW_DELIVER_AT_MS"
DELAY_MS = "TW_DELAY_MS"
START_DELIVER_TIME = "__STARTDELIVERTIME"
ORIGINAL_MSG_ID = "TW_ORIGINAL_MSG_ID"
DUE_MS = "TW_DUE_MS"  # on the delivered message: when it was due, so consumers can measure lateness
DEAD_LETTER_REASON = "TW_DEAD_LETTER_REASON"
#: on a raw dead letter (a message that could not be read): where it was in the delay topic
RAW_QUEUE_ID = "TW_RAW_QUEUE_ID"
RAW_QUEUE_OFFSET = "TW_RAW_QUEUE_OFFSET"
#: on a dead letter whose body was cut to fit the broker: the original body's length
TRUNCATED_FROM = "TW_TRUNCATED_FROM"
RAW_TAG = "TW_RAW"
#: the most body a dead letter carries: the broker's message limit less room for its properties
DEAD_LETTER_MAX_BODY = 4 * 1024 * 1024 - 64 * 1024
CONTRACT_PROPERTIES = frozenset({TARGET_TOPIC, DELIVER_AT_MS, DELAY_MS, START_DELIVER_TIME, ORIGINAL_MSG_ID, DUE_MS,
                                 DEAD_LETTER_REASON, RAW_QUEUE_ID, RAW_QUEUE_OFFSET, TRUNCATED_FROM})

# A user topic: ASCII letters, digits, '_' and '-' (RocketMQ also allows '%' and '|', but only in the
# names of its own retry, dead-letter and system topics, which no producer may write through us).
_TOPIC = re.compile(r"[a-zA-Z0-9_-]{1,127}")
_FORBIDDEN = re.compile(r"[\x00-\x02]")
_MILLIS = re.compile(r"-?[0-9]{1,19}")  # ASCII digits only: str.isdigit/\d would take full-width ones
_INT64_MAX = (1 << 63) - 1
#: topics RocketMQ keeps for itself (consumer retries and dead letters, timers, transactions, tracing, ...)
SYSTEM_TOPIC_PREFIXES = ("%RETRY%", "%DLQ%", "%SYS%", "RMQ_SYS_", "rmq_sys_", "SCHEDULE_TOPIC_", "TBW102",
                         "OFFSET_MOVED_EVENT", "SELF_TEST_TOPIC", "BenchmarkTest", "TRANS_CHECK_MAX_TIME_TOPIC",
                         "RMQ_SYS_TRACE_TOPIC", "TRACE_DATA_")


class ContractViolation(ValueError):
    """A delay message that cannot be scheduled; `reason` goes into the dead letter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ContractLimits:
    """What the contract allows, from the engine's configuration."""

    max_delay_ms: int
    max_body_bytes: int
    #: the engine's own topics (the delay topic, its dead-letter topic): never a target
    reserved_topics: frozenset[str] = frozenset()


def check_target_topic(topic: str, reserved: frozenset[str] = frozenset()) -> None:
    """Raise ContractViolation unless `topic` is a user topic a delay message may be delivered to."""
    if not isinstance(topic, str) or not _TOPIC.fullmatch(topic):
        raise ContractViolation(f"{TARGET_TOPIC}={topic!r} is not a valid topic name (ASCII letters, digits, "
                                f"'_' and '-', at most 127)")
    if topic.startswith(SYSTEM_TOPIC_PREFIXES):
        raise ContractViolation(f"{TARGET_TOPIC}={topic!r} is a RocketMQ system topic, not a delivery target")
    if topic in reserved:
        raise ContractViolation(f"{TARGET_TOPIC}={topic!r} is one of the engine's own topics, not a delivery target")


def _int_property(props: Mapping[str, str], name: str) -> int:
    raw = props[name].strip(" ")
    if not _MILLIS.fullmatch(raw) or not -_INT64_MAX <= int(raw) <= _INT64_MAX:
        raise ContractViolation(f"{name}={props[name]!r} is not an integer number of milliseconds (ASCII digits, "
                                f"within int64)")
    return int(raw)


def to_message(msg: ReceivedMessage, now_ms: int, limits: ContractLimits) -> Message:
    """The engine message a delay message asks for; raises ContractViolation with the reason."""
    props = msg.properties
    # Only what the producer set is checked: the broker's own properties are its business.
    user = user_properties(props)
    every = "\x03".join(itertools.chain.from_iterable(user.items()))  # one search for the usual clean case
    if "\ufffd" in every or _FORBIDDEN.search(every):
        for k, v in user.items():
            if "\ufffd" in k or "\ufffd" in v:
                raise ContractViolation(f"property {k!r} is not valid UTF-8")
            if _FORBIDDEN.search(k) or _FORBIDDEN.search(v):
                raise ContractViolation(f"property {k!r} contains a control character RocketMQ uses as a separator")
    target = props.get(TARGET_TOPIC)
    if target is None or not target.strip():
        raise ContractViolation(f"no {TARGET_TOPIC} property: the target topic is required")
    check_target_topic(target, limits.reserved_topics)
    if DELIVER_AT_MS in props:
        due = _int_property(props, DELIVER_AT_MS)
    elif DELAY_MS in props:
        delay = _int_property(props, DELAY_MS)
        if delay < 0:
            raise ContractViolation(f"{DELAY_MS}={delay} is negative")
        born = msg.born_timestamp if msg.born_timestamp > 0 else now_ms
        due = born + delay
    elif START_DELIVER_TIME in props:
        due = _int_property(props, START_DELIVER_TIME)
    else:
        raise ContractViolation(f"no due time: set {DELIVER_AT_MS}, {DELAY_MS} or {START_DELIVER_TIME}")
    if due < 0:
        raise ContractViolation(f"due time {due} is negative")
    if due - now_ms > limits.max_delay_ms:
        raise ContractViolation(f"due in {due - now_ms} ms, past the maximum delay of {limits.max_delay_ms} ms")
    if len(msg.body) > limits.max_body_bytes:
        raise ContractViolation(f"body of {len(msg.body)} bytes exceeds the maximum of {limits.max_body_bytes}")
    if "\ufffd" in msg.tags or "\ufffd" in msg.keys:
        raise ContractViolation("tags or keys are not valid UTF-8")
    if _FORBIDDEN.search(msg.tags) or _FORBIDDEN.search(msg.keys):
        raise ContractViolation("tags or keys contain a control character RocketMQ uses as a separator")
    passthrough = {k: v for k, v in user.items() if k not in CONTRACT_PROPERTIES}
    keys = tuple(k for k in msg.keys.split(" ") if k)
    return Message(target, msg.body, due, msg.tags or None, keys, passthrough or None,
                   engine_id(msg, target, due, passthrough))


_NO_SEPARATORS = str.maketrans("", "", NAME_VALUE_SEPARATOR + PROPERTY_SEPARATOR)


def engine_id(msg: ReceivedMessage, target: str, due: int, properties: Mapping[str, str] | None = None) -> str:
    """The dedup id: the RocketMQ message id (UNIQ_KEY) and a CRC32C of what the message asks for
    (target, due time, tags, keys, the properties it carries on, body).

    A redelivery carries the same id and content, so it is stored once. The id alone is not
    enough: the client library (0.5.0rc2) has been seen to give two different messages sent from
    several threads the same UNIQ_KEY, and deduplicating on it would silently drop one of them
    (with the same body and due time, only a property may tell them apart).
    """
    props = join_properties(dict(sorted((properties or {}).items())))
    head = f"{target}\x00{due}\x00{msg.tags}\x00{msg.keys}\x00{props}".encode()
    digest = crc32c.crc32c(msg.body, crc32c.crc32c(head))
    # The same library has been seen to send a UNIQ_KEY with a NUL in it; as a property of the
    # delivered message that would be refused forever. Read it as the C API does (up to the NUL),
    # without separators, so that every client reading one message gives it the same id.
    uniq = msg.msg_id.split("\x00", 1)[0].translate(_NO_SEPARATORS) or f"{msg.commit_log_offset:016X}"
    return f"{uniq}:{digest:08x}"


def delay_message_id(engine_msg_id: str) -> str:
    """The RocketMQ id of the delay message an engine id was made from."""
    return engine_msg_id.split(":", 1)[0]


def to_outgoing(m: Message) -> OutgoingMessage:
    """The RocketMQ message that delivers `m` to its target topic."""
    props = dict(m.properties or {})
    if m.msg_id:
        props[ORIGINAL_MSG_ID] = m.msg_id
    props[DUE_MS] = str(m.deliver_at_ms)
    return OutgoingMessage(m.topic, m.body, m.tags or None, " ".join(m.keys) or None, props)


def to_dead_letter(topic: str, body: bytes, tags: str | None, keys: str | None, properties: Mapping[str, str],
                   reason: str) -> OutgoingMessage:
    """A dead letter on `topic` carrying the original message and the reason."""
    props = {k: v for k, v in user_properties(properties).items() if not _FORBIDDEN.search(k + v)
             and "\ufffd" not in k + v}
    props[DEAD_LETTER_REASON] = _FORBIDDEN.sub(" ", reason)[:1000]
    # The original's tags and keys may be why it is dead: carry them without separators, so the dead
    # letter itself can always be sent (the originals are in the body's message, untouched).
    tags = _FORBIDDEN.sub(" ", tags or "").strip() or None
    keys = _FORBIDDEN.sub(" ", keys or "").strip() or None
    if len(body) > DEAD_LETTER_MAX_BODY:  # a body too large for the engine may be too large for the broker too
        props[TRUNCATED_FROM] = str(len(body))
        body = body[:DEAD_LETTER_MAX_BODY]
    return OutgoingMessage(topic, body, tags, keys, props)


def raw_dead_letter(topic: str, stored: bytes, reason: str, queue_id: int, queue_offset: int, *,
                    msg_id: str = "", keys: str | None = None,
                    properties: Mapping[str, str] | None = None) -> OutgoingMessage:
    """A dead letter for a message that could not be read: its stored bytes, why, and where it was
    (with its id, keys and the producer's properties when those could be read)."""
    props = {**(properties or {}), RAW_QUEUE_ID: str(queue_id), RAW_QUEUE_OFFSET: str(queue_offset)}
    if msg_id:
        props[ORIGINAL_MSG_ID] = msg_id
    return to_dead_letter(topic, stored, RAW_TAG, keys, props, reason)
