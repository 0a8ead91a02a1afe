"""When a replica decides that ZooKeeper lost its history (`coordination._history`), with a scripted
client and probe: never while connected nor within a session of the drop, never while ZooKeeper
does not answer, and only when it stands before what the replica's client saw; or, under a new
session, when the shard's tree the replica joined is gone or was created again. And how often a
replica's client tries to reconnect."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from coordination import _history
from coordination._history import LostHistoryWatch
from coordination.errors import ZooKeeperHistoryLostError


@dataclass
class _Client:
    connected: bool = True
    last_zxid: int = 0x500


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watch(monkeypatch: pytest.MonkeyPatch, answers: list[int | None]) -> tuple[LostHistoryWatch, _Clock, list[str]]:
    probes: list[str] = []

    def probe(hosts: str, timeout_s: float) -> int | None:
        probes.append(hosts)
        return answers.pop(0)

    monkeypatch.setattr(_history, "ensemble_zxid", probe)
    clock = _Clock()
    return LostHistoryWatch("zk1:2181", 4.0, clock), clock, probes


def test_a_client_that_an_ensemble_behind_it_refuses_is_told_once_a_session_has_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    watch, clock, probes = _watch(monkeypatch, [None, 0x3])
    client: Any = _Client(connected=False)
    watch.check(client)
    clock.t += 3.9
    watch.check(client)
    assert probes == []  # a connection that comes back within a session is not probed for
    clock.t += 0.2
    watch.check(client)  # ZooKeeper does not answer: nothing to tell
    assert probes == ["zk1:2181"]
    clock.t += 3.9
    watch.check(client)
    assert len(probes) == 1  # once a session
    clock.t += 0.2
    with pytest.raises(ZooKeeperHistoryLostError) as e:
        watch.check(client)
    assert "0x3, before 0x500" in str(e.value) and "'zk1:2181'" in str(e.value) and "restart" in str(e.value)


def test_an_ensemble_at_or_past_what_the_client_saw_is_the_same_history(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, clock, probes = _watch(monkeypatch, [0x500, 0x9000])
    client: Any = _Client(connected=False)
    watch.check(client)
    for _ in range(2):
        clock.t += 4.1
        watch.check(client)
    assert len(probes) == 2


def test_a_connection_back_starts_the_count_again(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, clock, probes = _watch(monkeypatch, [0x3])
    client: Any = _Client(connected=False)
    watch.check(client)
    clock.t += 3.0
    client.connected = True
    watch.check(client)
    client.connected = False
    clock.t += 3.0
    watch.check(client)
    assert probes == []
    clock.t += 4.0
    with pytest.raises(ZooKeeperHistoryLostError):
        watch.check(client)


@dataclass
class _Stat:
    czxid: int
    ctime: int
    cversion: int = 0  # the lease path's child version: what ZooKeeper numbers its next child


class _SessionClient:
    """A connected client whose session and whose view of the shard's lease path (and watermark) the test changes."""

    def __init__(self) -> None:
        self.connected, self.last_zxid, self.session = True, 0x40, 7
        self.lease: _Stat | None = None
        self.watermark: bytes | None = None
        self.looks: list[str] = []

    @property
    def client_id(self) -> tuple[int, bytes] | None:
        return (self.session, b"") if self.session else None

    def ensure_path(self, path: str) -> None:
        self.lease = self.lease or _Stat(0x12, 1_700_000_000_000)

    def get(self, path: str) -> tuple[bytes, None]:
        from kazoo.exceptions import NoNodeError

        assert path.endswith("/watermark"), path
        if self.watermark is None:
            raise NoNodeError(path)
        return self.watermark, None

    def sync(self, path: str) -> None:
        self.looks.append(f"sync {path}")

    def exists(self, path: str) -> _Stat | None:
        self.looks.append(f"exists {path}")
        return self.lease


def _joined() -> tuple[LostHistoryWatch, _SessionClient]:
    watch, client = LostHistoryWatch("zk1:2181", 4.0, _Clock()), _SessionClient()
    watch.join(client, "/tw/T/shard-0-of-1/lease")
    client.looks.clear()
    return watch, client


def test_a_new_session_that_still_finds_the_shards_tree_is_an_ordinary_expiry_synced_with_once() -> None:
    watch, client = _joined()
    watch.check(client)
    assert client.looks == ["exists /tw/T/shard-0-of-1/lease"]  # the session that created the tree: no sync
    client.looks.clear()
    client.session = 8  # expired and replaced: the replica's ephemeral nodes went, the tree stays
    for _ in range(3):
        watch.check(client)
    assert client.looks == ["sync /tw/T/shard-0-of-1/lease", "exists /tw/T/shard-0-of-1/lease",
                            "exists /tw/T/shard-0-of-1/lease", "exists /tw/T/shard-0-of-1/lease"]
    client.session = 0  # kazoo reconnecting: no session to look under
    watch.check(client)
    assert len(client.looks) == 4


@pytest.mark.parametrize("lease", [None, _Stat(0x12, 1_700_000_999_000), _Stat(0x9d, 1_700_000_000_000)],
                         ids=["gone", "created-again-same-zxid", "created-again"])
def test_the_lease_path_gone_under_the_session_that_found_it_was_deleted_by_hand(lease: _Stat | None) -> None:
    """ZooKeeper never removes it: under a live session only a delete (zkCli's `deleteall`, a tool) takes it,
    and every round then failed with NoNodeError while the replica stayed ready."""
    from coordination.errors import LeasePathDeletedError

    watch, client = _joined()
    client.session = 8
    watch.check(client)  # a new session that still finds it: looked for under it from now on
    client.lease = lease
    with pytest.raises(LeasePathDeletedError) as e:
        watch.check(client)
    assert (e.value.lease_path, e.value.watermark_path) == ("/tw/T/shard-0-of-1/lease", "/tw/T/shard-0-of-1/watermark")
    assert "by hand or by a tool" in str(e.value) and "exit code 3" in str(e.value)
    assert "delete /tw/T/shard-0-of-1/watermark" in str(e.value)


@pytest.mark.parametrize("lease", [None, _Stat(0x9d, 1_700_000_000_000, cversion=2)], ids=["gone", "created-again"])
def test_a_start_is_refused_while_the_watermark_holds_an_epoch_the_lease_path_cannot_have_given(
        lease: _Stat | None) -> None:
    """Within one history the lease path's child version is never below an epoch its children gave; created
    again it counts from 0, and the next holder's epoch would be at or below the watermark's."""
    from coordination.errors import LeasePathDeletedError

    watch, client = LostHistoryWatch("zk1:2181", 4.0, _Clock()), _SessionClient()
    client.lease, client.watermark = lease, b'{"epoch": 5, "watermark_ms": 1, "replica": "a", "published_ms": 1}'
    with pytest.raises(LeasePathDeletedError, match="holds epoch 5") as e:
        watch.join(client, "/tw/T/shard-0-of-1/lease")
    assert e.value.watermark_epoch == 5 and client.lease is lease  # nothing created
    assert ("is gone" if lease is None else "its next epoch would be 3") in str(e.value)
    client.lease = _Stat(0x12, 1_700_000_000_000, cversion=5)  # the path that gave epoch 5: joined
    watch.join(client, "/tw/T/shard-0-of-1/lease")
    client.watermark = b"{not json"  # unreadable: says nothing of the epochs (the replica's rounds report it)
    LostHistoryWatch("zk1:2181", 4.0, _Clock()).join(client, "/tw/T/shard-0-of-1/lease")


@pytest.mark.parametrize("lease", [None, _Stat(0x12, 1_700_000_999_000), _Stat(0x9d, 1_700_000_000_000)],
                         ids=["gone", "created-again-same-zxid", "created-again"])
def test_a_new_session_without_the_shards_tree_it_joined_is_a_lost_history(lease: _Stat | None) -> None:
    watch, client = _joined()
    client.session, client.lease, client.last_zxid = 8, lease, 0x300
    with pytest.raises(ZooKeeperHistoryLostError) as e:
        watch.check(client)
    assert e.value.lost_path == "/tw/T/shard-0-of-1/lease" and (e.value.seen_zxid, e.value.server_zxid) == (0x12, 0x300)
    assert "new session at transaction 0x300" in str(e.value) and "'zk1:2181'" in str(e.value)
    assert "/tw/T/shard-0-of-1/lease" in str(e.value) and "restart" in str(e.value)


def test_a_replica_client_tries_again_at_least_every_half_session_however_long_zookeeper_is_down() -> None:
    """kazoo's own wait between reconnects doubles up to an hour: after a long outage a replica stayed
    away about as long again after ZooKeeper was back."""
    from kazoo.retry import ForceRetryError

    from coordination import HAConfig, ShardReplica

    cfg = HAConfig(zookeeper="zk1:2181", replica_id="a", session_timeout_s=4.0, watermark_interval_s=0.2)
    retry = ShardReplica(cfg, "TW_DELAY", now_ms=lambda: 0)._client._conn_retry.copy()  # kazoo's policy, not started
    waits: list[float] = []
    retry.sleep_func, retry.interrupt = waits.append, None
    failures = iter(range(40))  # a connect refused 40 times: hours of kazoo's default doubling

    def connect() -> None:
        if next(failures) < 39:
            raise ForceRetryError("ZooKeeper down")

    retry(connect)
    assert len(waits) == 39 and max(waits) <= 4.0 / 2 * 1.4  # half a session, with kazoo's jitter


class _StuckClient(_SessionClient):
    """A client that drops its connection after the join, whose replica thread waits on a queued request
    (kazoo keeps it until a connection is made) and so never looks again: only `stop()` fails that request."""

    def __init__(self) -> None:
        super().__init__()
        self.last_zxid = 0x1F5
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()


def test_a_replica_thread_waiting_on_a_request_queued_while_reconnecting_is_released_when_zookeeper_is_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's own thread probes, stops the client (failing the request the replica's thread waits on)
    and the replica's next look raises what it found."""
    monkeypatch.setattr(_history, "ensemble_zxid", lambda hosts, timeout_s: 0x1)
    watch, client, stopping = LostHistoryWatch("zk1:2181", 0.2, time.monotonic), _StuckClient(), threading.Event()
    watch.join(client, "/tw/T/shard-0-of-1/lease", stopping)
    try:
        client.connected = False  # the replica's thread is now blocked: nobody calls `check`
        assert client.stopped.wait(30.0), "the watch never stopped the client its replica's thread waits on"
        with pytest.raises(ZooKeeperHistoryLostError, match="0x1f5"):
            watch.check(client)
    finally:
        stopping.set()


def test_the_watch_thread_stops_nothing_while_zookeeper_is_the_same_history(monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[str] = []

    def probe(hosts: str, timeout_s: float) -> int:
        probes.append(hosts)
        return 0x300  # past what the client saw: the same history

    monkeypatch.setattr(_history, "ensemble_zxid", probe)
    watch, client, stopping = LostHistoryWatch("zk1:2181", 0.05, time.monotonic), _StuckClient(), threading.Event()
    watch.join(client, "/tw/T/shard-0-of-1/lease", stopping)
    try:
        client.connected = False
        deadline = time.monotonic() + 30.0
        while len(probes) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(probes) >= 3 and not client.stopped.is_set()
        watch.check(client)  # nothing found: no error
    finally:
        stopping.set()
