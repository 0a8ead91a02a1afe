"""The brokers that served each target topic, shared by a shard's replicas through ZooKeeper: a standby
knows the brokers the holder sent to, so its first look-up after a takeover waits for one of them that
is down instead of calling its copies missing (and sending them again)."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, cast

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoAuthError
from kazoo.security import OPEN_ACL_UNSAFE, make_acl

from coordination import HAConfig, LocalZooKeeper, ShardReplica
from forwarder._served_brokers import ServedBrokers
from tests.coordination.cluster import wait_for

Replicas = Callable[[str, ServedBrokers], ShardReplica]


@pytest.fixture
def replicas(zookeeper: LocalZooKeeper) -> Iterator[Replicas]:
    """Replicas of one fresh shard, each sharing the brokers its data directory remembers."""
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, served: ServedBrokers) -> ShardReplica:
        cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id=name, session_timeout_s=2.0,
                       watermark_interval_s=0.2)
        r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000)
        r.share_brokers(served)  # as the service wires it, before the start
        made.append(r.start(lambda: 0))
        return r

    yield make
    for r in made:
        r.stop()


@pytest.fixture
def client(zookeeper: LocalZooKeeper) -> Iterator[KazooClient]:
    c = KazooClient(hosts=zookeeper.connect_string)
    c.start()
    yield c
    c.stop()
    c.close()


def _named(served: ServedBrokers, topic: str, route: list[str]) -> list[str]:
    """The brokers a look-up of `topic` with only `route` answering would wait for."""
    return [b for b in ("broker-a", "broker-b", "broker-c") if any(f"broker {b} served" in p
                                                                  for p in served.problems(topic, route))]


def test_a_standby_knows_the_brokers_the_holder_sent_to_and_waits_for_one_down_after_taking_over(
        replicas: Replicas, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine = ServedBrokers(tmp_path / "a" / "dedupe-brokers.txt")
    mine.note("T", ["broker-a", "broker-b"])  # the holder's producer sent T through both
    a = replicas("a", mine)
    wait_for("a holds the lease", a.may_send)
    theirs = ServedBrokers(tmp_path / "b" / "dedupe-brokers.txt")  # a standby's: it never sent
    b = replicas("b", theirs)
    wait_for("the standby learns the brokers the holder sent to", lambda: _named(theirs, "T", ["broker-a"]) == [
        "broker-b"], 10.0)
    assert '["broker-b", "T"]' in (tmp_path / "b" / "dedupe-brokers.txt").read_text().splitlines(), \
        "in the standby's own data directory: a restart of it knows too"
    mine.note("T2", ["broker-c"])  # learnt while holding (a new target topic)
    wait_for("the standby follows what the holder learns", lambda: _named(theirs, "T2", []) == ["broker-c"], 10.0)
    a.stop()
    wait_for("b takes over", b.may_send, 10.0)
    # broker-b is down at the takeover (the NameServer dropped it): b's first look-up waits for it
    assert _named(theirs, "T", ["broker-a"]) == ["broker-b"]


class _SlowSnapshot(ServedBrokers):
    """A data directory's memory whose snapshot (taken to publish it) waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__(None)
        self.go = threading.Event()
        self.go.set()

    def snapshot(self) -> dict[str, set[str]]:
        self.go.wait(10.0)
        return super().snapshot()


def test_a_holder_that_learns_a_broker_sends_nothing_until_it_has_published_it(replicas: Replicas) -> None:
    """Published only after a copy went there, a broker the holder died right after sending to would
    be unknown to its successor: the fence stays closed from the moment it is learnt until it is out."""
    mine = _SlowSnapshot()
    a = replicas("a", mine)
    wait_for("a holds the lease", a.may_send)
    theirs = ServedBrokers(None)
    replicas("b", theirs)
    mine.go.clear()  # the publication waits
    mine.note("T", ["broker-a"])  # a route naming a broker new for T, looked up on the way to the write
    assert not a.may_send(), "the write that follows the route must not go out before the broker is published"
    mine.go.set()
    wait_for("published, a sends again", a.may_send, 10.0)
    wait_for("the standby has it", lambda: _named(theirs, "T", []) == ["broker-a"], 10.0)


def test_more_brokers_and_topics_than_a_znode_holds_travel_in_parts(client: KazooClient) -> None:
    from coordination._shared_brokers import SharedBrokers

    path = f"/tw-test/{uuid.uuid4().hex[:8]}"
    mine = ServedBrokers(None)
    many = {f"TOPIC_{i:05d}_{'x' * 40}": {"broker-a", "broker-b", f"broker-{i % 7}"} for i in range(2_000)}
    mine.note_all(many)
    holder = SharedBrokers(mine, path, "a", lambda: None, part_bytes=16_384)
    assert holder.publish(client, 1)
    parts = client.get_children(f"{path}/dedupe-brokers")
    assert len(parts) > 8 and all(len(client.get(f"{path}/dedupe-brokers/{p}")[0]) <= 16_384 for p in parts)
    theirs = ServedBrokers(None)
    SharedBrokers(theirs, path, "b", lambda: None, part_bytes=16_384).follow(client)
    assert theirs.snapshot() == many


def test_writers_only_add_so_an_old_holder_cannot_take_a_broker_from_its_successor(client: KazooClient) -> None:
    from coordination._shared_brokers import SharedBrokers

    path = f"/tw-test/{uuid.uuid4().hex[:8]}"
    new, old = ServedBrokers(None), ServedBrokers(None)
    new.note("T", ["broker-a", "broker-c"])
    old.note("T", ["broker-a"])
    old.note("U", ["broker-b"])
    assert SharedBrokers(new, path, "b", lambda: None).publish(client, 2)
    assert SharedBrokers(old, path, "a", lambda: None).publish(client, 1)  # a deposed holder, late
    reader = ServedBrokers(None)
    SharedBrokers(reader, path, "c", lambda: None).follow(client)
    assert reader.snapshot() == {"T": {"broker-a", "broker-c"}, "U": {"broker-b"}}


def test_a_part_another_writer_changed_after_it_was_read_keeps_what_that_writer_added(
        client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from coordination._shared_brokers import SharedBrokers

    path = f"/tw-test/{uuid.uuid4().hex[:8]}"
    first, second = ServedBrokers(None), ServedBrokers(None)
    first.note("T", ["broker-a"])
    second.note("T", ["broker-c"])
    late = SharedBrokers(second, path, "b", lambda: None)
    monkeypatch.setattr(late, "_read_parts", lambda c: {})  # it read the parts before the other write landed
    assert SharedBrokers(first, path, "a", lambda: None).publish(client, 1)
    assert late.publish(client, 2)
    reader = ServedBrokers(None)
    SharedBrokers(reader, path, "c", lambda: None).follow(client)
    assert reader.snapshot() == {"T": {"broker-a", "broker-c"}}


def test_a_follower_reads_the_parts_again_only_when_the_holder_wrote(client: KazooClient) -> None:
    from coordination._shared_brokers import SharedBrokers

    path = f"/tw-test/{uuid.uuid4().hex[:8]}"
    mine, theirs = ServedBrokers(None), ServedBrokers(None)
    holder = SharedBrokers(mine, path, "a", lambda: None)
    follower = SharedBrokers(theirs, path, "b", lambda: None)
    follower.follow(client)  # nothing published yet
    assert theirs.snapshot() == {}
    mine.note("T", ["broker-a"])
    holder.publish(client, 1)
    follower.follow(client)
    assert theirs.snapshot() == {"T": {"broker-a"}}
    assert follower.reads == 1
    follower.follow(client)
    holder.publish(client, 1)  # nothing new: nothing written
    follower.follow(client)
    assert follower.reads == 1


def test_a_served_holder_publishes_the_brokers_its_delivery_learnt(zookeeper: LocalZooKeeper, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`timewheel serve` with [ha] and dedupe wires its data directory's memory of brokers to its replica."""
    from forwarder.config import RocketMQConfig
    from forwarder.ingest import DelayTopicIngest
    from timewheel.app.service import Service
    from timewheel.app.settings import AdminConfig, Settings
    from timewheel.config import EngineConfig

    monkeypatch.setattr(DelayTopicIngest, "start", lambda self, *a, **k: None)  # no broker to read from
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    ha = HAConfig(zookeeper=zookeeper.connect_string, replica_id="a", session_timeout_s=2.0,
                  watermark_interval_s=0.2, force_eligible=True)
    service = Service(Settings(engine=EngineConfig(tmp_path / "a"), ha=ha, admin=AdminConfig(listen="127.0.0.1:0"),
                               rocketmq=RocketMQConfig(namesrv="127.0.0.1:9", delay_topic=topic)))
    service.start()
    try:
        assert service.replica is not None and service.copy_finder is not None
        wait_for("the service's replica holds the lease", service.replica.may_send)
        service.copy_finder.note_route("T", ["broker-a", "broker-b"])  # as the delivery producer's route does
        theirs = ServedBrokers(None)
        follower = ShardReplica(dataclasses.replace(ha, replica_id="b"), topic,
                                now_ms=lambda: time.time_ns() // 1_000_000)
        follower.share_brokers(theirs)
        follower.start(lambda: 0)
        try:
            wait_for("a standby learns them", lambda: _named(theirs, "T", ["broker-a"]) == ["broker-b"], 10.0)
        finally:
            follower.stop()
    finally:
        service.stop()


def _brokers_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the replica logged about its shared brokers, at warning or above."""
    return [r.getMessage() for r in caplog.records
            if r.name == "timewheel.replica" and r.levelno >= logging.WARNING and "dedupe-brokers" in r.getMessage()]


def _refused_holder(zookeeper: LocalZooKeeper, client: KazooClient,
                    **kw: float) -> tuple[ShardReplica, str]:
    """A replica (not started) that learnt a broker, and the dedupe-brokers znode of its shard, made so
    that ZooKeeper refuses its writes (no write, no create in its ACL)."""
    cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id="a", session_timeout_s=2.0,
                   watermark_interval_s=0.2, **kw)  # type: ignore[arg-type]
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    path = f"{cfg.shard_path(topic)}/dedupe-brokers"
    client.ensure_path(cfg.shard_path(topic))
    client.create(path, b"", acl=[make_acl("world", "anyone", read=True, admin=True)])
    mine = ServedBrokers(None)
    mine.note("T", ["broker-a"])
    r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000)
    r.share_brokers(mine)
    return r, path


def test_a_holder_zookeeper_refuses_the_brokers_of_says_why_in_its_status_and_counters_and_logs_it_once(
        zookeeper: LocalZooKeeper, client: KazooClient, caplog: pytest.LogCaptureFixture) -> None:
    """It sends nothing, rightly; an operator must see why, without a line every round, and it is not
    a lease problem: it keeps the lease (and its watermark) meanwhile."""
    r, path = _refused_holder(zookeeper, client)
    with caplog.at_level(logging.INFO, logger="timewheel.replica"):
        r.start(lambda: 0)
        try:
            wait_for("several rounds refused", lambda: r.counter_values()["dedupe_brokers_publish_failures"] >= 3, 10.0)
            status = r.status()
            assert status["holder"] and not r.may_send()
            assert "NoAuth" in str(status["dedupe_brokers_unpublished"]), status
            assert "sends nothing" in str(status["dedupe_brokers_unpublished"]), status
            assert (status["takeovers"], status["losses"]) == (1, 0), status
            assert len(_brokers_lines(caplog)) == 1, _brokers_lines(caplog)
            client.set_acls(path, OPEN_ACL_UNSAFE)  # the operator mends it
            wait_for("published at last", r.may_send, 10.0)
            assert r.status()["dedupe_brokers_unpublished"] is None
            assert len(_brokers_lines(caplog)) == 1, _brokers_lines(caplog)
        finally:
            r.stop()


def test_a_holder_zookeeper_refuses_for_longer_than_the_bound_gives_up_and_its_thread_dies_naming_why(
        zookeeper: LocalZooKeeper, client: KazooClient) -> None:
    """An ACL that refuses every replica alike: the holder gives up at the bound (its thread dead with the
    reason, as the service's `/readyz` shows it) and no longer holds: its service stops and hands the lease on."""
    r, path = _refused_holder(zookeeper, client, dedupe_brokers_publish_timeout_s=1.0)
    r.start(lambda: 0)
    try:
        wait_for("the holder gives up", lambda: r.dead_threads() == ["timewheel-replica"], 20.0)
        why = r.thread_failures()["timewheel-replica"]
        assert why.startswith("DedupeBrokersUnpublishedError: "), why
        assert path in why and "NoAuth" in why and "dedupe_brokers_publish_timeout_s = 1" in why, why
        assert not r.may_send() and not r.status()["holder"]
        assert r.counter_values()["dedupe_brokers_publish_failures"] >= 2
    finally:
        r.stop()


def test_a_write_that_keeps_losing_its_compare_and_set_is_reported_once_and_counted(
        client: KazooClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from coordination._shared_brokers import SharedBrokers

    mine = ServedBrokers(None)
    mine.note("T", ["broker-a"])
    holder = SharedBrokers(mine, f"/tw-test/{uuid.uuid4().hex[:8]}", "a", lambda: None)

    def lost(*_: object) -> int:
        raise BadVersionError()

    monkeypatch.setattr(holder, "_write_parts", lost)
    with caplog.at_level(logging.INFO, logger="timewheel.replica"):
        assert [holder.publish(client, 1) for _ in range(3)] == [False] * 3
    assert not holder.settled()
    assert holder.counters()["dedupe_brokers_publish_failures"] == 3
    assert "kept changing" in str(holder.status()["dedupe_brokers_unpublished"])
    assert len(_brokers_lines(caplog)) == 1, _brokers_lines(caplog)


def test_a_topic_whose_brokers_alone_exceed_a_part_is_refused_without_writing_thousands_of_parts(
        client: KazooClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """More parts cannot help a single topic: say so (and hold) instead of doubling up to 65,536 parts."""
    from coordination._shared_brokers import SharedBrokers

    path = f"/tw-test/{uuid.uuid4().hex[:8]}"
    mine = ServedBrokers(None)
    mine.note("SMALL", ["broker-a"])
    mine.note("HUGE", [f"broker-{i:03d}" for i in range(100)])
    holder = SharedBrokers(mine, path, "a", lambda: None, part_bytes=1024)
    created: list[str] = []
    create = client.create

    def counted(p: str, *a: object, **k: object) -> str:
        created.append(p)
        assert len(created) < 64, "more parts than one topic can use"
        return create(p, *a, **k)

    monkeypatch.setattr(client, "create", counted)
    assert not holder.publish(client, 1)
    assert not holder.settled()
    why = str(holder.status()["dedupe_brokers_unpublished"])
    assert "HUGE" in why and "1024" in why, why
    assert client.get_children(f"{path}/dedupe-brokers") == []  # nothing half written


def test_an_unreadable_part_is_counted_shown_and_written_over_by_the_holder(
        client: KazooClient, caplog: pytest.LogCaptureFixture) -> None:
    from coordination._shared_brokers import SharedBrokers

    path = f"/tw-test/{uuid.uuid4().hex[:8]}"
    mine, theirs = ServedBrokers(None), ServedBrokers(None)
    mine.note("T", ["broker-a"])
    holder = SharedBrokers(mine, path, "a", lambda: None)
    follower = SharedBrokers(theirs, path, "b", lambda: None)
    assert holder.publish(client, 1)
    client.set(f"{path}/dedupe-brokers/part-0-of-1", b"{not json")
    client.create(f"{path}/dedupe-brokers/part-1-of-2", b"[1, 2]")  # a slot the holder has nothing for
    client.set(f"{path}/dedupe-brokers", b"{}")  # the document changed: the follower reads the parts
    with caplog.at_level(logging.INFO, logger="timewheel.replica"):
        follower.follow(client)
        follower.follow(client)  # nothing changed: not read, not counted, not logged again
    assert follower.counters()["dedupe_brokers_unreadable_parts"] == 2
    shown = follower.status()["dedupe_brokers_unreadable"]
    assert isinstance(shown, list) and len(shown) == 2
    assert "part-0-of-1" in shown[0] and "part-1-of-2" in shown[1], shown
    assert len(_brokers_lines(caplog)) == 2, _brokers_lines(caplog)
    assert holder.publish(client, 1)  # the document is not its own: it writes, over both
    follower.follow(client)
    assert theirs.snapshot() == {"T": {"broker-a"}}
    assert follower.status()["dedupe_brokers_unreadable"] == []
    assert holder.status()["dedupe_brokers_unreadable"] == []
    assert follower.counters()["dedupe_brokers_unreadable_parts"] == 2


class _Monotonic:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


class _RefusingZooKeeper:
    """The calls a holder's publication makes, answered in memory; while `refuse`, every write is refused as
    an ACL that refuses every replica alike refuses it."""

    def __init__(self) -> None:
        self.refuse = True
        self.mzxid = 0

    def exists(self, _path: str) -> SimpleNamespace | None:
        return SimpleNamespace(mzxid=self.mzxid) if self.mzxid else None

    def ensure_path(self, _path: str) -> None:
        if self.refuse:
            raise NoAuthError()

    def set(self, _path: str, _data: bytes, version: int = -1) -> SimpleNamespace:
        self.mzxid += 1
        return SimpleNamespace(mzxid=self.mzxid)


class _Rounds:
    """The replica's wake-up event on a test clock: each wait moves the clock on by what it asked, and the
    replica is stopped at `until` (one that never gives up would go round for ever)."""

    def __init__(self, clock: _Monotonic, until: float, stopping: threading.Event) -> None:
        self.clock, self.until, self.stopping = clock, until, stopping

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.t += timeout or 0.0
        if self.clock.t >= self.until:
            self.stopping.set()
        return False


def test_a_holder_that_cannot_publish_what_it_learnt_gives_up_after_the_bound_and_its_thread_dies_with_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its sends held by a write ZooKeeper refuses for ever, a holder used to keep its lease and `/readyz` 200
    while its shard delivered nothing: after `dedupe_brokers_publish_timeout_s` it gives up, as any error
    escaping the replica's loop does (fence revoked, thread dead with its reason: the service stops)."""
    clock = _Monotonic()
    cfg = HAConfig(zookeeper="127.0.0.1:1", replica_id="a")  # never connected: the rounds are driven here
    limit = HAConfig.dedupe_brokers_publish_timeout_s
    r = ShardReplica(cfg, "TW_DELAY", now_ms=lambda: 0, monotonic=clock)
    r._wake = _Rounds(clock, clock.t + 10 * limit, r._stopping)  # type: ignore[assignment]
    mine = ServedBrokers(None)
    mine.note("T", ["broker-a"])
    r.share_brokers(mine)
    r._client = cast(KazooClient, _RefusingZooKeeper())

    def holding() -> bool:  # every round confirms the lease: only the publication fails
        r._active = True
        r.fence.confirmed(clock())
        return True

    monkeypatch.setattr(r, "_step", holding)
    first = clock.t
    r._thread = threading.Thread(target=r._run, name="timewheel-replica", daemon=True)
    r._thread.start()
    r._thread.join(30.0)
    failures = r.counter_values()["dedupe_brokers_publish_failures"]
    assert r.thread_failures(), (
        f"still holding {clock.t - first:.0f} s after its first refused write ({failures} refused, sends held, "
        f"no end): holder={r.status()['holder']}, dead threads {r.dead_threads()}")
    assert r.dead_threads() == ["timewheel-replica"]
    why = r.thread_failures()["timewheel-replica"]
    assert why.startswith("DedupeBrokersUnpublishedError: "), why
    assert f"for {limit:.0f} s" in why and "NoAuth" in why and "dedupe_brokers_publish_timeout_s" in why, why
    assert "docs/OPERATIONS.md" in why, why
    assert limit <= clock.t - first <= limit + cfg.session_timeout_s, "at the bound, not a round much later"
    assert not r.may_send() and not r.status()["holder"]


def test_the_bound_counts_only_failures_in_a_row_that_hold_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that succeeds starts the count again; a repair write that fails while sends go on (what it
    learnt was published before) is retried every round without an end, as before."""
    from coordination._shared_brokers import SharedBrokers
    from coordination.errors import DedupeBrokersUnpublishedError

    clock, zk = _Monotonic(), _RefusingZooKeeper()
    client = cast(KazooClient, zk)
    mine = ServedBrokers(None)
    mine.note("T", ["broker-a"])
    holder = SharedBrokers(mine, "/tw-test/s", "a", lambda: None, monotonic=clock, timeout_s=10.0)
    monkeypatch.setattr(holder, "_write_parts", lambda *_: 1)
    assert not holder.publish(client, 1)
    clock.t += 9.0
    assert not holder.publish(client, 1)
    zk.refuse = False
    assert holder.publish(client, 1) and holder.settled()  # published: the count starts again
    zk.refuse = True
    mine.note("T", ["broker-b"])
    clock.t += 5.0
    assert not holder.publish(client, 1)
    clock.t += 9.0
    assert not holder.publish(client, 1)  # 9 s held: within the bound
    clock.t += 1.0
    with pytest.raises(DedupeBrokersUnpublishedError, match=r"for 10 s .*NoAuth") as e:
        holder.publish(client, 1)
    assert "/tw-test/s/dedupe-brokers" in str(e.value)
    holder.follow(client)  # following: what it failed to write as a holder is over
    assert not holder.publish(client, 1)
    clock.t += 9.0
    assert not holder.publish(client, 1)

    zk.refuse = False
    assert holder.publish(client, 1) and holder.settled()
    zk.mzxid += 1  # written by another (an operator deleted it, an old holder wrote): a repair write
    zk.refuse = True
    for _ in range(5):
        assert not holder.publish(client, 1)
        assert holder.settled(), "sends go on: what it learnt was published before"
        clock.t += 100.0
    assert "sends go on" in str(holder.status()["dedupe_brokers_unpublished"])
