"""ZooKeeper itself failing under a replica set, on a real ZooKeeper of the test's own: stopped for
longer than the session and started again on its data, or replaced by an empty one at the same
address (its data directory wiped: a rebuilt ensemble)."""
from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from coordination import HAConfig, LocalZooKeeper, ShardReplica
from tests.coordination.cluster import wait_for

pytestmark = pytest.mark.zookeeper  # each test starts one of its own

SESSION_S = 2.0
MakeReplica = Callable[[str, int], ShardReplica]


@pytest.fixture
def zk(tmp_path: Path) -> Iterator[LocalZooKeeper]:
    """The test's own ZooKeeper (a test may stop it and start it again, on the same port)."""
    server = LocalZooKeeper(tmp_path / "zk").start()
    yield server
    server.stop()


@pytest.fixture
def replicas(zk: LocalZooKeeper) -> Iterator[MakeReplica]:
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, mark: int) -> ShardReplica:
        cfg = HAConfig(zookeeper=zk.connect_string, replica_id=name, session_timeout_s=SESSION_S,
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
