"""A replica's data directory: it names its replica, remembers where it stands, and keeps a replica
with a gap, or still catching up, out of the lease (unless forced)."""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from tests.coordination.cluster import wait_for
from coordination import HAConfig, LocalZooKeeper, ShardReplica
from coordination.identity import Eligibility, ReplicaDataDir, ReplicaIdentityMismatch

TOPIC = "TW_DELAY"


def _cfg(**kw: object) -> HAConfig:
    return HAConfig(**{"zookeeper": "127.0.0.1:2181", "replica_id": "a", "shards": 2, "shard": 0, **kw})  # type: ignore[arg-type]


class _Ingest:
    """What the replica asks the ingest: whether it read every queue to the end, the broker's moves, its offsets."""

    def __init__(self) -> None:
        self.caught_up: int | None = None
        self.moved: list[str] = []
        self.offsets: dict[str, int] = {}

    def catch_up(self) -> tuple[int | None, list[str]]:
        return self.caught_up, list(self.moved)

    def stored_offsets(self) -> dict[str, int]:
        return dict(self.offsets)


def test_a_data_directory_refuses_to_start_as_another_replica(tmp_path: Path) -> None:
    ReplicaDataDir(tmp_path, _cfg(), TOPIC)
    ReplicaDataDir(tmp_path, _cfg(), TOPIC)  # the same replica again: fine
    for other in (_cfg(shard=1), _cfg(replica_id="b"), _cfg(shards=4)):
        with pytest.raises(ReplicaIdentityMismatch, match="belongs to replica 'a' of shard 0 of 2 on TW_DELAY") as e:
            ReplicaDataDir(tmp_path, other, TOPIC)
        assert f"configured as replica {other.replica_id!r} of shard {other.shard} of {other.shards}" in str(e.value)
    with pytest.raises(ReplicaIdentityMismatch, match="on OTHER_TOPIC"):
        ReplicaDataDir(tmp_path, _cfg(), "OTHER_TOPIC")


def test_the_service_refuses_a_directory_of_another_shard_with_a_start_error(tmp_path: Path) -> None:
    from timewheel.app.service import StartError, _claim_data_dir

    _claim_data_dir(tmp_path / "d", _cfg(), TOPIC).save({"broker-a:0": 5})  # it stored something
    with pytest.raises(StartError, match="belongs to replica 'a' of shard 0"):
        _claim_data_dir(tmp_path / "d", _cfg(shard=1), TOPIC)


def test_eligible_once_caught_up_and_where_it_stands_survives_a_restart(tmp_path: Path) -> None:
    d = ReplicaDataDir(tmp_path, _cfg(), TOPIC)
    assert d.new and d.offsets == {}  # new: every queue starts at its earliest retained offset
    ingest = _Ingest()
    e = Eligibility(d, ingest.catch_up, ingest.stored_offsets)
    assert not e.check() and "catching up" in e.reason
    ingest.offsets, ingest.caught_up = {"broker-a:0": 120, "broker-a:2": 7}, 1_000
    assert e.check() and e.status() == {"eligible": True, "eligibility": "caught up", "gap": None}
    again = ReplicaDataDir(tmp_path, _cfg(), TOPIC)  # restarted (or restored): starts where it stood
    assert not again.new and again.offsets == {"broker-a:0": 120, "broker-a:2": 7}


def test_an_offset_the_broker_moved_is_a_gap_that_survives_a_restart_until_forced(tmp_path: Path) -> None:
    ingest = _Ingest()
    ingest.offsets, ingest.caught_up = {"broker-a:0": 500}, 1_000
    ingest.moved = ["broker-a:0 120 -> 480"]  # retention removed 120-479 before this directory read them
    e = Eligibility(ReplicaDataDir(tmp_path, _cfg(), TOPIC), ingest.catch_up, ingest.stored_offsets)
    assert not e.check() and "broker-a:0 120 -> 480" in e.reason
    ingest2 = _Ingest()
    ingest2.caught_up = 2_000
    restarted = Eligibility(ReplicaDataDir(tmp_path, _cfg(), TOPIC), ingest2.catch_up, ingest.stored_offsets)
    assert not restarted.check() and "gap" in restarted.reason  # caught up, but the gap is remembered
    forced = Eligibility(ReplicaDataDir(tmp_path, _cfg(), TOPIC), ingest2.catch_up, ingest.stored_offsets,
                         force=True)
    assert forced.check() and forced.reason.startswith("forced")


def test_a_replica_that_is_not_eligible_follows_but_does_not_contend_until_it_caught_up(
        zookeeper: LocalZooKeeper, tmp_path: Path) -> None:
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def replica(name: str, ingest: _Ingest) -> ShardReplica:
        cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id=name, session_timeout_s=2.0,
                       watermark_interval_s=0.2)
        r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000)
        r.eligibility = Eligibility(ReplicaDataDir(tmp_path / name, cfg, topic), ingest.catch_up,
                                    ingest.stored_offsets)
        made.append(r.start(lambda: 1_000))
        return r

    try:
        ready, behind = _Ingest(), _Ingest()
        ready.caught_up = 1
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = replica("a", ready)
        wait_for("a holds the lease", a.may_send)
        b = replica("b", behind)
        wait_for("b follows a's watermark", lambda: b.delivered_elsewhere_up_to() == 1_000)
        doc = b.status_document()
        assert doc["replica"]["eligible"] is False and "catching up" in doc["replica"]["eligibility"]  # type: ignore[index]
        assert doc["shards"][0]["standbys"] == []  # type: ignore[index]  # no lease node: not a contender
        a.stop()
        time.sleep(1.0)
        assert not b.may_send()  # the shard has no holder rather than one with a gap
        behind.caught_up = 2
        wait_for("b holds the lease once caught up", b.may_send)
    finally:
        for r in made:
            r.stop()


def test_a_replicas_consumer_starts_where_its_directory_stood_or_at_the_earliest_offset_and_reports_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not at the group's committed offset: a wiped directory under an old group would skip what it
    never stored. A broker's PULL_OFFSET_MOVED is kept as a gap."""
    from forwarder.rocketmq.consumer import RemotingPullConsumer
    from forwarder.rocketmq.protocol import (GET_MIN_OFFSET, PULL_OFFSET_MOVED, QUERY_CONSUMER_OFFSET, SUCCESS,
                                             Response)

    c = RemotingPullConsumer("127.0.0.1:9876", "g-shard0-a", TOPIC, lambda batch: True)
    membership = c._membership
    membership._brokers = {"broker-a": "127.0.0.1:10911"}
    answers = {QUERY_CONSUMER_OFFSET: {"offset": "900"}, GET_MIN_OFFSET: {"offset": "40"}}
    monkeypatch.setattr(membership, "request", lambda addr, code, ext, body=b"", ok=(SUCCESS,):
                        Response(SUCCESS, 1, None, answers[code], b""))
    assert membership._start_offset(("broker-a", 0)) == 900  # one group shared by engines: its committed offset
    c.start_offsets = {"broker-a:0": 120}
    assert membership._start_offset(("broker-a", 0)) == 120  # a replica: where its data directory stood
    assert membership._start_offset(("broker-a", 2)) == 40  # a queue it never read: the earliest retained offset
    c._queues.add(("broker-a", 0), 120)
    st = c._queues.get(("broker-a", 0))
    assert st is not None
    st.in_flight = 7
    c._puller._read_pull(("broker-a", 0), Response(PULL_OFFSET_MOVED, 7, None, {"nextBeginOffset": "480"}, b""), None)  # type: ignore[arg-type]
    assert st.offset == 480 and c.offsets_moved == ["broker-a:0 120 -> 480"]
