"""ZooKeeper itself failing under a replica set, on a real ZooKeeper of the test's own: stopped for
longer than the session and started again on its data, or replaced by an empty one at the same
address (its data directory wiped: a rebuilt ensemble), behind what the replicas saw or already past
it; and, for contrast, sessions that expire while ZooKeeper keeps its data."""
from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from coordination import HAConfig, LocalZooKeeper, ShardReplica
from tests.coordination.cluster import TcpProxy, wait_for

pytestmark = pytest.mark.zookeeper  # each test starts one of its own

SESSION_S = 2.0
MakeReplica = Callable[..., ShardReplica]


@pytest.fixture
def zk(tmp_path: Path) -> Iterator[LocalZooKeeper]:
    """The test's own ZooKeeper (a test may stop it and start it again, on the same port)."""
    server = LocalZooKeeper(tmp_path / "zk").start()
    yield server
    server.stop()


@pytest.fixture
def proxy(zk: LocalZooKeeper) -> Iterator[TcpProxy]:
    """A way to the test's ZooKeeper that the test can cut, whatever the server behind it does meanwhile."""
    p = TcpProxy(zk.connect_string)
    yield p
    p.stop()


@pytest.fixture
def replicas(zk: LocalZooKeeper) -> Iterator[MakeReplica]:
    """`make(name, mark, via=None)`: a replica of the test's shard, connected to ZooKeeper through `via` if given."""
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, mark: int, via: str | None = None) -> ShardReplica:
        cfg = HAConfig(zookeeper=via or zk.connect_string, replica_id=name, session_timeout_s=SESSION_S,
                       watermark_interval_s=0.2)
        r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000).start(lambda: mark)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def _bring_back(zk: LocalZooKeeper, replicas: list[ShardReplica], *, wipe: bool) -> None:
    """Stop the server, check that no replica may send, wait past the session, start it again on the
    same port (on its data, or on an empty data directory)."""
    zk.stop()
    if wipe:
        shutil.rmtree(zk.run_dir / "data")
    wait_for("every replica fenced", lambda: not any(r.may_send() for r in replicas), SESSION_S)
    time.sleep(SESSION_S * 1.5)  # the fault: down for longer than the session
    assert not any(r.may_send() for r in replicas)
    zk.start()


def test_zookeeper_stopped_past_the_session_and_restarted_on_its_data_leaves_one_holder_with_no_smaller_epoch(
        zk: LocalZooKeeper, replicas: MakeReplica) -> None:
    a = replicas("a", 1_000)
    wait_for("a holds the lease", a.may_send)
    b = replicas("b", 5)
    wait_for("b follows a", lambda: b.delivered_elsewhere_up_to() == 1_000)
    first = a.epoch
    _bring_back(zk, [a, b], wipe=False)
    wait_for("one replica holds the lease again", lambda: a.may_send() or b.may_send(), 60)
    holder, other = (a, b) if a.may_send() else (b, a)
    assert holder.epoch >= first
    wait_for("the other follows", lambda: other.delivered_elsewhere_up_to() >= 1_000 and not other.may_send())
    assert not a.dead_threads() and not b.dead_threads()


def test_a_replica_that_an_empty_zookeeper_will_never_take_back_says_why_and_a_restart_joins_it(
        zk: LocalZooKeeper, replicas: MakeReplica) -> None:
    """A server rebuilt empty refuses every client that saw a later transaction than its own last
    (ZooKeeper's rule: `client must try another server`), and kazoo keeps trying the same: the replicas
    waited, fenced, for ever. Each must end its replica thread saying why, so that its service exits for
    its supervisor, and a replica started again joins the new server, its epochs from 1 again."""
    a = replicas("a", 1_000)
    wait_for("a holds the lease", a.may_send)
    b = replicas("b", 5)
    wait_for("b follows a", lambda: b.delivered_elsewhere_up_to() == 1_000)
    address = a.cfg.zookeeper
    _bring_back(zk, [a, b], wipe=True)
    wait_for("both replicas say that ZooKeeper lost its history",
             lambda: bool(a.thread_failures() and b.thread_failures()), 60)
    for r in (a, b):
        failure = r.thread_failures()["timewheel-replica"]
        assert failure.startswith("ZooKeeperHistoryLostError: ") and address in failure and "restart" in failure
        assert r.dead_threads() == ["timewheel-replica"] and not r.may_send()
        r.stop()
    again = replicas("a", 2_000)
    wait_for("a replica started again holds the lease", again.may_send, 30)
    assert again.epoch == 1
    wait_for("it publishes its watermark", lambda: again.counters.watermarks_published > 0)


def _push_past(address: str, zxid: int) -> None:
    """Write to the server at `address` until its last transaction is past `zxid` (other clients using it)."""
    writer = KazooClient(hosts=address)
    writer.start(timeout=30)
    try:
        writer.ensure_path("/elsewhere")
        while writer.last_zxid <= zxid + 16:
            writer.create("/elsewhere/n-", sequence=True)
    finally:
        writer.stop()
        writer.close()


@pytest.mark.parametrize("made_again", [False, True], ids=["tree-gone", "tree-made-again-by-a-new-replica"])
def test_a_replica_that_a_zookeeper_past_its_transactions_takes_back_without_its_shards_tree_says_why_and_stops(
        zk: LocalZooKeeper, proxy: TcpProxy, replicas: MakeReplica, made_again: bool) -> None:
    """A replacement ZooKeeper whose last transaction is past what the replicas' clients saw (a new
    ensemble that other clients used, another cluster's backup) lets them back in new sessions, but holds
    none of the shard's tree, which a replica creates only at start: every round failed with NoNodeError
    on the lease path, nobody held the lease again, and every replica stayed ready. With a tree another
    replica created there since, the old replicas would have joined it with the old history's epochs and
    watermarks. Each must end its replica thread saying why, and a replica started again joins."""
    a = replicas("a", 1_000, proxy.address)
    wait_for("a holds the lease", a.may_send)
    b = replicas("b", 5, proxy.address)
    wait_for("b follows a", lambda: b.delivered_elsewhere_up_to() == 1_000)
    proxy.cut("drop")  # the replicas see none of the replacement until it is ready
    wait_for("every replica fenced", lambda: not (a.may_send() or b.may_send()), SESSION_S)
    zk.stop()
    shutil.rmtree(zk.run_dir / "data")
    zk.start()
    _push_past(zk.connect_string, max(a._client.last_zxid, b._client.last_zxid))
    if made_again:
        c = replicas("c", 2_000)  # started on the new server: it creates the shard's tree there
        wait_for("c holds the lease", c.may_send)
        assert c.epoch == 1
    proxy.heal()
    wait_for("both replicas say that ZooKeeper lost the shard's tree",
             lambda: bool(a.thread_failures() and b.thread_failures()), 30)
    for r in (a, b):
        failure = r.thread_failures()["timewheel-replica"]
        assert failure.startswith("ZooKeeperHistoryLostError: ") and proxy.address in failure
        assert f"{r.path}/lease" in failure and "restart" in failure
        assert r.dead_threads() == ["timewheel-replica"] and not r.may_send()
        r.stop()
    if not made_again:
        again = replicas("a", 2_000, proxy.address)
        wait_for("a replica started again holds the lease", again.may_send, 30)
        assert again.epoch == 1


def test_sessions_that_expire_while_zookeeper_keeps_its_data_are_contended_again_not_taken_for_a_lost_history(
        zk: LocalZooKeeper, proxy: TcpProxy, replicas: MakeReplica) -> None:
    """Cut off past the session, both replicas lose their sessions and every ephemeral node with them,
    while the shard's tree stays: they come back in new sessions and contend as before."""
    a = replicas("a", 1_000, proxy.address)
    wait_for("a holds the lease", a.may_send)
    b = replicas("b", 5, proxy.address)
    wait_for("b follows a", lambda: b.delivered_elsewhere_up_to() == 1_000)
    first = a.epoch
    sessions = {r.cfg.replica_id: r._client.client_id for r in (a, b)}
    lease = f"{a.path}/lease"
    proxy.cut("drop")
    observer = KazooClient(hosts=zk.connect_string)
    observer.start(timeout=30)
    try:
        wait_for("ZooKeeper expires both sessions", lambda: observer.get_children(lease) == [], SESSION_S * 10)
        proxy.heal()
        wait_for("one replica holds the lease again", lambda: a.may_send() or b.may_send(), 30)
        holder, other = (a, b) if a.may_send() else (b, a)
        assert holder.epoch > first
        published = {"a": 1_000, "b": 5}[holder.cfg.replica_id]  # what each replica's engine says it delivered
        wait_for("the other contends and follows it", lambda: len(observer.get_children(lease)) == 2
                 and other.delivered_elsewhere_up_to() >= published)
        assert not other.may_send()
        assert all(r._client.client_id != sessions[r.cfg.replica_id] for r in (a, b))
        assert not a.thread_failures() and not b.thread_failures()
        assert not a.dead_threads() and not b.dead_threads()
    finally:
        observer.stop()
        observer.close()
