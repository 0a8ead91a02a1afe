"""`timewheel status` against a running engine (the real local RocketMQ)."""
from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from tests.polling import wait_for
from tests.timewheel.app.conftest import Running
from timewheel.app.cli import app
from timewheel.app.humantime import human_time

pytestmark = pytest.mark.rocketmq


def status_json(admin: str) -> dict:
    res = CliRunner().invoke(app, ["status", "--admin", admin, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_status_shows_what_the_engine_holds(running: Running) -> None:
    for i in range(5):  # pending: due in 5 minutes, inside the loaded segments (current and next hour)
        running.send({"TW_TARGET_TOPIC": running.target, "TW_DELAY_MS": str(5 * 60_000)}, keys=f"later-{i}")
    running.send({"TW_DELAY_MS": "0"})  # breaks the contract: no target topic, so dead-lettered at ingest
    assert wait_for(lambda: status_json(running.admin)["dead_lettered"] >= 1
                    and sum(r["pending"] for r in status_json(running.admin)["pending_by_segment"]) >= 5, 60)
    assert wait_for(lambda: status_json(running.admin)["ingest"]["lag"] == 0, 30), "ingest never caught up"
    doc = status_json(running.admin)
    assert doc["serving"] is True
    queues = doc["ingest"]["queues"]
    assert len(queues) == 4 and all(q["committed"] <= q["max_offset"] for q in queues)
    assert sum(q["max_offset"] for q in queues) >= 7  # probe + 5 pending + 1 contract-breaking
    assert doc["dead_lettered_at_ingest"] >= 1 and doc["retrying"] == 0
    late = doc["lateness_last_minute_ms"]
    assert late["count"] >= 1 and 0 <= late["p50"] <= late["p99"]
    assert doc["shaping"]["circuit_open"] is False
    assert doc["hot_paths"] == {"record_scan": True, "ingest_walk": True, "record_cut": True, "uniq_key": True}

    res = CliRunner().invoke(app, ["status", "--admin", running.admin])
    assert res.exit_code == 0, res.output
    segment = max(doc["pending_by_segment"], key=lambda r: r["pending"])["segment_ms"]
    assert human_time(segment) in res.output and str(segment) not in res.output
    for text in ("serving", "ingest lag: 0", "pending by segment", "retrying", "dead-lettered", "lateness: p50",
                 "shaping: circuit closed"):
        assert text in res.output, f"{text!r} missing from:\n{res.output}"


def test_stats_keep_their_keys_over_http(running: Running) -> None:
    import urllib.request

    with urllib.request.urlopen(f"http://{running.admin}/stats", timeout=10) as resp:
        stats = json.loads(resp.read())
    assert {"delivered", "scheduled", "ready", "retrying", "loaded_segments", "ingest", "delivery"} <= set(stats)


def test_status_without_an_engine_says_what_to_check() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = CliRunner().invoke(app, ["status", "--admin", f"127.0.0.1:{port}"])
    assert res.exit_code == 2
    assert "is `timewheel serve` running?" in res.output and "--admin HOST:PORT" in res.output


def test_the_engine_threads_carry_their_names_for_the_operating_system(running: Running) -> None:
    import threading
    from pathlib import Path

    def comms() -> set[str]:
        out = set()
        for t in threading.enumerate():
            try:
                out.add(Path(f"/proc/self/task/{t.native_id}/comm").read_text().strip())
            except OSError:
                pass
        return out

    assert wait_for(lambda: {"tw-timer", "tw-dispatch-0", "tw-housekeeping"} <= comms(), 10), comms()
    assert any(c.startswith("tw-in-") for c in comms()), comms()  # a pull thread per broker


def test_status_shows_the_look_ups_and_each_brokers_index_settings(running: Running) -> None:
    doc = status_json(running.admin)
    dedupe = doc["dedupe"]
    assert dedupe["enabled"] is True and dedupe["warnings"] == [], dedupe
    assert dedupe["brokers"] and all(s["messageIndexSafe"] == "true" for s in dedupe["brokers"].values())
    res = CliRunner().invoke(app, ["status", "--admin", running.admin], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "dedupe: " in res.output and "found" in res.output, res.output


def test_a_broker_without_a_safe_index_and_dedupe_off_are_shown_as_warnings() -> None:
    from rich.console import Console

    from timewheel.app.status import render_status

    base = {"now_ms": 1_800_000_000_000, "serving": True}
    console = Console(width=200, record=True)
    console.print(render_status({**base, "dedupe": {"enabled": True, "warnings": [
        "broker broker-b does not say messageIndexSafe=true: duplicates are possible after it crashes"]}}, "a:1"))
    console.print(render_status({**base, "dedupe": {"enabled": False, "note": "rocketmq.dedupe is off"}}, "a:1"))
    console.print(render_status({**base, "hot_paths": {"record_scan": True, "ingest_walk": False}}, "a:1"))
    text = console.export_text()
    assert "WARNING: broker broker-b does not say messageIndexSafe=true" in text
    assert "dedupe OFF: rocketmq.dedupe is off" in text
    assert "WARNING: hot paths in pure Python (not built at install): ingest_walk;" in text
    assert text.count("hot paths") == 1  # none for the documents whose loops are all compiled


def test_a_holder_that_cannot_publish_its_brokers_and_unreadable_parts_are_shown_as_warnings() -> None:
    """The replica's status said why it held its sends (`dedupe_brokers_unpublished`), but only in
    `--json` and /status: the screen on call reads showed a holder and nothing wrong."""
    from rich.console import Console

    from timewheel.app.status import render_status

    why = "the brokers this holder's data directory learnt are not published to /tw/shard-0-of-1/dedupe-brokers"
    replica = {"replica": "r0", "shard": 0, "shards": 1, "holder": True, "epoch": 3, "eligible": True,
               "dedupe_brokers_unpublished": why,
               "dedupe_brokers_unreadable": ["/tw/shard-0-of-1/dedupe-brokers/part-0-of-1 cannot be read (bad JSON)"]}
    console = Console(width=300, record=True)
    console.print(render_status({"now_ms": 1_800_000_000_000, "serving": True, "ha": {"replica": replica}}, "a:1"))
    text = console.export_text()
    assert f"WARNING: {why}" in text
    assert "WARNING: /tw/shard-0-of-1/dedupe-brokers/part-0-of-1 cannot be read (bad JSON)" in text


def test_origin_rows_that_fail_their_check_are_shown_as_a_warning() -> None:
    """A standby holds records whose origin row was lost until it holds the lease; only the log
    said so."""
    from rich.console import Console

    from timewheel.app.status import render_status

    base = {"now_ms": 1_800_000_000_000, "serving": True}
    console = Console(width=300, record=True)
    console.print(render_status({**base, "storage_corrupt_origin_rows": 3}, "a:1"))
    console.print(render_status({**base, "storage_corrupt_origin_rows": 0}, "a:1"))
    text = console.export_text()
    assert "WARNING: 3 origin sidecar row(s) fail their CRC32C" in text
    assert text.count("origin sidecar") == 1  # none while there are none


def test_not_serving_says_why_under_the_headline() -> None:
    """`NOT serving` in red was all the screen said: each reason is a line under it now."""
    from rich.console import Console

    from timewheel.app.status import render_status

    console = Console(width=200, record=True)
    console.print(render_status({"now_ms": 1_800_000_000_000, "serving": False, "not_serving_why": [
        "thread(s) died: ingest-pull-broker-a (the log has each one's traceback)"]}, "a:1"))
    lines = console.export_text().splitlines()
    assert "NOT serving" in lines[0]
    assert lines[1] == "not serving: thread(s) died: ingest-pull-broker-a (the log has each one's traceback)"


def test_a_dead_threads_reason_names_its_error_cut_to_a_line() -> None:
    from timewheel.app.readiness import not_ready_why

    class Engine:
        def checkpoint_failure(self) -> str | None:
            return None

    [why] = not_ready_why(Engine(), True, ["timewheel-timer", "ingest-pull-b"],
                          {"timewheel-timer": "OSError: [Errno 5]\n  Input/output error", "ingest-pull-b": "E: " + "x" * 999})
    assert why.startswith("thread(s) died: timewheel-timer (OSError: [Errno 5] Input/output error), ingest-pull-b (E: x")
    assert "x" * 400 not in why and "…)" in why
