"""Traffic rules: the `[shaping]` section (TOML file, admin API, meta store) parsed and validated whole.

    [shaping]
    global_rate = 20000        # messages per second over all topics; 0 = no cap
    global_burst = 2000        # optional: tokens the global bucket holds (default global_rate / 10)
    [shaping.classes.high]     # any class names; "default" catches topics without a rule
    weight = 4                 # share of the global rate under overload, relative to other busy classes
    min_share = 0.2            # fraction of the global rate this class always gets when it has work
    [shaping.topics.ORDERS]
    rate = 1000                # messages per second of this topic; 0 = no limit of its own
    burst = 100                # optional: tokens its bucket holds (default rate / 10, at least 1)
    class = "high"             # optional: default "default"
    [shaping.backoff]          # optional: how a topic whose sends fail slows down and recovers (AIMD)
    decrease = 0.5             # multiply the topic's rate by this on every failed send
    recover = 0.1              # regain this fraction of its normal rate per second of successful sends
    min_rate = 1               # never below this many messages per second

A rule set is accepted or refused as a whole: `parse_rules` raises ConfigError naming the key.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from timewheel.errors import ConfigError

DEFAULT_CLASS = "default"
_TOP_KEYS = ("global_rate", "global_burst", "classes", "topics", "backoff")
_CLASS_KEYS = ("weight", "min_share")
_TOPIC_KEYS = ("rate", "burst", "class")
_BACKOFF_KEYS = ("decrease", "recover", "min_rate")


@dataclass(frozen=True, slots=True)
class ClassRule:
    """A priority class: its weight under overload and the share of the global rate it always gets."""

    name: str
    weight: float = 1.0
    min_share: float = 0.0


@dataclass(frozen=True, slots=True)
class TopicRule:
    """A topic's own token bucket (rate 0: none) and its class."""

    topic: str
    rate: float = 0.0
    burst: float = 1.0
    cls: str = DEFAULT_CLASS


@dataclass(frozen=True, slots=True)
class BackoffRule:
    """AIMD on failed sends: multiplicative decrease, additive recovery per second, a floor."""

    decrease: float = 0.5
    recover: float = 0.1
    min_rate: float = 1.0


@dataclass(frozen=True)
class ShapingRules:
    """A validated rule set; `raw` is the accepted document, as `GET /shaping` returns it."""

    global_rate: float = 0.0
    global_burst: float = 1.0
    classes: Mapping[str, ClassRule] = field(default_factory=lambda: {DEFAULT_CLASS: ClassRule(DEFAULT_CLASS)})
    topics: Mapping[str, TopicRule] = field(default_factory=dict)
    backoff: BackoffRule = field(default_factory=BackoffRule)
    raw: Mapping[str, Any] = field(default_factory=dict)

    def class_of(self, topic: str) -> str:
        """The class a topic belongs to ("default" without a rule)."""
        rule = self.topics.get(topic)
        return rule.cls if rule is not None else DEFAULT_CLASS

    @property
    def digest(self) -> str:
        """A fingerprint of the accepted document."""
        return rules_digest(self.raw)


def rules_digest(raw: Mapping[str, Any]) -> str:
    """A stable fingerprint of a raw rule document (key order does not matter)."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: the largest number any rule may hold: far above any broker's rate, far below float overflow
MAX_NUMBER = 1e9
#: the smallest positive rate (messages per second): slower would overflow the time to the next token
MIN_RATE = 0.001


def _number(where: str, value: Any, *, low: float, high: float = MAX_NUMBER, low_open: bool = False,
            want: str) -> float:
    """A finite number within bounds, or ConfigError naming the key (huge ints included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, int) and abs(value) > MAX_NUMBER) or not math.isfinite(value):
        raise ConfigError(f"{where} = {_shown(value)} is invalid: it must be {want}")
    if value < low or (low_open and value == low) or value > high:
        raise ConfigError(f"{where} = {_shown(value)} is invalid: it must be {want}")
    return float(value)


def _rate(where: str, value: Any, want: str) -> float:
    """0 (no limit) or a rate between MIN_RATE and MAX_NUMBER messages per second."""
    rate = _number(where, value, low=0, want=want)
    if 0 < rate < MIN_RATE:
        raise ConfigError(f"{where} = {_shown(value)} is invalid: a positive rate must be at least {MIN_RATE:g} "
                          f"messages per second ({want})")
    return rate


def _shown(value: Any) -> str:
    """The value for an error message, cut short (a 400-digit number or a deep table is not read)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= 80 else text[:77] + "..."


def _table(where: str, value: Any, known: tuple[str, ...]) -> Mapping[str, Any]:
    """A table whose keys are all known, or ConfigError naming the unknown key."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} = {_shown(value)} is invalid: it must be a table")
    for key in value:
        if key not in known:
            raise ConfigError(f"unknown key {where}.{key}; known: {', '.join(known)}")
    return value


def _named(where: str, value: Any) -> Mapping[str, Any]:
    """A table of named sub-tables (any names)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} = {_shown(value)} is invalid: it must be a table of named tables")
    return value


def _name(where: str, name: Any, what: str) -> str:
    """A non-empty name, or ConfigError."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where} has an invalid {what} name {name!r}: it must be a non-empty string")
    return name


def parse_rules(raw: Mapping[str, Any] | None) -> ShapingRules:
    """Validate a raw `[shaping]` document whole; ConfigError names the first offending key."""
    raw = {} if raw is None else raw
    doc = _table("shaping", raw, _TOP_KEYS)
    global_rate = _rate("shaping.global_rate", doc.get("global_rate", 0),
                        want=f"a number of messages per second, 0 (no cap) or {MIN_RATE:g} to {MAX_NUMBER:g}")
    default_burst = max(1.0, global_rate / 10)
    global_burst = _number("shaping.global_burst", doc.get("global_burst", default_burst), low=1,
                           want="a number of messages, at least 1")
    if "global_burst" in doc and global_rate == 0:
        raise ConfigError("shaping.global_burst is set but shaping.global_rate is 0 (no cap): set both or neither")

    classes: dict[str, ClassRule] = {DEFAULT_CLASS: ClassRule(DEFAULT_CLASS)}
    for name, body in _named("shaping.classes", doc.get("classes", {})).items():
        name = _name("shaping.classes", name, "class")
        where = f"shaping.classes.{name}"
        body = _table(where, body, _CLASS_KEYS)
        classes[name] = ClassRule(
            name,
            _number(f"{where}.weight", body.get("weight", 1.0), low=MIN_RATE, want=f"a number of at least {MIN_RATE:g}"),
            _number(f"{where}.min_share", body.get("min_share", 0.0), low=0, high=1,
                    want="a fraction of the global rate between 0 and 1"))
    total_min = sum(c.min_share for c in classes.values())
    if total_min > 1 + 1e-9:
        parts = ", ".join(f"{c.name} {c.min_share:g}" for c in classes.values() if c.min_share)
        raise ConfigError(f"shaping.classes.*.min_share sum to {total_min:g} ({parts}): they must sum to at most 1")

    topics: dict[str, TopicRule] = {}
    for name, body in _named("shaping.topics", doc.get("topics", {})).items():
        name = _name("shaping.topics", name, "topic")
        where = f"shaping.topics.{name}"
        body = _table(where, body, _TOPIC_KEYS)
        rate = _rate(f"{where}.rate", body.get("rate", 0),
                     want=f"a number of messages per second, 0 (no limit of its own) or {MIN_RATE:g} to {MAX_NUMBER:g}")
        if "burst" in body and rate == 0:
            raise ConfigError(f"{where}.burst is set but {where}.rate is 0 (no limit): set a rate or drop the burst")
        burst = _number(f"{where}.burst", body.get("burst", max(1.0, rate / 10)), low=1,
                        want="a number of messages, at least 1")
        cls = body.get("class", DEFAULT_CLASS)
        if not isinstance(cls, str) or cls not in classes:
            raise ConfigError(f"{where}.class = {cls!r} names no class; the classes are: "
                              f"{', '.join(sorted(classes))} (define it under [shaping.classes.<name>])")
        topics[name] = TopicRule(name, rate, burst, cls)

    b = _table("shaping.backoff", doc.get("backoff", {}), _BACKOFF_KEYS)
    decrease = _number("shaping.backoff.decrease", b.get("decrease", 0.5), low=0, high=1, low_open=True,
                       want="a factor above 0 and below 1")
    if decrease == 1:
        raise ConfigError("shaping.backoff.decrease = 1 is invalid: it must be a factor above 0 and below 1")
    backoff = BackoffRule(
        decrease,
        _number("shaping.backoff.recover", b.get("recover", 0.1), low=0, low_open=True,
                want="a fraction of the topic's rate per second, above 0"),
        _number("shaping.backoff.min_rate", b.get("min_rate", 1.0), low=MIN_RATE,
                want=f"a number of messages per second, at least {MIN_RATE:g}"))
    return ShapingRules(global_rate, global_burst, classes, topics, backoff, json.loads(json.dumps(dict(doc))))
