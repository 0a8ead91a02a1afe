"""The producer's route cache under a flood of one-off target topics: it keeps the routes in use,
not one for every topic ever sent to (nor a look-up time for every topic the NameServer lacks)."""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from forwarder.rocketmq._routes import RouteCache
from forwarder.rocketmq.errors import TopicNotFoundError

FLOOD = 100_000
KEPT = 10_000  # routes the cache holds at most


class CountingNameServer:
    """Answers every topic but those starting with NOPE with one broker of 4 queues, counting look-ups."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()

    def route_document(self, topic: str) -> dict[str, Any] | None:
        self.asked[topic] += 1
        if topic.startswith("NOPE"):
            return None
        return {"brokerDatas": [{"brokerName": "broker-a", "brokerAddrs": {"0": "127.0.0.1:10911"}}],
                "queueDatas": [{"brokerName": "broker-a", "perm": 6, "writeQueueNums": 4, "readQueueNums": 4}]}


def test_routes_of_one_off_topics_are_let_go_and_a_busy_topic_keeps_its_route() -> None:
    ns = CountingNameServer()
    cache = RouteCache(ns, ttl_s=3600, retry_s=1, auto_create_topics=False)  # type: ignore[arg-type]
    for i in range(FLOOD):
        cache.route(f"REPLY_{i:06d}")
        if i % 1000 == 0:
            cache.route("ORDERS")
    cache.route("REPLY_000000")
    assert ns.asked["REPLY_000000"] == 2  # looked up anew: its route was not kept for ever
    assert ns.asked["ORDERS"] == 1  # in use all along: never looked up again
    assert len(cache) <= KEPT


def test_topics_the_nameserver_lacks_leave_nothing_behind() -> None:
    ns = CountingNameServer()
    cache = RouteCache(ns, ttl_s=3600, retry_s=1, auto_create_topics=False)  # type: ignore[arg-type]
    for i in range(FLOOD // 10):
        with pytest.raises(TopicNotFoundError):
            cache.route(f"NOPE_{i:06d}")
    assert len(cache) == 0
