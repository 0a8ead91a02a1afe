"""Traffic shaping for dispatch: the engine's Shaper, from per-topic buckets to priority classes.

The engine holds due messages in a FIFO queue per topic and asks `grant(backlog, now)` how many of
each may go now; this shaper answers with tokens it takes at once:

1. Per topic, a token bucket (`rate`, `burst`) caps what the topic may send: its *demand* is
   `min(waiting, whole tokens)`. A topic without a rule, not backed off, has no bucket: its demand is
   all it has waiting (pass-through).
2. A global bucket (`global_rate`, 0 = none) caps the sum. When the demand fits, all of it is granted.
   Otherwise (overload) the global tokens are shared among the classes that have demand: each busy
   class gets its `min_share` of the global rate first (never starves), the rest goes by `weight`;
   what a class cannot use (its topics' buckets are empty) goes to the others. Inside a class, topics
   share equally, each within its own bucket (max-min fair). Shares are worked out as a fluid
   water-filling, rounded to whole messages with a carried remainder per class and per topic, so the
   long-run split is exact even when a pass grants one message at a time.
3. Adaptive backoff (AIMD): a failed send (`record(..., failed > 0)`: broker busy, timeout, down)
   multiplies the topic's rate by `backoff.decrease` (from its limit, or from its observed rate if it
   has none), down to `backoff.min_rate`; each successful send then adds back `backoff.recover` of its
   normal rate per second elapsed, until it is normal again and the backoff ends.

No pass grants more than `max_grant` messages (the engine's send batch), so every grant is taken;
a caller that takes fewer gives the rest back with `release`. Grants are final otherwise, so several
dispatch threads can hold grants at once (sends in flight) without their tokens being spent twice. `next_grant_ms` answers when a waiting topic will have about `pace_ms` worth of
its rate (at least one message, at most its burst): throttled topics then go in batches of a few
milliseconds' worth rather than one message per millisecond, at the same rate.

New rules (`apply`) take effect at the next call, with buckets refilled up to then under the old ones.
The state of a topic idle for a minute is dropped, and `stats()` lists a bounded number of topics
(`forwarder.shaping_topics`): memory follows the topics in use, not every topic ever seen.
Thread-safe: one lock around everything (the dispatch threads call it; admin and config threads
apply rules and read stats).
"""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Mapping

from forwarder.shaping_rules import DEFAULT_CLASS, ShapingRules, parse_rules
from forwarder.shaping_shares import class_shares, fair_split
from forwarder.shaping_topics import (IDLE_MS, MAX_TOPICS, Bucket as _Bucket, Counters as _Counters,
                                      TopicState as _Topic, backoff_lapsed, least_recent, listed)

_PAUSED_RECHECK_MS = 10
_SWEEP_EVERY_MS = IDLE_MS // 6  # so an idle topic's state goes between one and 1.2 idle periods after its last use


class TrafficShaper:
    """Per-topic token buckets, a global cap, weighted priority classes with guaranteed minimum
    shares, and AIMD backoff of topics whose sends fail. Implements `timewheel.Shaper`."""

    def __init__(self, rules: ShapingRules | None = None, *, max_grant: int = 256, pace_ms: int = 10,
                 paused: bool = False) -> None:
        """`max_grant`: most messages one grant lets go (the engine's send batch); `pace_ms`: while
        topics are throttled, wake for about this much of their rate at a time (fewer, fuller batches)."""
        if max_grant < 1 or pace_ms < 0:
            raise ValueError("max_grant must be at least 1 and pace_ms at least 0")
        self.max_grant = max_grant
        self.pace_ms = pace_ms
        self._rules = rules or parse_rules({})
        self._pending: ShapingRules | None = None
        self._lock = threading.Lock()
        self._topics: dict[str, _Topic] = {}
        self._classes: dict[str, _Counters] = {}
        self._class_credit: dict[str, float] = {}
        self._global: _Bucket | None = None
        self._global_started = False
        self._waiting: dict[str, int] = {}
        self._paused = paused
        self._backed_off: set[str] = set()  # topics whose failed sends lowered their rate
        self._sweep_ms: int | None = None  # when idle topics are looked for next (None: at the next call)
        self._sweep_size = MAX_TOPICS  # ... or once this many topics have state

    # ---- rules ------------------------------------------------------------------------------------

    @property
    def rules(self) -> ShapingRules:
        """The rules in force (or about to be, at the next call)."""
        with self._lock:
            return self._pending or self._rules

    def apply(self, rules: ShapingRules) -> None:
        """Replace the rules; they take effect at the next grant, record or next_grant_ms."""
        with self._lock:
            self._pending = rules

    def pause(self) -> None:
        """Grant nothing until `resume` (while the rules in force are being settled)."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Grant again."""
        with self._lock:
            self._paused = False

    def passes_through(self) -> bool:
        """Whether no rule applies now: no topic rate, no global rate, no topic backed off, not paused,
        nothing held back. The caller may then send due messages at once, past its held queues and
        without asking for grants; it still reports outcomes with `record` (a failed send backs its
        topic off, and this turns False until the topic has recovered). A read without the lock: a
        rule applied meanwhile holds from the caller's next look."""
        rules = self._pending or self._rules
        return not (self._paused or self._backed_off or self._waiting or rules.global_rate > 0
                    or _limits_a_topic(rules))

    # ---- the Shaper protocol ------------------------------------------------------------------------

    def grant(self, backlog: Mapping[str, int], now_ms: int) -> dict[str, int]:
        """How many of each waiting topic may be sent now; the tokens are taken."""
        with self._lock:
            self._sync(now_ms)
            waiting = {t: n for t, n in backlog.items() if n > 0}
            if self._paused or not waiting:
                self._waiting = waiting
                return {}
            rules = self._rules
            demand: dict[str, int] = {}
            bucket_limited: set[str] = set()
            for topic, n in waiting.items():
                st = self._topic(topic, now_ms)
                rate, _ = self._refresh(topic, st, now_ms)
                if rate is None or st.bucket is None:
                    demand[topic] = n
                else:
                    demand[topic] = min(n, st.bucket.whole())
                    if demand[topic] < n:
                        bucket_limited.add(topic)
            total_demand = sum(demand.values())
            available = total_demand
            if self._global is not None:
                self._global.refill(now_ms, rules.global_rate, rules.global_burst)
                available = self._global.whole()
            globally_limited = available < total_demand
            total = min(total_demand, available, self.max_grant)
            grants = demand if total >= total_demand else self._share(total, demand, rules)
            for topic, n in waiting.items():
                self._account(topic, n, grants.get(topic, 0),
                              globally_limited or topic in bucket_limited, rules.class_of(topic))
            if self._global is not None:
                self._global.tokens -= sum(grants.values())
            self._waiting = {t: n - grants.get(t, 0) for t, n in waiting.items() if n > grants.get(t, 0)}
            self._forget_idle(now_ms)
            return {t: g for t, g in grants.items() if g > 0}

    def next_grant_ms(self, now_ms: int) -> int | None:
        """When a waiting topic will have about `pace_ms` of its rate to send (None: nothing waits)."""
        with self._lock:
            self._sync(now_ms)
            if self._paused:
                return now_ms + _PAUSED_RECHECK_MS
            if not self._waiting:
                return None
            wait = math.inf
            for topic, n in self._waiting.items():
                st = self._topic(topic, now_ms)
                rate, burst = self._refresh(topic, st, now_ms)
                if rate is None or st.bucket is None:
                    wait = 0
                    break
                wait = min(wait, st.bucket.ms_until(self._pace_target(rate, burst, n), rate))
            if self._global is not None:
                rules = self._rules
                self._global.refill(now_ms, rules.global_rate, rules.global_burst)
                target = self._pace_target(rules.global_rate, rules.global_burst, sum(self._waiting.values()))
                wait = max(wait, self._global.ms_until(target, rules.global_rate))
            return now_ms + int(wait)

    def record(self, topic: str, sent: int, failed: int, held_ms: float, now_ms: int) -> None:
        """Account a send's outcome; failures back the topic off, successes let it recover."""
        with self._lock:
            self._sync(now_ms)
            rules = self._rules
            st = self._topic(topic, now_ms)
            n = sent + failed
            st.outstanding = max(0, st.outstanding - n)
            decay = math.exp(-max(0, now_ms - st.observed_stamp) / 1000) if st.observed_stamp else 0.0
            st.observed = st.observed * decay + n
            st.observed_stamp = now_ms
            for c in (st.counters, self._class(rules.class_of(topic))):
                c.sent += sent
                c.failed += failed
                c.held_ms_sum += held_ms
                c.held_count += n
            rate, _ = self._refresh(topic, st, now_ms)  # earn tokens at the old rate up to now
            rule = rules.topics.get(topic)
            limit = rule.rate if rule is not None and rule.rate > 0 else 0.0
            if failed:
                b = rules.backoff
                current = rate if rate is not None else max(st.observed, b.min_rate)
                if st.backoff_rate is None:
                    st.backoff_base = limit or max(st.observed, b.min_rate)
                st.backoff_rate = max(b.min_rate, current * b.decrease)
                self._backed_off.add(topic)
                st.backoff_stamp = now_ms
                st.counters.backoffs += 1
                self._class(rules.class_of(topic)).backoffs += 1
                if st.bucket is None:
                    st.bucket = _Bucket(0.0, now_ms)  # it just failed: it waits for its first token
                self._refresh(topic, st, now_ms)
            elif sent and st.backoff_rate is not None:
                target = limit or st.backoff_base
                st.backoff_rate += rules.backoff.recover * target * max(0, now_ms - st.backoff_stamp) / 1000
                st.backoff_stamp = now_ms
                if st.backoff_rate >= target:
                    st.backoff_rate = None
                    self._backed_off.discard(topic)
                    if not limit:
                        st.bucket = None
            self._forget_idle(now_ms)

    def stats(self) -> dict[str, object]:
        """Totals, and per class and per listed topic (at most `LISTED_TOPICS`, `topics_not_listed`
        counts the others): granted, released, sent, failed, throttled, held time, backoffs."""
        with self._lock:
            rules = self._pending or self._rules
            total = _Counters()  # over the classes: they count what topics whose state was dropped did
            for c in self._classes.values():
                for f in ("granted", "released", "sent", "failed", "throttled", "held_count", "backoffs"):
                    setattr(total, f, getattr(total, f) + getattr(c, f))
                total.held_ms_sum += c.held_ms_sum
            topics: dict[str, object] = {}
            for name in listed(self._topics, lambda t, st: t in rules.topics or st.backoff_rate is not None,
                               self._waiting):
                st = self._topics[name]
                c = st.counters
                rate, _ = self._limit(name, st, rules)
                rule = rules.topics.get(name)
                topics[name] = {"class": rules.class_of(name), "rate_limit": rule.rate if rule else 0.0,
                                "effective_rate": rate or 0.0, "backed_off": st.backoff_rate is not None,
                                "waiting": self._waiting.get(name, 0), **asdict(c)}
            classes = {name: {"weight": rules.classes[name].weight if name in rules.classes else 0.0,
                              "min_share": rules.classes[name].min_share if name in rules.classes else 0.0,
                              **asdict(c)}
                       for name, c in sorted(self._classes.items())}
            return {**asdict(total), "backed_off_topics": len(self._backed_off),
                    "topics_tracked": len(self._topics), "topics_not_listed": len(self._topics) - len(topics),
                    "waiting": sum(self._waiting.values()), "global_rate": rules.global_rate,
                    "paused": self._paused, "rules_digest": rules.digest, "topics": topics, "classes": classes}

    # ---- inside -------------------------------------------------------------------------------------

    def _topic(self, topic: str, now: int) -> _Topic:
        st = self._topics.get(topic)
        if st is None:
            st = self._topics[topic] = _Topic(now)
        else:
            st.last_ms = now
        return st

    def _idle(self, topic: str, st: _Topic, now: int) -> bool:
        """Whether the topic's state may go: it comes back as new with nothing lost (module docstring)."""
        if st.outstanding or topic in self._waiting or topic in self._rules.topics \
                or (self._pending is not None and topic in self._pending.topics):
            return False
        return backoff_lapsed(st, 0.0, self._rules.backoff.recover, now)

    def _forget_idle(self, now: int) -> None:
        """Drop idle topics' state, every `_SWEEP_EVERY_MS` or once `_sweep_size` topics have some."""
        due = self._sweep_ms
        if len(self._topics) <= self._sweep_size and due is not None and due - 2 * _SWEEP_EVERY_MS <= now < due:
            return  # (a clock stepped far back looks again at once)
        keep = MAX_TOPICS // 2 if len(self._topics) > MAX_TOPICS else MAX_TOPICS  # below the cap: the expired only
        for topic in least_recent(self._topics, lambda t, st: self._idle(t, st, now), now, keep):
            del self._topics[topic]
            self._backed_off.discard(topic)
        self._sweep_ms = now + _SWEEP_EVERY_MS
        # topics in use stay: the next look waits for half the cap of new ones, not for the next one
        self._sweep_size = max(MAX_TOPICS, len(self._topics) + MAX_TOPICS // 2)

    def _class(self, name: str) -> _Counters:
        c = self._classes.get(name)
        if c is None:
            c = self._classes[name] = _Counters()
        return c

    def _pace_target(self, rate: float, burst: float, waiting: int) -> float:
        """Tokens worth waking for: `pace_ms` of the rate, within the burst and what waits; at least 1."""
        return max(1.0, min(burst, float(waiting), rate * self.pace_ms / 1000))

    def _limit(self, topic: str, st: _Topic, rules: ShapingRules) -> tuple[float | None, float]:
        """The topic's effective (rate, burst): its rule, lowered while backed off; None = no limit."""
        rule = rules.topics.get(topic)
        limit = rule.rate if rule is not None and rule.rate > 0 else 0.0
        if st.backoff_rate is not None:
            rate = min(limit, st.backoff_rate) if limit else st.backoff_rate
            burst = max(1.0, rule.burst * rate / limit) if limit and rule is not None else max(1.0, rate / 10)
            return rate, burst
        if limit and rule is not None:
            return limit, rule.burst
        return None, 0.0

    def _refresh(self, topic: str, st: _Topic, now: int) -> tuple[float | None, float]:
        """The topic's limit, with its bucket created, dropped or refilled to `now` to match."""
        rate, burst = self._limit(topic, st, self._rules)
        if rate is None:
            st.bucket = None
        elif st.bucket is None:
            st.bucket = _Bucket(burst, now)  # a new limit starts with a full bucket
        else:
            st.bucket.refill(now, rate, burst)
        return rate, burst

    def _sync(self, now: int) -> None:
        """Switch to pending rules: refill every bucket up to `now` under the old ones first."""
        if self._pending is None:
            if not self._global_started:
                self._set_global(now)
            return
        for topic, st in self._topics.items():
            self._refresh(topic, st, now)
        if self._global is not None:
            self._global.refill(now, self._rules.global_rate, self._rules.global_burst)
        self._rules, self._pending = self._pending, None
        for topic, st in self._topics.items():
            self._refresh(topic, st, now)
            st.credit = 0.0
        self._class_credit.clear()
        self._set_global(now)

    def _set_global(self, now: int) -> None:
        self._global_started = True
        rules = self._rules
        if rules.global_rate <= 0:
            self._global = None
        elif self._global is None:
            self._global = _Bucket(rules.global_burst, now)
        else:
            self._global.tokens = min(self._global.tokens, rules.global_burst)

    def release(self, topic: str, n: int) -> None:
        """Give back `n` granted messages of `topic` the caller did not take (their tokens return)."""
        with self._lock:
            st = self._topics.get(topic)
            n = min(n, st.outstanding) if st is not None else 0
            if n <= 0:
                return
            assert st is not None
            if st.bucket is not None:
                st.bucket.tokens += n
            if self._global is not None:
                self._global.tokens += n
            st.counters.released += n
            self._class(self._rules.class_of(topic)).released += n
            st.outstanding -= n

    def _share(self, total: int, demand: Mapping[str, int], rules: ShapingRules) -> dict[str, int]:
        """Split `total` (< the sum of demand) among classes, then among each class's topics."""
        by_class: dict[str, dict[str, int]] = {}
        for topic, d in demand.items():
            if d > 0:
                by_class.setdefault(rules.class_of(topic), {})[topic] = d
        for name in list(self._class_credit):
            if name not in by_class:
                del self._class_credit[name]
        shares = class_shares({c: rules.classes[c].weight for c in by_class},
                              {c: rules.classes[c].min_share for c in by_class})
        per_class = fair_split(total, {c: sum(ts.values()) for c, ts in by_class.items()},
                               {c: max(s, 1e-9) for c, s in shares.items()},
                               self._class_credit)
        grants: dict[str, int] = {}
        for name, topics in by_class.items():
            credit = {t: self._topics[t].credit for t in topics}
            grants.update(fair_split(per_class[name], topics, {t: 1.0 for t in topics}, credit))
            for t, c in credit.items():
                self._topics[t].credit = c
        for topic, d in demand.items():
            if d <= 0:
                self._topics[topic].credit = 0.0
        return grants

    def _account(self, topic: str, waiting: int, granted: int, limited: bool, cls: str) -> None:
        """Take the topic's tokens and count what was held back by a limit (not by batch size)."""
        st = self._topics[topic]
        if granted:
            if st.bucket is not None:
                st.bucket.tokens -= granted
            st.outstanding += granted
            st.counters.granted += granted
            self._class(cls).granted += granted
        still_denied = max(0, st.denied - granted)  # the head of the queue goes first
        if limited:
            newly = max(0, waiting - granted - still_denied)
            st.counters.throttled += newly
            self._class(cls).throttled += newly
            st.denied = waiting - granted
        else:
            st.denied = still_denied


def _limits_a_topic(rules: ShapingRules) -> bool:
    """Whether some topic of the rule set has a rate of its own."""
    return any(r.rate > 0 for r in rules.topics.values())


__all__ = ["DEFAULT_CLASS", "TrafficShaper", "class_shares", "fair_split"]
