"""Admin requests: create topics on a broker, list a group's members, see which brokers registered.

    UPDATE_AND_CREATE_TOPIC_LIST (18), to a broker: body {"topicConfigList": [TopicConfig, ...]};
      one request for any number of topics (~20 ms), where `mqadmin updateTopic` costs a JVM start
      (~4.5 s) per topic. The broker registers the new topics with its NameServers itself.
    GET_CONSUMER_LIST_BY_GROUP (38), to a broker: consumerGroup -> body {"consumerIdList": [...]};
      a group without members is answered with an error code.
    GET_MAX_OFFSET (30) and QUERY_CONSUMER_OFFSET (14), to a broker: topic, queueId (and
      consumerGroup) -> ext "offset": a group's lag per queue, as `mqadmin consumerProgress` shows it.
    GET_BROKER_CLUSTER_INFO (106), to a NameServer: body ClusterInfo, in Fastjson's non-standard
      JSON (integer keys), so it is searched, not parsed.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

from forwarder.rocketmq.connection import call
from forwarder.rocketmq.errors import ProtocolError
from forwarder.rocketmq.namesrv import TopicRoute, topic_route
from forwarder.rocketmq.security import ClientSecurity
from forwarder.rocketmq.protocol import (GET_BROKER_CLUSTER_INFO, GET_CONSUMER_LIST_BY_GROUP, GET_MAX_OFFSET,
                                         QUERY_CONSUMER_OFFSET, QUERY_NOT_FOUND, SUCCESS,
                                         UPDATE_AND_CREATE_TOPIC_LIST, error_for_code)

__all__ = ["broker_registered", "consumer_ids", "consumer_lag", "create_topics"]

_PERM_READ_WRITE = 6


def create_topics(broker: str, topics: Iterable[str], queues: int = 4, timeout: float = 15.0,
                  security: ClientSecurity | None = None) -> None:
    """Create (or update) topics on the broker at `broker` with `queues` read and write queues each.

    Raises a RemotingError (BrokerError when the broker refused); routes appear on the NameServer
    a moment later, when the broker has registered them.
    """
    body = json.dumps(
        {
            "topicConfigList": [
                {
                    "topicName": t,
                    "readQueueNums": queues,
                    "writeQueueNums": queues,
                    "perm": _PERM_READ_WRITE,
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


def broker_registered(namesrv: str, broker: str, timeout: float = 5.0, security: ClientSecurity | None = None) -> bool:
    """Whether the NameServer at `namesrv` lists a broker at address `broker` in its cluster info."""
    resp = call(namesrv, GET_BROKER_CLUSTER_INFO, {}, b"", timeout, security)
    return resp.code == SUCCESS and f'"{broker}"'.encode() in resp.body


def consumer_lag(namesrv: str, group: str, topic: str, timeout: float = 5.0,
                 security: ClientSecurity | None = None) -> dict[tuple[str, int], int]:
    """Messages of `topic` not yet committed by `group`, per (broker name, queue id)."""
    doc = topic_route(namesrv, topic, timeout, security)
    if doc is None:
        return {}
    route = TopicRoute.parse(topic, doc, 0.0, readable=True)
    out: dict[tuple[str, int], int] = {}
    for broker_name, queue in route.queues:
        broker = route.brokers[broker_name]
        head = {"topic": topic, "queueId": str(queue)}
        top = call(broker, GET_MAX_OFFSET, head, b"", timeout, security)
        if top.code != SUCCESS:
            raise error_for_code(top.code, top.remark, f"broker {broker} max offset of {topic}/{queue}")
        mine = call(broker, QUERY_CONSUMER_OFFSET, {**head, "consumerGroup": group}, b"", timeout, security)
        if mine.code not in (SUCCESS, QUERY_NOT_FOUND):
            raise error_for_code(mine.code, mine.remark, f"broker {broker} offset of {group} on {topic}/{queue}")
        committed = int(mine.ext.get("offset", 0)) if mine.code == SUCCESS else 0
        out[(broker_name, queue)] = max(0, int(top.ext.get("offset", 0)) - committed)
    return out
