"""Shard leases on a real ZooKeeper: one holder, epochs that grow, the watermark handed on, a lost session."""
from __future__ import annotations

import time
import uuid
from typing import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from coordination import (HAConfig, LocalZooKeeper, ShardReplica, Watermark, publish_watermark, read_watermark, ruok,
                          shard_status)


def _wait(what: str, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def replicas(zookeeper: LocalZooKeeper) -> Iterator[Callable[..., ShardReplica]]:
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, watermark: Callable[[], int], **kw: object) -> ShardReplica:
        cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id=name, session_timeout_s=2.0,
                       watermark_interval_s=0.2, **kw)  # type: ignore[arg-type]
        r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000).start(watermark)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def test_the_local_zookeeper_answers_ruok_and_stops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    zk = LocalZooKeeper(tmp_path / "zk").start()
    try:
        address = zk.connect_string
        assert ruok(address)
        assert (tmp_path / "zk" / "data").is_dir()
    finally:
        zk.stop()
    assert zk.pid is None and not ruok(address, 0.5)


def test_one_replica_holds_and_the_next_takes_over_from_its_watermark_with_a_larger_epoch(
        replicas: Callable[..., ShardReplica]) -> None:
    a = replicas("a", lambda: 1_000)
    _wait("a holds the lease", a.may_send)
    b = replicas("b", lambda: 5)
    _wait("b follows a's watermark", lambda: b.delivered_elsewhere_up_to() == 1_000)
    assert not b.may_send() and b.epoch == 0
    first = a.epoch
    doc = b.status_document()
    assert [(s["holder"], s["epoch"], s["standbys"], s["watermark_ms"]) for s in doc["shards"]] == \
        [("a", first, ["b"], 1_000)]  # type: ignore[index]
    a.stop()  # a graceful holder publishes its last watermark and leaves: b holds at once
    _wait("b holds the lease", b.may_send, 5.0)
    assert b.epoch > first
    assert b.delivered_elsewhere_up_to() == 1_000  # what a delivered is not b's to send
    _wait("b publishes under its own epoch", lambda: b.status()["published_watermark_ms"] == 1_000)
    assert b.counters.takeovers == 1


def test_a_holder_whose_session_expires_stops_sending_and_cannot_move_its_successors_watermark(
        replicas: Callable[..., ShardReplica], zookeeper: LocalZooKeeper) -> None:
    a = replicas("a", lambda: 2_000)
    _wait("a holds the lease", a.may_send)
    b = replicas("b", lambda: 3_000)
    _wait("b follows", lambda: b.delivered_elsewhere_up_to() == 2_000)
    first = a.epoch
    # end a's session from outside, as the server does when a paused holder stops heartbeating
    sid, password = a._client.client_id
    thief = KazooClient(hosts=zookeeper.connect_string, client_id=(sid, password))
    thief.start()
    thief.stop()
    thief.close()
    _wait("b takes over", b.may_send, 10.0)
    assert b.epoch > first
    _wait("a no longer sends", lambda: not a.may_send(), 5.0)
    time.sleep(1.0)  # a is a standby now
    assert not a.may_send()
    path = b.path
    client = b._client
    assert not publish_watermark(client, path, Watermark(first, 99_999, "a", 0))  # a's old epoch is refused
    _wait("b's watermark", lambda: read_watermark(client, path).epoch == b.epoch)
    assert read_watermark(client, path).watermark_ms == 3_000
    statuses = shard_status(client, b.cfg, b.delay_topic)
    assert statuses[0].holder == "b" and statuses[0].standbys == ("a",)


def test_the_zookeeper_command_prints_its_address_serves_and_stops_on_sigterm() -> None:
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "timewheel", "zookeeper"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "zookeeper", proc.stderr.read() if proc.stderr else ""
        assert ruok(line[1])
        client = KazooClient(hosts=line[1])
        client.start(timeout=10)
        client.ensure_path("/probe")
        client.stop()
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not ruok(line[1], 0.5)
