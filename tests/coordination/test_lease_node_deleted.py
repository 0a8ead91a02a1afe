"""A lease node or the lease path deleted by hand on a real ZooKeeper: never two senders; a status that says why."""
from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from tests.coordination.cluster import wait_for
from coordination import (FencingDeadline, HAConfig, LeasePathDeletedError, LocalZooKeeper, ShardReplica,
                          read_watermark, shard_status)

_Interval = tuple[float, float]


class RecordingFence(FencingDeadline):
    """A fence that keeps every change of its deadline, to tell when it let its replica send."""

    def __init__(self, session_timeout_s: float, fraction: float) -> None:
        """As FencingDeadline, on the monotonic clock."""
        super().__init__(session_timeout_s, fraction)
        self._record = threading.Lock()
        self.changes: list[tuple[float, float, float]] = []  # (before the change, after it, the deadline after it)

    def confirmed(self, sent_at: float) -> None:
        """Extend, and keep the change."""
        with self._record:
            before = time.monotonic()
            super().confirmed(sent_at)
            self.changes.append((before, time.monotonic(), self._deadline))

    def revoke(self) -> None:
        """Revoke, and keep the change."""
        with self._record:
            before = time.monotonic()
            super().revoke()
            self.changes.append((before, time.monotonic(), self._deadline))

    def open_intervals(self, until: float) -> list[_Interval]:
        """When the fence let its replica send: each deadline counts from just before it was set until it passed
        or the next change was done (a confirmation only extends it; a revocation ends it), at most `until`."""
        with self._record:
            changes = list(self.changes)
        out = []
        for i, (before, _, deadline) in enumerate(changes):
            end = min(deadline, changes[i + 1][1] if i + 1 < len(changes) else until)
            if end > before:
                out.append((before, end))
        return out


def _overlaps(a: list[_Interval], b: list[_Interval]) -> list[tuple[_Interval, _Interval]]:
    return [(x, y) for x in a for y in b if max(x[0], y[0]) < min(x[1], y[1])]


@pytest.fixture
def recorded(zookeeper: LocalZooKeeper) -> Iterator[Callable[..., tuple[ShardReplica, RecordingFence]]]:
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, mark: int, holder_watch: bool = True) -> tuple[ShardReplica, RecordingFence]:
        cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id=name, session_timeout_s=2.0,
                       watermark_interval_s=0.2)
        r = ShardReplica(cfg, topic, now_ms=lambda: time.time_ns() // 1_000_000)
        fence = RecordingFence(cfg.session_timeout_s, cfg.fence_fraction)
        r.fence = fence
        if not holder_watch:  # the watch's event arrives too late to matter (its delivery is asynchronous)
            r._on_lease_node = lambda event: None  # type: ignore[method-assign]
        made.append(r.start(lambda: mark))
        return r, fence

    yield make
    for r in made:
        r.stop()


@pytest.mark.parametrize("holder_watch", [True, False], ids=["holder-watches-its-node", "holder-learns-late"])
def test_a_holders_lease_node_deleted_by_hand_never_lets_two_replicas_send_and_the_holder_rejoins_as_a_standby(
        recorded: Callable[..., tuple[ShardReplica, RecordingFence]], zookeeper: LocalZooKeeper,
        holder_watch: bool) -> None:
    """The holder's own lease node deleted (zkCli's `delete`) while its session lives: the next replica saw
    the lowest node gone and took over at once, while the old holder learnt it only at its next round, its
    fence still open until then: both sent the same due messages. Here the holder's round is held up (a slow
    answer from ZooKeeper) across the delete; the times each fence let its replica send must never overlap,
    and the old holder must stop and contend again as a standby."""
    a, a_fence = recorded("a", 2_000, holder_watch)
    wait_for("a holds the lease", a.may_send)
    b, b_fence = recorded("b", 3_000)
    wait_for("b follows", lambda: b.delivered_elsewhere_up_to() == 2_000)
    stall, stalled, release = threading.Event(), threading.Event(), threading.Event()
    check = a._history.check

    def slow_round(client: KazooClient) -> None:
        if stall.is_set():
            stalled.set()
            release.wait(30)
        check(client)

    a._history.check = slow_round  # type: ignore[method-assign]
    operator = KazooClient(hosts=zookeeper.connect_string)
    operator.start(timeout=30)
    try:
        stall.set()
        a._wake.set()
        assert stalled.wait(10), "a's next round did not start"
        operator.delete(f"{a.path}/lease/{a._node}")  # the holder's node alone; its session lives on
        wait_for("b holds the lease", b.may_send, 10)
        release.set()
        wait_for("a rejoins as a standby", lambda: [(s.holder, s.standbys) for s in shard_status(
            operator, b.cfg, b.delay_topic)] == [("b", ("a",))], 10)
        until = time.monotonic()
        both = _overlaps(a_fence.open_intervals(until), b_fence.open_intervals(until))
        assert not both, f"a and b could both send for {max(min(x[1], y[1]) - max(x[0], y[0]) for x, y in both):.3f} s"
        assert not a.may_send() and a.epoch == 0 and a.counters.losses == 1 and a.dead_threads() == []
        assert b.epoch > 1 and b.counters.takeovers == 1
    finally:
        release.set()
        operator.stop()
        operator.close()


def test_the_status_of_a_shard_whose_lease_path_was_deleted_says_what_happened_and_what_to_do(
        recorded: Callable[..., tuple[ShardReplica, RecordingFence]], zookeeper: LocalZooKeeper) -> None:
    """`<shard>/lease` deleted by hand: `timewheel status` showed the shard with no holder and nothing
    more; it must say, in the words of LeasePathDeletedError, that the path was deleted and what to do."""
    a, _ = recorded("a", 2_000)
    wait_for("a publishes", lambda: a.epoch > 0 and read_watermark(a._client, a.path).epoch == a.epoch)
    lease, watermark = f"{a.path}/lease", f"{a.path}/watermark"
    operator = KazooClient(hosts=zookeeper.connect_string)
    operator.start(timeout=30)
    try:
        operator.delete(lease, recursive=True)
        wait_for("a says that the lease path was deleted", lambda: bool(a.thread_failures()), 30)
        doc = a.status_document()
        assert doc.get("shards_error") == str(LeasePathDeletedError(lease, watermark)), doc
        assert "delete " + watermark in str(doc["shards_error"])
        shards = doc["shards"]
        assert isinstance(shards, list) and [(s["holder"], s["epoch"]) for s in shards] == [(None, 0)]
    finally:
        operator.stop()
        operator.close()


def test_a_replica_starting_alone_takes_the_lease_without_waiting_a_fence(
        recorded: Callable[..., tuple[ShardReplica, RecordingFence]]) -> None:
    """Every live replica seen with its lease node at the first look: no earlier holder can be fenced to send
    unseen, so the start waits nothing (a wait there would delay every start and restart by a fence)."""
    a, _ = recorded("a", 2_000)
    wait_for("a holds the lease", a.may_send)
    assert a._succession.hold_until == float("-inf")


def test_a_replica_whose_first_look_misses_a_live_replicas_lease_node_waits_a_fence_before_it_sends(
        recorded: Callable[..., tuple[ShardReplica, RecordingFence]], zookeeper: LocalZooKeeper) -> None:
    """A live replica (its `replicas/<id>` znode held by a live session) with no lease node at this replica's
    first look may be a holder whose node was deleted just before: its fence may be open, so this replica
    waits the longest fence before it takes the lease."""
    a, a_fence = recorded("a", 2_000)
    wait_for("a holds the lease", a.may_send)
    ghost = KazooClient(hosts=zookeeper.connect_string)
    ghost.start(timeout=30)
    try:
        ghost.create(f"{a.path}/replicas/z", b"", ephemeral=True)  # a replica alive, its lease node gone
        a.stop()
        b, b_fence = recorded("b", 3_000)
        wait_for("b holds the lease", b.may_send, 10)
        took = next(before for before, _, deadline in b_fence.changes if deadline > before)  # its first confirmation
        assert b._succession.hold_until > float("-inf")
        assert took - b._succession.hold_until >= 0 and b._succession.hold_until - took < b._succession.fence_s
    finally:
        ghost.stop()
        ghost.close()
