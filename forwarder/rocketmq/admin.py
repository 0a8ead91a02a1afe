"""Admin requests: create topics on a broker, list a group's members, see which brokers registered.

    UPDATE_AND_CREATE_TOPIC_LIST (18), to a broker: body {"topicConfigList": [TopicConfig, ...]};
      one request for any number of topics (~20 ms), where `mqadmin updateTopic` costs a JVM start
      (~4.5 s) per topic. The broker registers the new topics with its NameServers itself.
    GET_CONSUMER_LIST_BY_GROUP (38), to a broker: consumerGroup -> body {"consumerIdList": [...]};
      a group without members is answered with an error code.
    GET_MAX_OFFSET (30) and QUERY_CONSUMER_OFFSET (14), to a broker: topic, queueId (and
      consumerGroup) -> ext "offset": a group's lag per queue, as `mqadmin consumerProgress` shows it.
    GET_BROKER_CONFIG (26), to a broker: body the broker's settings as Java properties text.
    GET_BROKER_CLUSTER_INFO (106), to a NameServer: body ClusterInfo, in Fastjson's non-standard
      JSON (integer keys), so it is searched, not parsed.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from forwarder.rocketmq.connection import Connection, call
from forwarder.rocketmq.errors import ProtocolError, RemotingError
from forwarder.rocketmq.namesrv import parse_route, topic_route
from forwarder.rocketmq.security import ClientSecurity
from forwarder.rocketmq.protocol import (GET_BROKER_CLUSTER_INFO, GET_BROKER_CONFIG, GET_CONSUMER_LIST_BY_GROUP, GET_MAX_OFFSET,
                                         QUERY_CONSUMER_OFFSET, QUERY_NOT_FOUND, SUCCESS,
                                         REQUEST_CODE_NOT_SUPPORTED, UPDATE_AND_CREATE_TOPIC,
                                         UPDATE_AND_CREATE_TOPIC_LIST, Response, error_for_code)

__all__ = ["QueueLag", "broker_config", "broker_registered", "consumer_ids", "consumer_lag", "create_topics", "queue_lags"]

_PERM_READ_WRITE = 6


def create_topics(broker: str, topics: Iterable[str], queues: int = 4, timeout: float = 15.0,
                  security: ClientSecurity | None = None, *, perm: int = _PERM_READ_WRITE) -> None:
    """Create (or update) topics on the broker at `broker` with `queues` read and write queues each
    and permission `perm` (RocketMQ's PermName bits: 4 read, 2 write; read and write by default).

    Raises a RemotingError (BrokerError when the broker refused); routes appear on the NameServer
    a moment later, when the broker has registered them.
    """
    topics = list(topics)
    body = json.dumps(
        {
            "topicConfigList": [
                {
                    "topicName": t,
                    "readQueueNums": queues,
                    "writeQueueNums": queues,
                    "perm": perm,
                    "topicFilterType": "SINGLE_TAG",
                    "topicSysFlag": 0,
                    "order": False,
                    "attributes": {},
                }
                for t in topics
            ]
        }
    ).encode()
    resp = call(broker, UPDATE_AND_CREATE_TOPIC_LIST, {}, body, timeout, security)
    if resp.code == REQUEST_CODE_NOT_SUPPORTED:  # a 4.x broker: one UPDATE_AND_CREATE_TOPIC per topic
        conn = Connection(broker, timeout, security)
        try:
            for t in topics:
                ext = {"topic": t, "defaultTopic": "TBW102", "readQueueNums": str(queues),
                       "writeQueueNums": str(queues), "perm": str(perm), "topicFilterType": "SINGLE_TAG",
                       "topicSysFlag": "0", "order": "false"}
                resp = conn.request(UPDATE_AND_CREATE_TOPIC, ext, b"", time.monotonic() + timeout)
                if resp.code != SUCCESS:
                    break
        finally:
            conn.close()
    if resp.code != SUCCESS:
        raise error_for_code(resp.code, resp.remark, f"broker {broker} creating topics")


def consumer_ids(broker: str, group: str, timeout: float = 5.0, security: ClientSecurity | None = None) -> list[str]:
    """Client ids of the members of consumer group `group` the broker knows now, sorted ([] if none)."""
    resp = call(broker, GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": group}, b"", timeout, security)
    if resp.code != SUCCESS:
        return []  # the broker answers "not online" for a group without members
    try:
        ids: list[str] = json.loads(resp.body).get("consumerIdList") or []
    except ValueError as e:
        raise ProtocolError(f"consumer list of {group} from {broker} is not JSON: {e}") from e
    return sorted(ids)


def broker_config(broker: str, timeout: float = 5.0, security: ClientSecurity | None = None) -> dict[str, str]:
    """The settings of the broker at address `broker`, as it reports them (names as in broker.conf)."""
    resp = call(broker, GET_BROKER_CONFIG, {}, b"", timeout, security)
    if resp.code != SUCCESS:
        raise error_for_code(resp.code, resp.remark, f"the settings of broker {broker}")
    out: dict[str, str] = {}
    for line in resp.body.decode("utf-8", "replace").splitlines():
        name, sep, value = line.partition("=")
        if sep and not name.startswith("#"):
            out[name.strip()] = value.strip()
    return out


def broker_registered(namesrv: str, broker: str, timeout: float = 5.0, security: ClientSecurity | None = None) -> bool:
    """Whether the NameServer at `namesrv` lists a broker at address `broker` in its cluster info."""
    resp = call(namesrv, GET_BROKER_CLUSTER_INFO, {}, b"", timeout, security)
    return resp.code == SUCCESS and f'"{broker}"'.encode() in resp.body


@dataclass(frozen=True)
class QueueLag:
    """One queue of a topic: the broker's max offset, the group's committed offset, the difference."""

    broker: str
    queue: int
    max_offset: int
    committed: int  # -1: the group has committed nothing on this queue yet
    lag: int


def _offset(answer: Response | RemotingError, what: str, addr: str) -> int:
    if isinstance(answer, RemotingError):
        raise answer
    if answer.code == QUERY_NOT_FOUND:
        return -1
    if answer.code != SUCCESS:
        raise error_for_code(answer.code, answer.remark, f"broker {addr} answering the {what} request")
    return int(answer.ext.get("offset", -1))


def queue_lags(namesrv: str, group: str, topic: str, timeout: float = 5.0,
               security: ClientSecurity | None = None) -> list[QueueLag]:
    """`group`'s lag on every readable queue of `topic`, as `mqadmin consumerProgress` shows it;
    one pipelined batch of requests per broker."""
    doc = topic_route(namesrv, topic, timeout, security)
    if doc is None:
        return []
    route = parse_route(topic, doc, readable=True)  # a route that makes no sense is a ProtocolError
    out: list[QueueLag] = []
    for broker_name, addr in sorted(route.brokers.items()):
        queues = [q for b, q in route.queues if b == broker_name]
        requests: list[tuple[int, Mapping[str, str], bytes]] = []
        for q in queues:
            head = {"topic": topic, "queueId": str(q)}
            requests += [(GET_MAX_OFFSET, head, b""), (QUERY_CONSUMER_OFFSET, {**head, "consumerGroup": group}, b"")]
        conn = Connection(addr, timeout, security)
        try:
            deadline = time.monotonic() + timeout
            with conn.lock:
                opaques = conn.submit(requests, deadline)
                answers = conn.collect(opaques, deadline)
        finally:
            conn.close()
        for i, q in enumerate(queues):
            top = _offset(answers[opaques[2 * i]], "max offset", addr)
            committed = _offset(answers[opaques[2 * i + 1]], "consumer offset", addr)
            out.append(QueueLag(broker_name, q, top, committed, max(0, top - max(committed, 0))))
    return out


def consumer_lag(namesrv: str, group: str, topic: str, timeout: float = 5.0,
                 security: ClientSecurity | None = None) -> dict[tuple[str, int], int]:
    """Messages of `topic` not yet committed by `group`, per (broker name, queue id)."""
    return {(q.broker, q.queue): q.lag for q in queue_lags(namesrv, group, topic, timeout, security)}
