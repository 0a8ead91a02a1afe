"""The traffic shaper's state per topic, and how much of it is kept and listed.

Producers choose target topics, and some name a new one per message (a request id in the name, a
fuzzer): the shaper must not keep every topic it ever saw. A topic is *idle* when nothing of it
waits or is granted and unsent, no rule names it, and it is not backed off (a backoff counts as
over once the clock alone would have brought its rate back: its next successful send would end it).
An idle topic's state is dropped `IDLE_MS` after its last use, and, past `MAX_TOPICS`, the least
recently used idle ones go at once. A topic that comes back starts anew, as a topic never seen does.
`stats()` lists at most `LISTED_TOPICS` topics, those a rule names or backed off first, then the
ones with the most waiting, then the most recently used.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from forwarder.shaping_shares import EPS

__all__ = ["IDLE_MS", "LISTED_TOPICS", "MAX_TOPICS", "Bucket", "Counters", "TopicState", "backoff_lapsed",
           "least_recent", "listed"]

#: an idle topic's state is dropped this long after its last use
IDLE_MS = 60_000
#: topics with state at most before the least recently used idle ones are dropped (about 400 bytes each)
MAX_TOPICS = 10_000
#: topics `stats()` (so `/status` and `/metrics`) lists at most; the others are counted
LISTED_TOPICS = 100
#: a clock this far behind a bucket's last refill was stepped back (NTP, a VM restored): the bucket
#: refills from its new reading on; less is threads' readings of one moment arriving out of order
_CLOCK_STEP_BACK_MS = 1000


class Bucket:
    """Tokens refilled lazily at a rate (per second) up to a burst."""

    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: int) -> None:
        self.tokens = tokens
        self.stamp = stamp

    def refill(self, now: int, rate: float, burst: float) -> None:
        """Add what `rate` earned since the last refill, up to `burst`."""
        if now > self.stamp:
            self.tokens = min(burst, self.tokens + rate * (now - self.stamp) / 1000)
            self.stamp = now
        else:
            self.tokens = min(burst, self.tokens)
            if now < self.stamp - _CLOCK_STEP_BACK_MS:  # else it would earn nothing until the clock caught up
                self.stamp = now

    def whole(self) -> int:
        """Whole tokens available."""
        return max(0, math.floor(self.tokens + EPS))

    def ms_until(self, tokens: float, rate: float) -> int:
        """Milliseconds from the last refill until `tokens` are there."""
        missing = tokens - EPS - self.tokens
        return 0 if missing <= 0 else max(1, math.ceil(missing * 1000 / rate))


@dataclass(slots=True)
class Counters:
    """What shaping did to a topic or a class."""

    granted: int = 0
    released: int = 0  # granted, then given back untaken (`granted` only grows: it is exported as a counter)
    sent: int = 0
    failed: int = 0
    throttled: int = 0  # messages held back at least once by a limit (a retried message counts again)
    held_ms_sum: float = 0.0  # time messages waited in the dispatch queues before their send
    held_count: int = 0
    backoffs: int = 0  # multiplicative decreases after failed sends


class TopicState:
    """Per-topic state: bucket, backoff, observed rate, fair-share remainder, counters, last use."""

    __slots__ = ("bucket", "backoff_rate", "backoff_base", "backoff_stamp", "observed", "observed_stamp", "credit",
                 "denied", "outstanding", "counters", "last_ms")

    def __init__(self, now: int) -> None:
        self.bucket: Bucket | None = None  # None while the topic has no limit (pass-through)
        self.backoff_rate: float | None = None  # None while not backed off
        self.backoff_base = 0.0  # the rate recovery aims at when the topic has no limit of its own
        self.backoff_stamp = 0
        self.observed = 0.0  # messages per second, exponentially decayed over about a second
        self.observed_stamp = 0
        self.credit = 0.0
        self.denied = 0  # messages at the head of its queue already held back once
        self.outstanding = 0  # granted, not yet recorded as sent or failed
        self.counters = Counters()
        self.last_ms = now  # the last grant, pass or outcome that named it


def backoff_lapsed(st: TopicState, limit: float, recover: float, now: int) -> bool:
    """Whether the clock alone has brought a backed-off topic's rate back to `limit` (its own, or
    else the rate it had), as its next successful send would count it (`TrafficShaper.record`)."""
    if st.backoff_rate is None:
        return True
    target = limit or st.backoff_base
    return st.backoff_rate + recover * target * max(0, now - st.backoff_stamp) / 1000 >= target


def least_recent(topics: Mapping[str, TopicState], idle: Callable[[str, TopicState], bool], now: int,
                 keep: int) -> list[str]:
    """The idle topics to drop: those unused for `IDLE_MS`, then the least recently used others
    until at most `keep` topics are left (fewer go when too few are idle)."""
    candidates = [(st.last_ms, name) for name, st in topics.items() if idle(name, st)]
    expired = [name for last, name in candidates if now - last >= IDLE_MS]
    excess = len(topics) - len(expired) - keep
    if excess <= 0:
        return expired
    recent = heapq.nsmallest(excess, ((last, name) for last, name in candidates if now - last < IDLE_MS))
    return expired + [name for _, name in recent]


def listed(topics: Mapping[str, TopicState], first: Callable[[str, TopicState], bool],
           waiting: Mapping[str, int], limit: int = LISTED_TOPICS) -> Iterable[str]:
    """The topics to list, by name: at most `limit`, those `first` names before the others, then
    the ones with the most waiting, then the most recently used."""
    if len(topics) <= limit:
        return sorted(topics)
    return sorted(heapq.nlargest(limit, topics, key=lambda t: (first(t, topics[t]), waiting.get(t, 0),
                                                               topics[t].last_ms)))
