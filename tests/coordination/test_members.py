"""Replicas of one delay topic must share `root` and `shards`: a replica that does not is refused at start.

Replicas that disagree on either coordinate under different znodes and never see each other's
leases: each held a lease of its own and both delivered the queues they share. They meet at the
delay topic's members (`coordination.members`), a path no setting moves.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from coordination import CoordinationError, HAConfig, LocalZooKeeper, ReplicaIdTaken, ReplicaSetMismatch, ShardReplica
from coordination.members import SETS_PATH, Membership, mismatch
from tests.coordination.cluster import wait_for


def _now() -> int:
    return time.time_ns() // 1_000_000


def _member(**kw: object) -> dict[str, object]:
    return {"root": "/timewheel", "shards": 1, "shard": 0, "replica_id": "a", "namesrv": [], "host": "h1", "pid": 7,
            **kw}


# ---- fast: the rule, and the registration against a scripted client --------------------------------------------


def test_another_root_is_refused_naming_the_setting_both_values_and_the_peer() -> None:
    refused = mismatch(_member(root="/other", replica_id="b"), [_member()], "TW_DELAY")
    assert isinstance(refused, ReplicaSetMismatch)
    assert (refused.setting, refused.ours, refused.theirs) == ("root", "/other", "/timewheel")
    assert str(refused).startswith("ha.root = '/other' differs from the live replica 'a' (shard 0 of 1, host h1, "
                                   "pid 7) of delay topic TW_DELAY, which has ha.root = '/timewheel'")
    # serve refuses it in one line (exit 2), as it does a replica id that is live elsewhere
    assert isinstance(refused, ReplicaIdTaken) and isinstance(refused, CoordinationError)


def test_another_shard_count_is_refused_and_another_shard_of_the_same_split_is_not() -> None:
    refused = mismatch(_member(shards=2, replica_id="b"), [_member()], "TW_DELAY")
    assert refused is not None and (refused.setting, refused.ours, refused.theirs) == ("shards", 2, 1)
    peers = [_member(shards=2, shard=0), _member(shards=2, shard=1, replica_id="b")]
    assert mismatch(_member(shards=2, shard=1, replica_id="c"), peers, "TW_DELAY") is None


def test_a_member_on_another_rocketmq_cluster_is_not_compared_and_one_that_names_none_is() -> None:
    ours = _member(root="/staging", namesrv=["ns-b:9876"])
    assert mismatch(ours, [_member(namesrv=["ns-a:9876"])], "TW_DELAY") is None
    assert mismatch(ours, [_member(namesrv=["ns-a:9876", "ns-b:9876"])], "TW_DELAY") is not None  # one shared
    assert mismatch(ours, [_member()], "TW_DELAY") is not None  # no NameServer said: any cluster
    # a member of a later version with a field it does not write is compared on what it says
    assert mismatch(_member(), [{"root": "/timewheel", "replica_id": "z"}], "TW_DELAY") is None


class _Client:
    """The part of KazooClient a member uses, over a dict of znodes; `session` is the live session."""

    def __init__(self) -> None:
        self.nodes: dict[str, bytes] = {}
        self.session = 1
        self._seq = 0

    @property
    def client_id(self) -> tuple[int, bytes]:
        return (self.session, b"")

    def create(self, path: str, value: bytes, **_kw: object) -> str:
        self._seq += 1
        node = f"{path}{self._seq:010d}"
        self.nodes[node] = value
        return node

    def get_children(self, path: str) -> list[str]:
        return [n.rsplit("/", 1)[1] for n in self.nodes if n.rsplit("/", 1)[0] == path]

    def get(self, path: str) -> tuple[bytes, None]:
        if path not in self.nodes:
            raise NoNodeError(path)
        return self.nodes[path], None

    def delete(self, path: str) -> None:
        del self.nodes[path]


def _joined(client: _Client, topic: str = "TW_DELAY", **cfg: object) -> Membership:
    m = Membership(HAConfig(zookeeper="127.0.0.1:2181", **{"replica_id": "a", **cfg}), topic,  # type: ignore[arg-type]
                   "127.0.0.1:9876")
    m.join(client)
    return m


def test_a_refused_replica_takes_its_member_node_away_and_one_running_registers_again_unchecked() -> None:
    client = _Client()
    a = _joined(client)
    assert [json.loads(v)["root"] for v in client.nodes.values()] == ["/timewheel"]
    a.join(client)  # the same session: registered once
    assert len(client.nodes) == 1
    with pytest.raises(ReplicaSetMismatch, match=r"^ha.root = '/elsewhere' differs"):
        _joined(client, root="/elsewhere", replica_id="b")
    assert len(client.nodes) == 1  # nothing left of the refused one
    with pytest.raises(ReplicaSetMismatch, match=r"^ha.shards = 3 differs"):
        _joined(client, shards=3, replica_id="b")
    _joined(client, topic="TW_OTHER", root="/elsewhere", replica_id="b")  # another delay topic: not compared
    client.session = 2  # a's session expired: its node went with it, and a new one is registered, unchecked
    client.nodes = {k: v for k, v in client.nodes.items() if "TW_OTHER" in k}
    client.nodes[f"{SETS_PATH}/TW_DELAY/member-0000000099"] = json.dumps(_member(root="/x")).encode()
    a.join(client)
    assert sorted(json.loads(v)["root"] for k, v in client.nodes.items() if "TW_DELAY/" in k) == ["/timewheel", "/x"]


# ---- the real ZooKeeper ------------------------------------------------------------------------------------


@pytest.fixture
def start(zookeeper: LocalZooKeeper) -> Iterator[Callable[..., ShardReplica]]:
    topic = f"TW_DELAY_{uuid.uuid4().hex[:8]}"
    made: list[ShardReplica] = []

    def make(name: str, namesrv: str = "", **kw: object) -> ShardReplica:
        cfg = HAConfig(zookeeper=zookeeper.connect_string, replica_id=name, session_timeout_s=2.0,
                       watermark_interval_s=0.2, **kw)  # type: ignore[arg-type]
        r = ShardReplica(cfg, topic, now_ms=_now, namesrv=namesrv)
        made.append(r)
        return r.start(lambda: 1)

    yield make
    for r in made:
        r.stop()


@pytest.mark.parametrize("other, setting", [({"root": "/elsewhere"}, "root"), ({"shards": 2}, "shards")],
                         ids=["root", "shards"])
def test_a_replica_with_another_root_or_shard_count_is_refused_beside_its_live_peers(
        start: Callable[..., ShardReplica], zookeeper: LocalZooKeeper, other: dict[str, object],
        setting: str) -> None:
    """Before, the second replica held a lease of its own (epoch 1 under its root, beside a's) and both sent."""
    a = start("a")
    wait_for("a holds the lease", a.may_send)
    with pytest.raises(ReplicaSetMismatch, match=rf"^ha.{setting} = .* differs from the live replica 'a' "):
        start("b", **other)
    assert a.may_send()
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start()
    try:
        refused_root = str(other.get("root", "/timewheel"))
        shards = int(other.get("shards", 1))  # type: ignore[call-overload]
        assert client.exists(f"{refused_root}/{a.delay_topic}/shard-0-of-{shards}") is None  # it took nothing
        members = client.get_children(f"{SETS_PATH}/{a.delay_topic}")
        assert [json.loads(client.get(f"{SETS_PATH}/{a.delay_topic}/{m}")[0])["replica_id"] for m in members] == ["a"]
    finally:
        client.stop()
        client.close()


def test_replicas_that_agree_join_and_one_on_another_cluster_or_after_the_set_left_is_not_refused(
        start: Callable[..., ShardReplica]) -> None:
    a = start("a", "127.0.0.1:9876", shards=2)
    b = start("b", "127.0.0.1:9876", shards=2, shard=1)  # the other shard of the same split
    c = start("c", "127.0.0.1:9876", shards=2)  # a's standby
    wait_for("a and b hold their shards' leases", lambda: a.may_send() and b.may_send())
    assert not c.may_send()
    # a deployment of the same delay topic's name on another RocketMQ cluster, under a root of its own
    other = start("a", "10.0.0.9:9876", root="/staging")
    wait_for("the other deployment holds its own lease", other.may_send)
    for r in (a, b, c, other):
        r.stop()
    # a set stopped is forgotten: all its replicas may start again under another root
    wait_for("a moved set holds", start("a", root="/moved").may_send)
