"""What the scrape and the status say of traffic shaping: per-topic rows are capped, the rest counted."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from forwarder.shaping import TrafficShaper
from forwarder.shaping_rules import parse_rules
from timewheel.app.metrics import EngineCollector
from timewheel.app.status import render_status, status_document
from timewheel.lateness import LatenessBuckets
from timewheel.stats import EngineStats

T = 1_800_000_000_000
LISTED = 100  # topics the scrape labels at most (docs/OPERATIONS.md "Traffic shaping")


def test_per_topic_series_are_capped_and_the_topics_left_out_are_counted() -> None:
    shaper = TrafficShaper(parse_rules({"topics": {"ORDERS": {"rate": 1000}}}))
    topics = [f"REPLY_{i:04d}" for i in range(1_000)] + ["ORDERS"]
    for start in range(0, len(topics), 200):
        names = topics[start:start + 200]
        shaper.grant(dict.fromkeys(names, 1), T)
        for topic in names:
            shaper.record(topic, 1, 0, 0.0, T)
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: EngineStats(shaping=shaper.stats()), LatenessBuckets))
    lines = dict(line.rsplit(" ", 1) for line in generate_latest(registry).decode().splitlines()
                 if line and not line.startswith("#"))
    labelled = [k for k in lines if k.startswith("timewheel_shaping_topic_granted_total{")]
    assert len(labelled) <= LISTED
    assert 'timewheel_shaping_topic_granted_total{class="default",topic="ORDERS"}' in lines  # a rule names it
    assert float(lines["timewheel_shaping_topics_not_listed"]) == len(topics) - len(labelled)
    assert float(lines["timewheel_shaping_topics_tracked"]) == len(topics)
    assert float(lines["timewheel_shaping_granted_total"]) == len(topics)  # the totals count every topic


def test_status_names_the_listed_backed_off_topics_and_counts_the_others() -> None:
    shaper = TrafficShaper()
    for i in range(150):  # each one's send failed: the broker has no such topic
        shaper.record(f"NOPE_{i:03d}", 0, 1, 0.0, T)
    doc = status_document(EngineStats(shaping=shaper.stats()).as_dict(), serving=True, now_ms=T, lag=None,
                          lag_error=None, lateness_ms=(0.0, 0.0), lateness_count=0, lateness_span_ms=0)
    sh = doc["shaping"]
    assert sh["backed_off_topics"] == 150 and len(sh["backed_off"]) == LISTED
    assert sh["topics_tracked"] == 150 and sh["topics_not_listed"] == 150 - LISTED
    console = Console(width=100_000, record=True)
    console.print(render_status(doc, "127.0.0.1:9321"))
    text = console.export_text()
    assert "NOPE_000, NOPE_001" in text and "NOPE_099 (+50 more)" in text
