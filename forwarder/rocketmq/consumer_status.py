"""What a broker asks a consumer about, and the bodies of the answers, as RocketMQ's Java client writes them.

A broker (on an operator's or an admin tool's behalf) sends its consumers requests of its own on the
connection they heartbeat on; see `RemotingPullConsumer.answer` for which are answered and how.
The bodies are fastjson documents in which a map keyed by a message queue writes each key as a JSON
object (`{{"brokerName":"b","queueId":0,"topic":"T"}:5}`): not standard JSON, so they are written
and read here by hand, keys in fastjson's (alphabetical) order.

    RESET_CONSUMER_CLIENT_OFFSET (220), one-way: extFields topic, group, timestamp, isForce;
      body ResetOffsetBody {"offsetTable": {MessageQueue: offset}}
    GET_CONSUMER_STATUS_FROM_CLIENT (221): extFields topic, group, clientAddr;
      answer GetConsumerStatusBody {"consumerTable": {}, "messageQueueTable": {MessageQueue: offset}}
    GET_CONSUMER_RUNNING_INFO (307): extFields consumerGroup, clientId, jstackEnable;
      answer ConsumerRunningInfo {"properties", "subscriptionSet", "mqTable": {MessageQueue:
      ProcessQueueInfo}, "statusTable", "userConsumerInfo"} (what `mqadmin consumerStatus` prints and
      `mqadmin consumerProgress -s true` reads each queue's client from)
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forwarder.rocketmq.errors import ProtocolError

__all__ = ["QueueReport", "consumer_status_body", "parse_reset_offsets", "running_info_body"]

#: a message queue written as a map key, followed by its value (offsets are integers)
_KEYED_OFFSET = re.compile(rb'(\{[^{}]*\})\s*:\s*(-?\d+)')


@dataclass(frozen=True)
class QueueReport:
    """One queue a consumer owns, as it reports it: where it pulls and commits, and when it last did."""

    topic: str
    broker: str
    queue_id: int
    offset: int  # next offset to pull (everything before it accepted)
    committed: int  # last offset committed to the broker
    last_pull_ms: int
    last_consume_ms: int


def _queue_key(topic: str, broker: str, queue_id: int) -> str:
    return json.dumps({"brokerName": broker, "queueId": queue_id, "topic": topic}, separators=(",", ":"),
                      sort_keys=True)


def _keyed(entries: list[tuple[str, Any]]) -> str:
    """A fastjson map keyed by message queues: `{KEY:VALUE,...}` with each KEY a JSON object."""
    return "{" + ",".join(f"{key}:{json.dumps(value, separators=(',', ':'), sort_keys=True)}"
                          for key, value in entries) + "}"


def parse_reset_offsets(body: bytes) -> dict[tuple[str, str, int], int]:
    """The offset table of a ResetOffsetBody: (topic, broker name, queue id) -> offset."""
    out: dict[tuple[str, str, int], int] = {}
    for m in _KEYED_OFFSET.finditer(body):
        try:
            mq = json.loads(m.group(1))
            out[(str(mq["topic"]), str(mq["brokerName"]), int(mq["queueId"]))] = int(m.group(2))
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"a reset-offset request names a queue that cannot be read: {m.group(1)!r:.200}") from e
    if not out and b"brokerName" in body:
        raise ProtocolError(f"a reset-offset request's body cannot be read: {body[:200]!r}")
    return out


def consumer_status_body(queues: list[QueueReport]) -> bytes:
    """GetConsumerStatusBody: each owned queue's offset."""
    table = _keyed([(_queue_key(q.topic, q.broker, q.queue_id), q.offset) for q in sorted(
        queues, key=lambda q: (q.topic, q.broker, q.queue_id))])
    return ('{"consumerTable":{},"messageQueueTable":' + table + "}").encode()


def running_info_body(properties: Mapping[str, str], topic: str, queues: list[QueueReport],
                      counters: Mapping[str, int]) -> bytes:
    """ConsumerRunningInfo: the consumer's settings, its subscription, each owned queue, its counters."""
    subscription = {"classFilterMode": False, "codeSet": [], "expressionType": "TAG", "subString": "*",
                    "subVersion": 0, "tagsSet": [], "topic": topic}
    mq_table = _keyed([(_queue_key(q.topic, q.broker, q.queue_id), {
        # Batches are handed over as pulled: nothing waits in a local cache between pulls.
        "cachedMsgCount": 0, "cachedMsgMaxOffset": 0, "cachedMsgMinOffset": 0, "cachedMsgSizeInMiB": 0,
        "commitOffset": q.committed, "droped": False, "lastConsumeTimestamp": q.last_consume_ms,
        "lastLockTimestamp": 0, "lastPullTimestamp": q.last_pull_ms, "locked": False, "transactionMsgCount": 0,
        "transactionMsgMaxOffset": 0, "transactionMsgMinOffset": 0, "tryUnlockTimes": 0,
    }) for q in sorted(queues, key=lambda q: (q.topic, q.broker, q.queue_id))])
    head = json.dumps({"properties": dict(properties), "subscriptionSet": [subscription]},
                      separators=(",", ":"), sort_keys=True)[:-1]
    tail = json.dumps({"statusTable": {}, "userConsumerInfo": {k: str(v) for k, v in sorted(counters.items())}},
                      separators=(",", ":"), sort_keys=True)[1:]
    return (head + ',"mqPopTable":{},"mqTable":' + mq_table + "," + tail).encode()
