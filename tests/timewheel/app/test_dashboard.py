"""The Grafana dashboard in docs/ asks only for metrics a running engine really exports."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.polling import wait_for
from tests.timewheel.app.conftest import Running

pytestmark = pytest.mark.rocketmq

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "timewheel.json"
METRIC = re.compile(r"\btimewheel_[a-z0-9_]+")


def exported(admin: str) -> set[str]:
    """Every sample name of the engine's /metrics (counters end in _total, histograms in _bucket, ...)."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def dashboard_metrics() -> dict[str, str]:
    """Metric name -> title of a panel whose query uses it."""
    doc = json.loads(DASHBOARD.read_text())
    used = {}
    for panel in doc["panels"]:
        for target in panel["targets"]:
            for name in METRIC.findall(target["expr"]):
                used[name] = panel["title"]
    for var in doc["templating"]["list"]:
        for name in METRIC.findall(json.dumps(var.get("query", ""))):
            used[name] = f"variable {var['name']}"
    return used


def test_every_metric_the_dashboard_uses_is_exported(running: Running) -> None:
    # a retried send and a dead letter make every family show up, as in production after a while
    running.send({"TW_DELAY_MS": "0"})  # no target topic: dead-lettered at ingest
    assert wait_for(lambda: "timewheel_ingest_dead_lettered_total" in exported(running.admin), 30)
    have = exported(running.admin)
    used = dashboard_metrics()
    assert len(used) >= 15, "the dashboard should cover lateness, throughput, pending, retries, shaping"
    missing = {name: title for name, title in used.items() if name not in have}
    assert not missing, f"the dashboard asks for metrics the engine does not export: {missing}\n" \
                        f"exported: {sorted(have)}"


def test_the_pull_consumers_counters_are_exported_with_the_ingests(running: Running) -> None:
    # a pull answer that skips offsets is logged, and the operator's alert needs it as a number too
    running.send({"TW_DELAY_MS": "0"})
    assert wait_for(lambda: "timewheel_ingest_pulled_total" in exported(running.admin), 30)
    have = exported(running.admin)
    for name in ("pull_gaps", "bad_answers", "offset_resets", "refused", "ingested"):
        assert f"timewheel_ingest_{name}_total" in have, sorted(n for n in have if n.startswith("timewheel_ingest"))


def test_the_dashboard_is_importable_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "timewheel" and doc["panels"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in doc["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
