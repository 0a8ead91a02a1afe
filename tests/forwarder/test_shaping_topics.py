"""Traffic shaping under a flood of one-off target topics (a request id in the topic name, a fuzzer):
the shaper's state and its stats stay bounded by the topics in use, never by every topic ever seen;
what a rule names, and what is backed off, is kept."""
from __future__ import annotations

from typing import Any, cast

from forwarder.shaping import TrafficShaper
from forwarder.shaping_rules import parse_rules

T = 1_800_000_000_000
FLOOD = 100_000
LISTED = 100  # topics `stats()` lists at most (docs/OPERATIONS.md "Traffic shaping")
TRACKED = 10_000  # idle topics the shaper keeps state for at most
IDLE_MS = 60_000  # an idle topic's state is dropped after this


def _rows(shaper: TrafficShaper) -> dict[str, dict[str, Any]]:
    """The per-topic rows `stats()` lists."""
    return cast(dict[str, dict[str, Any]], shaper.stats()["topics"])


def _flood(shaper: TrafficShaper, now: int, n: int = FLOOD, per_pass: int = 250) -> None:
    """`n` distinct topics, each with one message granted and sent once (every one is granted at once)."""
    for start in range(0, n, per_pass):
        names = [f"REPLY_{i:06d}" for i in range(start, start + per_pass)]
        assert shaper.grant(dict.fromkeys(names, 1), now) == dict.fromkeys(names, 1)
        for topic in names:
            shaper.record(topic, 1, 0, 0.0, now)


def test_a_hundred_thousand_one_off_topics_leave_bounded_state_and_stats() -> None:
    shaper = TrafficShaper()
    _flood(shaper, T)
    st = shaper.stats()
    topics = cast(dict[str, dict[str, Any]], st["topics"])
    assert len(topics) <= LISTED
    assert isinstance(st["topics_tracked"], int) and st["topics_tracked"] <= TRACKED
    assert st["topics_not_listed"] == st["topics_tracked"] - len(topics)
    # the totals go on counting what the dropped topics did (they are exported as counters)
    assert st["granted"] == st["sent"] == FLOOD
    assert cast(dict[str, dict[str, Any]], st["classes"])["default"]["sent"] == FLOOD

    # a minute later nothing of the flood is left; a topic coming back starts anew
    shaper.record("REPLY_000001", 1, 0, 0.0, T + IDLE_MS + 1)
    st = shaper.stats()
    assert st["topics_tracked"] == 1 and st["topics_not_listed"] == 0
    assert [(t, row["sent"]) for t, row in _rows(shaper).items()] == [("REPLY_000001", 1)]
    assert st["sent"] == FLOOD + 1


def test_topics_named_by_a_rule_or_backed_off_are_kept_through_the_flood() -> None:
    # recovery this slow takes 500 s to undo a halving: FLAKY is still backed off a minute later
    shaper = TrafficShaper(parse_rules({"topics": {"ORDERS": {"rate": 100, "burst": 10}},
                                        "backoff": {"recover": 0.001}}))
    assert shaper.grant({"ORDERS": 10, "FLAKY": 50}, T) == {"ORDERS": 10, "FLAKY": 50}
    shaper.record("ORDERS", 10, 0, 0.0, T)
    shaper.record("FLAKY", 40, 10, 0.0, T)  # its rate halves: from the 50 it sent to 25 per second

    _flood(shaper, T)
    st = _rows(shaper)
    assert {"ORDERS", "FLAKY"} <= set(st)
    assert st["FLAKY"]["backed_off"] and st["FLAKY"]["effective_rate"] == 25
    # their buckets are as they were: ORDERS spent its burst, FLAKY waits for its first token
    assert shaper.grant({"ORDERS": 5, "FLAKY": 50}, T) == {}
    shaper.grant({}, T)  # nothing waits any more

    later = T + IDLE_MS + 1
    _flood(shaper, later, n=2_000)
    st = _rows(shaper)
    assert {"ORDERS", "FLAKY"} <= set(st)
    # its recovery is worked out at its next successful send, not while it is idle
    assert st["FLAKY"]["backed_off"] and st["FLAKY"]["effective_rate"] == 25
    assert not shaper.passes_through()
    assert shaper.grant({"ORDERS": 20}, later) == {"ORDERS": 10}  # a full bucket, not more


def test_a_topic_whose_send_failed_once_does_not_keep_shaping_on_for_ever() -> None:
    shaper = TrafficShaper()
    shaper.record("NO_SUCH_TOPIC", 0, 1, 0.0, T)  # the broker has no such topic; its message dead-letters
    assert not shaper.passes_through() and shaper.stats()["backed_off_topics"] == 1
    shaper.record("ORDERS", 1, 0, 0.0, T + 1_000)
    assert not shaper.passes_through()  # within the minute it is kept, backed off
    # a minute idle, its rate long recovered by the clock: its state goes, and shaping with it
    shaper.record("ORDERS", 1, 0, 0.0, T + IDLE_MS + 1)
    assert shaper.passes_through()
    st = shaper.stats()
    assert st["backed_off_topics"] == 0 and set(_rows(shaper)) == {"ORDERS"}
    assert st["failed"] == 1 and st["backoffs"] == 1
