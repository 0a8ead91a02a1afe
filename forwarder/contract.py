"""The producer contract of the delay topic: what a delay message must carry, and how it maps to a
`timewheel.Message` (ingest) and back to a RocketMQ message (delivery).

Properties of a delay message:
    TW_TARGET_TOPIC    required: the topic to deliver to
    TW_DELIVER_AT_MS   epoch ms to deliver at, or
    TW_DELAY_MS        ms after the message was born (producer's timestamp), or
    __STARTDELIVERTIME epoch ms (Aliyun RocketMQ's convention)
Tags, keys, body and every other user property pass through; the delivered message also carries
TW_ORIGINAL_MSG_ID (the delay message's id and a checksum of its content: `<UNIQ_KEY>:<crc>`), so
consumers can dedupe, and TW_DUE_MS, its due time. Its own id (UNIQ_KEY, the message id consumers
see) is `delivered_id` of those two: every copy of one message, from any replica, after any restart
or re-send, carries the same id, so it can be looked up on the target topic by that id.

One set of limits, derived once from RocketMQ's: a message's properties (tags and keys included)
are at most 32,767 bytes as sent, and a message at most the broker's 4 MiB. Ingest accepts only
what delivery can send with everything the engine adds (its id, the due time, WAIT, UNIQ_KEY, a
replica's lease stamp): `DELIVERY_PROPERTIES_BUDGET`. A dead letter always fits: one whose
properties would not is sent minimal (the id, the reason, where it was in the delay topic, and
whether its body was cut), so no message can be refused on every pull or retried forever.
"""
from __future__ import annotations

import itertools
import re

import crc32c
from dataclasses import dataclass
from typing import Mapping

from forwarder.rocketmq.codec import BROKER_MAX_MESSAGE_BYTES, MAX_PROPERTIES_BYTES, derived_id
from forwarder.rocketmq.message import (KEYS, NAME_VALUE_SEPARATOR, PROPERTY_SEPARATOR, TAGS, UNIQ_KEY, WAIT,
                                        OutgoingMessage, ReceivedMessage, join_properties, user_properties)
from timewheel.cancels import producer_id
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
#: on a dead letter: "true" or "false", whether its body is the original's cut short
BODY_TRUNCATED = "TW_BODY_TRUNCATED"
#: on a dead letter sent minimal: what was dropped so that it fits RocketMQ's limits
DEAD_LETTER_MINIMAL = "TW_DEAD_LETTER_MINIMAL"
RAW_TAG = "TW_RAW"
#: the most body a dead letter carries (and the most `max_body_bytes` may allow): the broker's
#: message limit less room for the properties
DEAD_LETTER_MAX_BODY = BROKER_MAX_MESSAGE_BYTES - 64 * 1024
#: room kept for the properties a sender adds to every message: WAIT, UNIQ_KEY (32 hex digits), and
#: a stamp of at most 64 bytes (a replica's lease epoch, `TW_LEASE_EPOCH`)
_SENDER_RESERVE = len(join_properties({WAIT: "true", UNIQ_KEY: "0" * 32}).encode()) + 64
#: the most bytes a message's own properties (tags and keys included, as RocketMQ serialises them)
#: may take so that it can be sent: what ingest accepts and what a dead letter keeps whole
DELIVERY_PROPERTIES_BUDGET = MAX_PROPERTIES_BYTES - _SENDER_RESERVE
#: the most bytes of a message id a minimal dead letter carries
_MINIMAL_ID = 512
CONTRACT_PROPERTIES = frozenset({TARGET_TOPIC, DELIVER_AT_MS, DELAY_MS, START_DELIVER_TIME, ORIGINAL_MSG_ID, DUE_MS,
                                 DEAD_LETTER_REASON, RAW_QUEUE_ID, RAW_QUEUE_OFFSET, TRUNCATED_FROM, BODY_TRUNCATED,
                                 DEAD_LETTER_MINIMAL})

# A user topic: ASCII letters, digits, '_' and '-' (RocketMQ also allows '%' and '|', but only in the
# names of its own retry, dead-letter and system topics, which no producer may write through us).
TOPIC_PATTERN = r"[a-zA-Z0-9_-]{1,127}"
_TOPIC = re.compile(TOPIC_PATTERN)
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
    when: int | str
    if DELIVER_AT_MS in props:
        due = when = _int_property(props, DELIVER_AT_MS)
    elif DELAY_MS in props:
        delay = _int_property(props, DELAY_MS)
        if delay < 0:
            raise ContractViolation(f"{DELAY_MS}={delay} is negative")
        due = delay_base(msg.born_timestamp, msg.store_timestamp, now_ms) + delay
        when = f"+{delay}"
    elif START_DELIVER_TIME in props:
        due = when = _int_property(props, START_DELIVER_TIME)
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
    m = Message(target, msg.body, due, msg.tags or None, keys, passthrough or None,
                engine_id(msg, target, when, passthrough))
    check_deliverable(m)
    return m


def properties_size(properties: Mapping[str, str], tags: str | None, keys: str | None) -> int:
    """The bytes `properties`, `tags` and `keys` take as RocketMQ serialises them (before what a
    sender adds: see `DELIVERY_PROPERTIES_BUDGET`)."""
    extra = {**({TAGS: tags} if tags else {}), **({KEYS: keys} if keys else {})}
    return len(join_properties({**properties, **extra}).encode("utf-8", "surrogatepass"))


def check_deliverable(m: Message) -> None:
    """Raise ContractViolation unless delivery can send `m` with everything the engine adds to it."""
    out = to_outgoing(m)
    size = properties_size(out.properties, out.tags, out.keys)
    if size > DELIVERY_PROPERTIES_BUDGET:
        raise ContractViolation(f"properties, tags and keys take {size} bytes as delivered, over the "
                                f"{DELIVERY_PROPERTIES_BUDGET} that RocketMQ's limit of {MAX_PROPERTIES_BYTES} "
                                f"leaves once the engine's own are added")
    if len(m.body) > DEAD_LETTER_MAX_BODY:
        raise ContractViolation(f"body of {len(m.body)} bytes exceeds the {DEAD_LETTER_MAX_BODY} a message "
                                f"of the broker's {BROKER_MAX_MESSAGE_BYTES} bytes leaves beside its properties")


_NO_SEPARATORS = str.maketrans("", "", NAME_VALUE_SEPARATOR + PROPERTY_SEPARATOR)


def delay_base(born_ms: int, stored_ms: int, now_ms: int) -> int:
    """When a `TW_DELAY_MS` delay starts: the message's born time, else (a producer that set none)
    the broker's store time, which every pull and every replica reads alike, else now."""
    return born_ms if born_ms > 0 else stored_ms if stored_ms > 0 else now_ms


def engine_id(msg: ReceivedMessage, target: str, when: int | str, properties: Mapping[str, str] | None = None) -> str:
    """The dedup id: the RocketMQ message id (UNIQ_KEY) and a CRC32C of what the message asks for
    (target, when: its due time, or for a `TW_DELAY_MS` message '+' and the delay, tags, keys, the
    properties it carries on, body).

    A delay is asked for as it is, not as the due time it makes: a producer's retry of a send is born
    again (RocketMQ's clients stamp each attempt), and both copies must be stored once.

    A redelivery carries the same id and content, so it is stored once. The id alone is not
    enough: the client library (0.5.0rc2) has been seen to give two different messages sent from
    several threads the same UNIQ_KEY, and deduplicating on it would silently drop one of them
    (with the same body and due time, only a property may tell them apart).
    """
    props = join_properties(dict(sorted((properties or {}).items())))
    head = f"{target}\x00{when}\x00{msg.tags}\x00{msg.keys}\x00{props}".encode()
    digest = crc32c.crc32c(msg.body, crc32c.crc32c(head))
    # The same library has been seen to send a UNIQ_KEY with a NUL in it; as a property of the
    # delivered message that would be refused forever. Read it as the C API does (up to the NUL),
    # without separators, so that every client reading one message gives it the same id.
    uniq = msg.msg_id.split("\x00", 1)[0].translate(_NO_SEPARATORS) or f"{msg.commit_log_offset:016X}"
    return f"{uniq}:{digest:08x}"


def delay_message_id(engine_msg_id: str) -> str:
    """The RocketMQ id of the delay message an engine id was made from."""
    return producer_id(engine_msg_id)


def delivered_id(original_msg_id: str, due_ms: int) -> str:
    """The UNIQ_KEY of every delivered copy of the message stored as `original_msg_id`, due at `due_ms`."""
    # A function of what the schedule log holds and nothing else (no host, clock or counter):
    # replicas and restarts agree on it, which a look-up on the target before a re-send relies on.
    return derived_id(original_msg_id.encode(), due_ms)


def to_outgoing(m: Message) -> OutgoingMessage:
    """The RocketMQ message that delivers `m` to its target topic."""
    props = dict(m.properties or {})
    if m.msg_id:
        props[ORIGINAL_MSG_ID] = m.msg_id
    props[DUE_MS] = str(m.deliver_at_ms)
    return OutgoingMessage(m.topic, m.body, m.tags or None, " ".join(m.keys) or None, props)


def to_dead_letter(topic: str, body: bytes, tags: str | None, keys: str | None, properties: Mapping[str, str],
                   reason: str, *, msg_id: str = "", queue_id: int | None = None,
                   queue_offset: int | None = None) -> OutgoingMessage:
    """A dead letter on `topic` carrying the original message, its id, where it was in the delay
    topic and the reason; always within RocketMQ's limits (minimal when the original's properties
    would not fit)."""
    props = {k: v for k, v in user_properties(properties).items() if not _FORBIDDEN.search(k + v)
             and "\ufffd" not in k + v}
    reason = _FORBIDDEN.sub(" ", reason)[:1000]
    props[DEAD_LETTER_REASON] = reason
    origin = {}
    if msg_id:
        origin[ORIGINAL_MSG_ID] = _FORBIDDEN.sub(" ", msg_id)
    if queue_id is not None:
        origin[RAW_QUEUE_ID] = str(queue_id)
    if queue_offset is not None:
        origin[RAW_QUEUE_OFFSET] = str(queue_offset)
    props.update(origin)
    # The original's tags and keys may be why it is dead: carry them without separators, so the dead
    # letter itself can always be sent (the originals are in the body's message, untouched).
    tags = _FORBIDDEN.sub(" ", tags or "").strip() or None
    keys = _FORBIDDEN.sub(" ", keys or "").strip() or None
    truncated = len(body) > DEAD_LETTER_MAX_BODY  # a body too large for the engine may be too large for the broker
    if truncated:
        props[TRUNCATED_FROM] = str(len(body))
        body = body[:DEAD_LETTER_MAX_BODY]
    size = properties_size(props, tags, keys)
    if size <= DELIVERY_PROPERTIES_BUDGET:
        return OutgoingMessage(topic, body, tags, keys, props)
    # Too large to carry whole: raw and minimal, and it says so.
    if ORIGINAL_MSG_ID in origin:
        origin[ORIGINAL_MSG_ID] = origin[ORIGINAL_MSG_ID][:_MINIMAL_ID]
    minimal = {DEAD_LETTER_REASON: reason, **origin, BODY_TRUNCATED: "true" if truncated else "false",
               DEAD_LETTER_MINIMAL: f"properties, tags and keys dropped: {size} bytes, over the "
                                    f"{DELIVERY_PROPERTIES_BUDGET} RocketMQ can carry"}
    if truncated:
        minimal[TRUNCATED_FROM] = props[TRUNCATED_FROM]
    return OutgoingMessage(topic, body, RAW_TAG, None, minimal)


def raw_dead_letter(topic: str, stored: bytes, reason: str, queue_id: int, queue_offset: int, *,
                    msg_id: str = "", keys: str | None = None,
                    properties: Mapping[str, str] | None = None) -> OutgoingMessage:
    """A dead letter for a message that could not be read: its stored bytes, why, and where it was
    (with its id, keys and the producer's properties when those could be read)."""
    return to_dead_letter(topic, stored, RAW_TAG, keys, properties or {}, reason, msg_id=msg_id, queue_id=queue_id,
                          queue_offset=queue_offset)
