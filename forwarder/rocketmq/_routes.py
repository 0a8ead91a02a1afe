"""A producer's topic routes: looked up on the NameServer, cached, refreshed, kept through outages.

A route is cached for `ttl_s` and looked up again sooner after a failure marks it stale (at most
every `retry_s`); while the NameServer cannot be reached or no longer lists a route it had (it
drops a broker that stopped), the last route is kept: that broker's connection tells the truth.
A topic without a route goes through the default topic's route when `auto_create_topics`, so a
broker configured with autoCreateTopicEnable creates it on first send.

Producers choose target topics, and some name a new one per message (a request id in the name): a
route unused for `idle_s` is let go, and beyond `max_topics` the least recently used one is, so the
cache holds the topics in use, not every topic ever sent to. A topic let go is looked up again on
its next use, as a new one is.

Some name topics that do not exist (a typo, a hostile client): the NameServer's "no route" is kept
`retry_s`, and a send within it fails at once with the same TopicNotFoundError, so such a topic
costs the NameServer one look-up per `retry_s`, not one per send, and a topic created since is found
at most `retry_s` later. At most `max_topics` such answers are kept, the least recently used going
first. A NameServer that cannot be reached said nothing about the topic: that is never kept.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Any

from forwarder.rocketmq.errors import MessageRejectedError, RemotingError, TopicNotFoundError
from forwarder.rocketmq.namesrv import NameServerClient, TopicRoute, parse_route
from forwarder.rocketmq.protocol import INVALID_PARAMETER, TOPIC_NOT_EXIST

__all__ = ["DEFAULT_TOPIC", "DEFAULT_TOPIC_QUEUES", "RouteCache"]

log = logging.getLogger("timewheel.remoting")

DEFAULT_TOPIC = "TBW102"  # the broker creates a missing topic from this one's config when allowed
DEFAULT_TOPIC_QUEUES = 4  # queues of a topic the broker creates on first send (as the clients ask)
_TOPIC_NAME = re.compile(r"^[%|a-zA-Z0-9_-]{1,127}$")  # the broker's TopicValidator
IDLE_S = 600.0  # a route unused this long is let go
MAX_TOPICS = 10_000  # routes kept at most (about a kilobyte each); past it the least recently used goes


class RouteCache:
    """Topic routes as a producer uses them; thread-safe (see the module docstring)."""

    def __init__(self, namesrv: NameServerClient, *, ttl_s: float, retry_s: float, auto_create_topics: bool,
                 idle_s: float = IDLE_S, max_topics: int = MAX_TOPICS) -> None:
        """Empty: each topic is looked up on first use."""
        if max_topics < 1:
            raise ValueError("max_topics must be at least 1")
        self.namesrv = namesrv
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.auto_create_topics = auto_create_topics
        self.idle_s = idle_s
        self.max_topics = max_topics
        self._lock = threading.Lock()
        self._routes: dict[str, TopicRoute] = {}
        # topics with a route -> monotonic time of their last use, least recently used first
        self._used: OrderedDict[str, float] = OrderedDict()
        self._stale: set[str] = set()  # topics whose route must be looked up again before use
        self._tried: dict[str, float] = {}  # topic with a route -> monotonic time of its last look-up
        # topics without a route -> (monotonic time of the NameServer's answer, the error it meant),
        # least recently used first
        self._missing: OrderedDict[str, tuple[float, str]] = OrderedDict()
        #: called with each route looked up on the NameServer (topic, its brokers' names), not with cached ones
        self.on_route: Callable[[str, Collection[str]], None] | None = None

    def routes_of(self, topics: Iterable[str]) -> dict[str, TopicRoute | RemotingError]:
        """Each distinct topic's route, or why it has none."""
        routes: dict[str, TopicRoute | RemotingError] = {}
        for topic in dict.fromkeys(topics):
            try:
                if not _TOPIC_NAME.match(topic):
                    raise MessageRejectedError(f"{topic!r} is not a valid topic name", code=INVALID_PARAMETER)
                routes[topic] = self.route(topic)
            except RemotingError as e:
                routes[topic] = e
        return routes

    def route(self, topic: str) -> TopicRoute:
        """The topic's route: cached, looked up when missing, stale or older than `ttl_s`."""
        now = time.monotonic()
        with self._lock:
            cached = self._routes.get(topic)
            if cached is not None:
                self._used[topic] = now
                self._used.move_to_end(topic)
            ttl = self.retry_s if cached is not None and cached.via_default_topic else self.ttl_s
            due = cached is None or topic in self._stale or now - cached.fetched >= ttl
            if not due or (cached is not None and now - self._tried.get(topic, 0.0) < self.retry_s):
                assert cached is not None
                return cached
            if cached is not None:
                self._tried[topic] = now
            else:
                self._raise_if_missing(topic, now)
        try:
            route = self._lookup(topic)
        except RemotingError as e:
            if cached is None and isinstance(e, TopicNotFoundError):
                self._remember_missing(topic, now, str(e))
            route = self._keep_or_raise(topic, cached, e)
        else:
            self._remember_route(topic, route, now)
        return route

    def _keep_or_raise(self, topic: str, cached: TopicRoute | None, e: RemotingError) -> TopicRoute:
        """The last route when the failed look-up should not end its use, else the error."""
        # NameServer unreachable, or it dropped the route of a broker that went down: the last
        # route is the best guess, and that broker's connection tells the truth.
        keep = cached is not None and (
            e.retriable or (isinstance(e, TopicNotFoundError) and not cached.via_default_topic))
        if not keep:
            raise e
        assert cached is not None
        log.debug("route look-up of %s failed (%s); keeping the last route", topic, e)
        return cached

    def _remember_route(self, topic: str, route: TopicRoute, now: float) -> None:
        """Keep a route just looked up, and tell `on_route`."""
        with self._lock:
            self._routes[topic] = route
            self._missing.pop(topic, None)
            self._stale.discard(topic)
            self._used[topic] = now
            self._used.move_to_end(topic)
            self._let_go(now)
        if self.on_route is not None:
            self.on_route(topic, route.brokers.keys())

    def _raise_if_missing(self, topic: str, now: float) -> None:
        """Raise the NameServer's "no route" for `topic` again if it answered so within `retry_s` (the lock held)."""
        missing = self._missing.get(topic)
        if missing is None:
            return
        answered, why = missing
        if now - answered >= self.retry_s:
            del self._missing[topic]
            return
        self._missing.move_to_end(topic)
        raise TopicNotFoundError(why, code=TOPIC_NOT_EXIST)

    def _remember_missing(self, topic: str, now: float, why: str) -> None:
        """Keep the NameServer's "no route" for `topic`; forget the least recently used past `max_topics`."""
        with self._lock:
            self._missing[topic] = (now, why)
            self._missing.move_to_end(topic)
            while self._missing:
                oldest, (answered, _) = next(iter(self._missing.items()))
                if len(self._missing) <= self.max_topics and now - answered < self.retry_s:
                    return
                del self._missing[oldest]

    def mark_stale(self, topic: str) -> None:
        """Look the topic's route up again before its next use (a send through it failed)."""
        with self._lock:
            if topic in self._routes:  # else its next use looks it up anyway
                self._stale.add(topic)

    def __len__(self) -> int:
        """How many topics' routes are kept."""
        with self._lock:
            return len(self._routes)

    def missing_count(self) -> int:
        """How many topics' "no route" answers are kept."""
        with self._lock:
            return len(self._missing)

    def _let_go(self, now: float) -> None:
        """Forget the least recently used routes: those idle for `idle_s`, and any past `max_topics`."""
        while self._used:
            topic, used = next(iter(self._used.items()))
            if len(self._used) <= self.max_topics and now - used < self.idle_s:
                return
            del self._used[topic]
            self._routes.pop(topic, None)
            self._stale.discard(topic)
            self._tried.pop(topic, None)

    def route_document(self, topic: str) -> dict[str, Any] | None:
        """The NameServer's TopicRouteData for `topic`, or None if it has none."""
        return self.namesrv.route_document(topic)

    def _lookup(self, topic: str) -> TopicRoute:
        """Ask the NameServer; fall back to the default topic's route when allowed."""
        data = self.route_document(topic)
        if data is not None:
            route = parse_route(topic, data)
            if not route.queues:
                raise TopicNotFoundError(f"topic {topic} has no writable queue on any master broker",
                                         code=TOPIC_NOT_EXIST)
            return route
        if self.auto_create_topics:
            default = self.route_document(DEFAULT_TOPIC)
            if default is not None:
                route = parse_route(topic, default, via_default_topic=True, max_queues=DEFAULT_TOPIC_QUEUES)
                if route.queues:
                    return route
        raise TopicNotFoundError(
            f"topic {topic} does not exist: the NameServer has no route for it"
            + (" and the brokers do not create topics on first send (autoCreateTopicEnable)" if self.auto_create_topics
               else ""), code=TOPIC_NOT_EXIST)
