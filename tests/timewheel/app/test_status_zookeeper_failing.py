"""`timewheel status` shows a replica whose ZooKeeper rounds keep failing, before readiness reports it."""
from __future__ import annotations

from rich.console import Console

from timewheel.app.status import render_status


def _screen(replica: dict[str, object]) -> str:
    console = Console(width=300, record=True)
    console.print(render_status({"now_ms": 1_800_000_000_000, "serving": True, "ha": {"replica": replica}}, "a:1"))
    return console.export_text()


def test_a_replica_whose_zookeeper_rounds_fail_is_shown_with_since_when_how_many_and_the_last_error() -> None:
    replica = {"replica": "r0", "shard": 0, "shards": 1, "holder": False, "epoch": 0, "eligible": True,
               "zookeeper_failing_since_ms": 1_799_999_990_000, "zookeeper_failed_rounds": 12,
               "zookeeper_last_error": "NoAuthError"}
    assert ("WARNING: ZooKeeper has failed every round since 2027-01-15 07:59:50Z (12 rounds; the last: NoAuthError): "
            "not sending, not taking the lease over") in _screen(replica)


def test_a_replica_whose_rounds_succeed_shows_no_zookeeper_warning() -> None:
    replica = {"replica": "r0", "shard": 0, "shards": 1, "holder": True, "epoch": 3, "eligible": True,
               "zookeeper_failing_since_ms": None, "zookeeper_failed_rounds": 0, "zookeeper_last_error": None}
    assert "ZooKeeper has failed" not in _screen(replica)
