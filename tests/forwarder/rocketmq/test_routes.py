"""The producer's route cache under a flood of one-off target topics: it keeps the routes in use,
not one for every topic ever sent to, and a topic the NameServer lacks costs it one look-up per
`retry_s`, not one per send (its answer kept, boundedly)."""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from forwarder.rocketmq._routes import RouteCache
from forwarder.rocketmq.errors import ConnectionFailedError, TopicNotFoundError

FLOOD = 100_000
KEPT = 10_000  # routes the cache holds at most


class CountingNameServer:
    """Answers every topic but those starting with NOPE (unless created since) with one broker of 4
    queues, counting look-ups."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        self.created: set[str] = set()

    def route_document(self, topic: str) -> dict[str, Any] | None:
        self.asked[topic] += 1
        if topic.startswith("NOPE") and topic not in self.created:
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


# -- topics the NameServer has no route for --

SENDS = 1000


class FakeClock:
    """time.monotonic, moved on by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(time, "monotonic", lambda: self.now)


class UnreachableNameServer:
    """No NameServer answers: every look-up fails to connect, counted."""

    def __init__(self) -> None:
        self.asked = 0

    def route_document(self, topic: str) -> dict[str, Any] | None:
        self.asked += 1
        raise ConnectionFailedError(f"no NameServer answered for {topic}: connection refused")


def _not_found(cache: RouteCache, topic: str) -> TopicNotFoundError:
    """The error a look-up of `topic` raises."""
    with pytest.raises(TopicNotFoundError) as raised:
        cache.route(topic)
    return raised.value


def test_sends_to_a_missing_topic_within_retry_s_ask_the_nameserver_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    ns = CountingNameServer()
    cache = RouteCache(ns, ttl_s=30, retry_s=1, auto_create_topics=False)  # type: ignore[arg-type]
    first = _not_found(cache, "NOPE_TYPO")
    for _ in range(SENDS - 1):
        clock.now += 0.5 / SENDS
        again = _not_found(cache, "NOPE_TYPO")
        assert (type(again), str(again), again.code) == (type(first), str(first), first.code)
    assert ns.asked["NOPE_TYPO"] == 1
    assert isinstance(cache.routes_of(["NOPE_TYPO"])["NOPE_TYPO"], TopicNotFoundError)
    assert ns.asked["NOPE_TYPO"] == 1


def test_a_missing_topic_is_asked_about_again_after_retry_s_and_found_once_created(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    ns = CountingNameServer()
    cache = RouteCache(ns, ttl_s=30, retry_s=1, auto_create_topics=False)  # type: ignore[arg-type]
    _not_found(cache, "NOPE_LATER")
    clock.now += 1.0
    _not_found(cache, "NOPE_LATER")
    assert ns.asked["NOPE_LATER"] == 2
    ns.created.add("NOPE_LATER")  # an operator creates the topic on the broker
    clock.now += 0.999
    _not_found(cache, "NOPE_LATER")
    clock.now += 0.001
    assert cache.route("NOPE_LATER").queues == tuple(("broker-a", q) for q in range(4))
    assert ns.asked["NOPE_LATER"] == 3
    cache.route("NOPE_LATER")
    assert ns.asked["NOPE_LATER"] == 3  # a route now: cached as any other


def test_a_flood_of_one_off_missing_topics_keeps_bounded_state_and_the_busy_missing_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeClock(monkeypatch)
    ns = CountingNameServer()
    cache = RouteCache(ns, ttl_s=30, retry_s=1, auto_create_topics=False)  # type: ignore[arg-type]
    for i in range(FLOOD):
        with pytest.raises(TopicNotFoundError):
            cache.route(f"NOPE_{i:06d}")
        if i % 1000 == 0:
            with pytest.raises(TopicNotFoundError):
                cache.route("NOPE_BUSY")
    assert ns.asked["NOPE_BUSY"] == 1  # in use all along: its answer kept
    _not_found(cache, "NOPE_000000")
    assert ns.asked["NOPE_000000"] == 2  # pushed out by the flood: asked anew
    assert len(cache) == 0
    assert cache.missing_count() <= KEPT


def test_an_unreachable_nameserver_is_asked_again_on_the_next_send() -> None:
    ns = UnreachableNameServer()
    cache = RouteCache(ns, ttl_s=30, retry_s=1, auto_create_topics=False)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(ConnectionFailedError):
            cache.route("ORDERS")
    assert ns.asked == 3
    assert cache.missing_count() == 0


def test_with_auto_create_topics_a_missing_topic_still_goes_through_the_default_topics_route(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeClock(monkeypatch)
    ns = CountingNameServer()
    cache = RouteCache(ns, ttl_s=30, retry_s=1, auto_create_topics=True)  # type: ignore[arg-type]
    for _ in range(3):
        assert cache.route("NOPE_NEW").via_default_topic
    assert ns.asked["NOPE_NEW"] == 1 and cache.missing_count() == 0
