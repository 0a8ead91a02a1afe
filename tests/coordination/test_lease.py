"""Shard leases on a real ZooKeeper: one holder, epochs that grow, the watermark handed on, a lost session."""
from __future__ import annotations

import time
import uuid
from typing import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from timewheel.gate import NO_WATERMARK, DeliveredMark
from tests.coordination.cluster import wait_for
from coordination import (HAConfig, LocalZooKeeper, ShardReplica, Watermark, publish_watermark, read_watermark, ruok,
                          shard_status)


def _holder_and_follower(replicas: Callable[..., ShardReplica], a_mark: int,
                         b_mark: int) -> tuple[ShardReplica, ShardReplica]:
    """Replica a holding the lease with watermark `a_mark`, and b following it."""
    a = replicas("a", lambda: a_mark)
    wait_for("a holds the lease", a.may_send)
    b = replicas("b", lambda: b_mark)
    wait_for("b follows", lambda: b.delivered_elsewhere_up_to() == a_mark)
    return a, b


@pytest.fixture
def replicas(zookeeper: LocalZooKeeper) -> Iterator[Callable[..., ShardReplica]]:
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, watermark: Callable[[], int | DeliveredMark],
             offsets: Callable[[], dict[str, int]] | None = None, **kw: object) -> ShardReplica:
        cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id=name, session_timeout_s=2.0,
                       watermark_interval_s=0.2, **kw)  # type: ignore[arg-type]
        r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000).start(watermark,
                                                                                       offsets_source=offsets)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@pytest.mark.zookeeper  # starts one of its own
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
    wait_for("a holds the lease", a.may_send)
    b = replicas("b", lambda: 5)
    wait_for("b follows a's watermark", lambda: b.delivered_elsewhere_up_to() == 1_000)
    assert not b.may_send() and b.epoch == 0
    first = a.epoch
    shards = b.status_document()["shards"]
    assert isinstance(shards, list)
    assert [(s["holder"], s["epoch"], s["standbys"], s["watermark_ms"]) for s in shards] == [("a", first, ["b"], 1_000)]
    a.stop()  # a graceful holder publishes its last watermark and leaves: b holds at once
    wait_for("b holds the lease", b.may_send, 5.0)
    assert b.epoch > first
    assert b.delivered_elsewhere_up_to() == 1_000  # what a delivered is not b's to send
    # b publishes its own engine's watermark (with its own offsets) under its epoch; a's mark, which
    # covers what a had stored, stays with b
    wait_for("b publishes under its own epoch", lambda: b.status()["published_watermark_ms"] == 5)
    assert b.delivered_elsewhere_up_to() == 1_000
    assert b.counters.takeovers == 1


def test_a_holder_whose_engine_failed_publishes_no_frozen_mark(replicas: Callable[..., ShardReplica]) -> None:
    """Once its engine failed on the delivery path, the mark it computes is frozen (the last from
    before the failure): the holder publishes nothing more, and the mark it published stays with the
    offsets it was computed for. Published with newer offsets, it would cover a message stored since
    (already due: ingest lag) that nobody sent, and a standby taking over would skip it."""
    marks = [DeliveredMark(1_000)]
    offsets = {"broker-a:0": 10}
    a = replicas("a", lambda: marks[-1], lambda: dict(offsets))
    wait_for("a publishes", lambda: a.counters.watermarks_published > 0)
    path = a.path
    assert (read_watermark(a._client, path).watermark_ms, read_watermark(a._client, path).offsets) == (
        1_000, {"broker-a:0": 10})
    marks.append(DeliveredMark(1_000, frozen=True))  # the engine failed; then a late message is stored
    offsets["broker-a:0"] = 11
    published = a.counters.watermarks_published
    time.sleep(1.0)  # five publishing intervals
    mark = read_watermark(a._client, path)
    assert (mark.watermark_ms, mark.offsets) == (1_000, {"broker-a:0": 10})
    assert a.counters.watermarks_published <= published + 1  # at most one already under way


def test_a_holder_whose_session_expires_stops_sending_and_cannot_move_its_successors_watermark(
        replicas: Callable[..., ShardReplica], zookeeper: LocalZooKeeper) -> None:
    a, b = _holder_and_follower(replicas, 2_000, 3_000)
    first = a.epoch
    # end a's session from outside, as the server does when a paused holder stops heartbeating
    sid, password = a._client.client_id
    thief = KazooClient(hosts=zookeeper.connect_string, client_id=(sid, password))
    thief.start()
    thief.stop()
    thief.close()
    wait_for("b takes over", b.may_send, 10.0)
    assert b.epoch > first
    wait_for("a no longer sends", lambda: not a.may_send(), 5.0)
    time.sleep(1.0)  # a is a standby now
    assert not a.may_send()
    path = b.path
    client = b._client
    assert not publish_watermark(client, path, Watermark(first, 99_999, "a", 0))  # a's old epoch is refused
    wait_for("b's watermark", lambda: read_watermark(client, path).epoch == b.epoch)
    assert read_watermark(client, path).watermark_ms == 3_000
    statuses = shard_status(client, b.cfg, b.delay_topic)
    assert statuses[0].holder == "b" and statuses[0].standbys == ("a",)


@pytest.mark.zookeeper  # starts one of its own
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
        client.start(timeout=30)  # a loaded machine: the JVM answers ruok before it serves sessions promptly
        client.ensure_path("/probe")
        client.stop()
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not ruok(line[1], 0.5)


def test_a_replica_thread_that_dies_stops_sending_and_its_service_hands_the_lease_on(
        replicas: Callable[..., ShardReplica]) -> None:
    """An error escaping the replica's loop (here a watermark source that raises) used to kill the
    thread while the session kept the lease node alive: nobody sent, nobody took over, /readyz 200."""
    from tests.timewheel.app.service_parts import readiness_only

    calls = {"n": 0}

    def failing() -> int:
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("injected: the engine's watermark cannot be computed")
        return 100

    a = replicas("a", failing)
    b = replicas("b", lambda: 5)
    wait_for("a holds the lease", a.may_send)
    wait_for("a's replica thread dies", lambda: a.dead_threads() == ["timewheel-replica"])
    assert not a.may_send()  # it stops sending at once, not at the end of its fencing period

    class Engine:
        def dead_threads(self) -> list[str]:
            return []

        def thread_failures(self) -> dict[str, str]:
            return {}

        def checkpoint_failure(self) -> str | None:
            return None

    svc = readiness_only(Engine(), a)
    assert svc.ready() is False and svc.dead_threads() == ["timewheel-replica"]  # /readyz answers 503
    assert [w for w in svc.not_ready_why() if "timewheel-replica (RuntimeError: injected: the engine's watermark" in w]
    a.stop()  # what serve does when it sees a dead thread: the session ends and the lease moves
    wait_for("b takes over", b.may_send, 5.0)


def test_a_second_process_with_a_live_replica_id_is_refused(replicas: Callable[..., ShardReplica]) -> None:
    from coordination.replica import ReplicaIdTaken

    a = replicas("a", lambda: 1)
    wait_for("a holds the lease", a.may_send)
    with pytest.raises(ReplicaIdTaken, match="already live"):
        replicas("a", lambda: 1)
    assert a.may_send()
    # the service stops a refused replica with the rest of the engine: stopping it again is harmless
    refused = ShardReplica(a.cfg, a.delay_topic, now_ms=lambda: time.time_ns() // 1_000_000)
    with pytest.raises(ReplicaIdTaken):
        refused.start(lambda: 1)
    refused.stop()
    assert a.may_send()


def test_a_malformed_watermark_is_reported_and_sends_rather_than_drops(
        replicas: Callable[..., ShardReplica], zookeeper: LocalZooKeeper) -> None:
    a, b = _holder_and_follower(replicas, 1_000, 5)
    a.stop()
    wait_for("b holds the lease", b.may_send, 5.0)
    b._client.set(f"{b.path}/watermark", b"{not json")
    c = replicas("c", lambda: 7)
    wait_for("c reads the malformed watermark", lambda: c.counters.malformed_watermarks > 0)
    assert c.dead_threads() == [] and c.delivered_elsewhere_up_to() == NO_WATERMARK
    def rewritten() -> bool:
        try:
            return read_watermark(b._client, b.path).epoch == b.epoch
        except ValueError:
            return False

    wait_for("b writes a good one over it", rewritten)


def test_a_watermark_interval_outside_the_fencing_period_is_refused() -> None:
    from timewheel.errors import ConfigError

    with pytest.raises(ConfigError, match="watermark_interval_s"):
        HAConfig(zookeeper="127.0.0.1:2181", replica_id="a", session_timeout_s=6.0, watermark_interval_s=6.0)


def test_a_dropped_connection_that_keeps_its_session_keeps_the_replica_holding(
        replicas: Callable[..., ShardReplica], monkeypatch: pytest.MonkeyPatch) -> None:
    """A ping missed under load drops the connection; kazoo reconnects within the session. A round
    that ran meanwhile read no session id (kazoo has none while it reconnects), took that for a new
    session, claimed the replica id again, and found its own node: `ReplicaIdTaken`, the replica
    thread died and the holder's service exited 3 (a CI run lost its holder so). Now such a round
    waits for the connection, and the replica holds on with its session."""
    import threading

    a = replicas("a", lambda: 1)
    wait_for("a holds the lease", a.may_send)
    reconnecting = threading.Event()
    real_client_id = KazooClient.client_id
    real_create = KazooClient.create

    def client_id(self: KazooClient) -> tuple[int, bytes] | None:
        return None if reconnecting.is_set() else real_client_id.fget(self)

    def create(self: KazooClient, *args: object, **kwargs: object) -> str:
        reconnecting.clear()  # a request queued while reconnecting is answered once connected
        return real_create(self, *args, **kwargs)

    monkeypatch.setattr(KazooClient, "client_id", property(client_id))
    monkeypatch.setattr(KazooClient, "create", create)
    reconnecting.set()
    a._wake.set()  # the state listener wakes the round at once
    threading.Timer(0.5, reconnecting.clear).start()  # connected again, the same session
    time.sleep(1.5)
    assert a.dead_threads() == [], "the replica thread died on its own node"
    wait_for("a holds the lease again", a.may_send, 5.0)


def test_a_connection_dropped_while_the_replica_starts_is_a_one_line_error_and_leaves_nothing(
        zookeeper: LocalZooKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica id's claim at start is a round trip: a connection that drops in it raised kazoo's own
    `ConnectionLoss` out of `serve`. Now it is the `ConnectionError` serve reports in one line, the
    session is closed, and a start again takes the id."""
    from kazoo.exceptions import ConnectionLoss, NoAuthError

    from coordination import ZooKeeperJoinError

    assert issubclass(ZooKeeperJoinError, ConnectionError)  # what serve reports in one line
    assert "refused a request (NoAuthError: " in str(ZooKeeperJoinError("z:1", "a", "/s", NoAuthError("x")))
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id="a", session_timeout_s=2.0, watermark_interval_s=0.2)
    real_create = KazooClient.create

    def dropped(self: KazooClient, path: str, *args: object, **kwargs: object) -> str:
        if "/replicas/" in path:
            raise ConnectionLoss()
        return real_create(self, path, *args, **kwargs)

    monkeypatch.setattr(KazooClient, "create", dropped)
    first = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000)
    with pytest.raises(ZooKeeperJoinError, match=r"dropped the connection while replica 'a' joined .*start it again"):
        first.start(lambda: 0)
    assert not first._client.connected
    monkeypatch.setattr(KazooClient, "create", real_create)
    again = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000).start(lambda: 0)
    try:
        wait_for("the replica started again holds the lease", again.may_send)
    finally:
        again.stop()


def test_a_zookeeper_that_never_answers_the_first_connect_is_a_typed_one_line_error() -> None:
    """A listener that takes the connection and never answers (a wrong port, a hung server): the start
    raises `ZooKeeperUnreachableError`, a `ConnectionError` serve reports in one line, and kazoo's
    session is stopped rather than left retrying in the background."""
    import socket

    from coordination import ZooKeeperUnreachableError

    with socket.create_server(("127.0.0.1", 0)) as silent:
        connect = f"127.0.0.1:{silent.getsockname()[1]}"
        cfg = HAConfig(zookeeper=connect, replica_id="a", session_timeout_s=2.0, watermark_interval_s=0.2)
        replica = ShardReplica(cfg, f"TW_DELAY_{uuid.uuid4().hex[:8]}", now_ms=lambda: time.time_ns() // 1_000_000)
        with pytest.raises(ZooKeeperUnreachableError, match=rf"cannot reach ZooKeeper at ha.zookeeper = '{connect}' "
                                                            r"within 1 s: start it or fix the connect string"):
            replica.start(lambda: 0, timeout=1.0)
    assert issubclass(ZooKeeperUnreachableError, ConnectionError)
    assert not replica._client.connected
    assert replica.dead_threads() == []


def test_a_takeover_at_an_epoch_the_watermark_already_carries_is_refused(replicas: Callable[..., ShardReplica]) -> None:
    """A lease path deleted and created again between a round's look at it and its takeover numbers epochs
    from 1 again: the takeover, which reads the watermark, refuses an epoch at or below another replica's
    published one (the start's refusal, in its words), and takes none of the lease's state."""
    from coordination import LeasePathDeletedError

    a = replicas("a", lambda: 2_000)
    wait_for("a holds the lease", a.may_send)
    took = a.counters.takeovers
    for mark in (Watermark(a.epoch + 1, 2_000, "z", 0), Watermark(a.epoch, 2_000, "z", 0)):
        with pytest.raises(LeasePathDeletedError, match="created again"):
            a._take_over(mark)
    a._take_over(Watermark(a.epoch, 2_000, "a", 0))  # its own mark of this epoch: a lease regained, not reused
    assert a.counters.takeovers == took + 1


@pytest.mark.parametrize("created_again", [False, True], ids=["deleted", "deleted-and-created-again"])
def test_a_lease_path_deleted_under_live_sessions_stops_every_replica_saying_why_and_no_restart_counts_epochs_back(
        replicas: Callable[..., ShardReplica], zookeeper: LocalZooKeeper, created_again: bool) -> None:
    """`<shard>/lease` deleted by hand (zkCli's `deleteall`, a tool) while every replica's session lives:
    each round failed with NoNodeError on it, nobody held the lease, and every replica stayed ready, for
    ever. Created again, its epochs would count from 1 under the watermark of the old ones. Each replica
    must end its thread saying what happened and what to do; a replica started again is refused while
    the shard's watermark holds an epoch the lease path cannot have given, and starts once it is removed."""
    a, b = _holder_and_follower(replicas, 2_000, 3_000)
    wait_for("a publishes", lambda: read_watermark(a._client, a.path).epoch == a.epoch)
    lease, first = f"{a.path}/lease", a.epoch
    operator = KazooClient(hosts=zookeeper.connect_string)
    operator.start(timeout=30)
    try:
        operator.delete(lease, recursive=True)  # what `deleteall` does: the replicas' nodes, then the path
        if created_again:
            operator.create(lease)
        wait_for("both replicas say that the lease path was deleted",
                 lambda: bool(a.thread_failures() and b.thread_failures()), 30)
        for r in (a, b):
            failure = r.thread_failures()["timewheel-replica"]
            assert failure.startswith("LeasePathDeletedError: ") and lease in failure, failure
            assert f"{a.path}/watermark" in failure and "exit" in failure
            assert r.dead_threads() == ["timewheel-replica"] and not r.may_send()
            r.stop()
        from coordination import CoordinationError, LeasePathDeletedError

        found = operator.exists(lease)
        if found is not None and found.cversion >= first:
            # a replica's round made a node in the path created again before its next look found the path
            # so (it stopped then, at the latest at its takeover): that path gives epochs above the watermark's
            again = replicas("a", lambda: 4_000)
            wait_for("a replica started again holds the lease", again.may_send, 30)
            assert again.epoch > first and not again.dead_threads()
            return
        with pytest.raises(LeasePathDeletedError, match=f"epoch {first}") as refused:
            replicas("a", lambda: 4_000)  # a supervisor's restart: it would take the lease with epoch 1
        assert f"{a.path}/watermark" in str(refused.value)
        assert isinstance(refused.value, CoordinationError)  # what serve reports in one line (exit 2)
        assert (operator.exists(lease) is not None) == created_again  # the refused start created nothing
        operator.delete(f"{a.path}/watermark")  # what the error says to do
        # epochs count from the path's own numbering again: from 1, or past a node a replica's round made in
        # the path created again before it found the path so
        found = operator.exists(lease)
        expected = (found.cversion if found is not None else 0) + 1
        again = replicas("a", lambda: 4_000)
        wait_for("a replica started again holds the lease", again.may_send, 30)
        assert again.epoch == expected and expected <= first and not again.dead_threads()
        wait_for("it publishes its watermark", lambda: read_watermark(operator, a.path).epoch == expected)
    finally:
        operator.stop()
        operator.close()
