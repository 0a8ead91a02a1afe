"""Plain RocketMQ message types and the property codec; loads no native library.

Properties travel as one string, `name \\x01 value \\x02` repeated (rocketmq `MessageDecoder`), in
sent batches, in stored messages, in the batch header and in the engine's dedup checksum: one
`join_properties` and one `split_properties` serve all of them.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "KEYS",
    "NAME_VALUE_SEPARATOR",
    "OutgoingMessage",
    "PROPERTY_SEPARATOR",
    "Receipt",
    "ReceivedMessage",
    "SYSTEM_PROPERTIES",
    "SendResult",
    "SendStatus",
    "TAGS",
    "UNIQ_KEY",
    "WAIT",
    "join_properties",
    "split_properties",
    "user_properties",
]

#: Between a property's name and its value.
NAME_VALUE_SEPARATOR = "\x01"
#: After each property's value.
PROPERTY_SEPARATOR = "\x02"

#: The producer-made message id, the one consumers see as the message id.
UNIQ_KEY = "UNIQ_KEY"
#: The message's tag (one), as consumers filter on it.
TAGS = "TAGS"
#: The message's keys, space-separated, as the broker indexes them.
KEYS = "KEYS"
#: Whether the producer waits for the store ("true" from every client).
WAIT = "WAIT"

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


def join_properties(props: Mapping[str, str]) -> str:
    """Properties serialized as RocketMQ carries them (name \\x01 value \\x02, repeated)."""
    return "".join([f"{k}{NAME_VALUE_SEPARATOR}{v}{PROPERTY_SEPARATOR}" for k, v in props.items()])


_UNIQ_KEY_PAIR = UNIQ_KEY + NAME_VALUE_SEPARATOR


def split_properties(text: str) -> dict[str, str]:
    """RocketMQ's serialized properties (name \\x01 value \\x02, repeated) as a dict.

    A repeated name keeps its last value, as RocketMQ's own decoder does, except UNIQ_KEY, which
    keeps its first: a broker stores each message of a batch send with the batch's properties
    appended to the message's own, so the batch's id follows the message's. The first one is the
    id the producer was given for that message; the last would be the same for the whole batch.
    """
    pairs = text.split(PROPERTY_SEPARATOR)
    if text.find(_UNIQ_KEY_PAIR) == text.rfind(_UNIQ_KEY_PAIR):  # one id at most: the usual case
        try:  # every pair well formed: one C-level pass
            return dict(pair.split(NAME_VALUE_SEPARATOR, 1) for pair in pairs if pair)
        except ValueError:  # a pair without a separator: a name with an empty value
            pass
    props: dict[str, str] = {}
    for pair in pairs:
        if pair:
            name, _, value = pair.partition(NAME_VALUE_SEPARATOR)
            if name == UNIQ_KEY and name in props:
                continue
            props[name] = value
    return props


def user_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """Return the properties a producer set itself: everything but RocketMQ's reserved names."""
    return {
        k: v for k, v in properties.items() if k not in SYSTEM_PROPERTIES and not k.startswith(_TRANSIENT_PREFIX)
    }


class SendStatus(enum.IntEnum):
    """How the broker stored a message that it accepted (the values of the C client's CSendStatus)."""

    OK = 0
    FLUSH_DISK_TIMEOUT = 1
    FLUSH_SLAVE_TIMEOUT = 2
    SLAVE_NOT_AVAILABLE = 3


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """A message to send: topic, binary body, optional tags, keys and user properties."""

    topic: str
    body: bytes
    tags: str | None = None
    keys: str | None = None  # several keys separated by spaces, as RocketMQ indexes them
    properties: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """A message as a consumer received it."""

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
    #: why the message could not be read (then `body` holds its stored bytes as the broker keeps them)
    undecodable: str | None = None
    #: the broker it was pulled from ("" when not known)
    broker: str = ""

    @property
    def origin(self) -> tuple[str, int]:
        """Where it came from: (queue name `broker:queue id`, offset in that queue)."""
        return f"{self.broker}:{self.queue_id}", self.queue_offset


@dataclass(frozen=True, slots=True)
class SendResult:
    """What the broker answered to a single send: status, the message's UNIQ_KEY, its queue offset."""

    status: SendStatus
    msg_id: str
    queue_offset: int


@dataclass(frozen=True, slots=True)
class Receipt:
    """Where the broker stored one message."""

    msg_id: str  # the UNIQ_KEY consumers see as the message id
    topic: str
    broker: str
    queue_id: int
    queue_offset: int
    status: SendStatus  # OK, or stored but not flushed / replicated in time
    #: the broker's message id (store host and commit-log offset, what `mqadmin queryMsgById` takes)
    offset_msg_id: str = ""
