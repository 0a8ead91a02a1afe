"""A ZooKeeper whose ACLs refuse a replica's writes under its shard's path (made with kazoo on the
session's real ZooKeeper)."""
from __future__ import annotations

import time
import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.security import ACL, Id, Permissions

from coordination import HAConfig, LocalZooKeeper, ShardReplica, ZooKeeperJoinError


def test_a_root_whose_acl_denies_creating_the_shard_is_a_one_line_error_naming_the_acl_and_ha_root(
        zookeeper: LocalZooKeeper) -> None:
    root = f"/tw_acl_{uuid.uuid4().hex[:8]}"
    admin = KazooClient(hosts=zookeeper.connect_string)
    admin.start(timeout=30)
    try:
        admin.create(root, acl=[ACL(Permissions.READ, Id("world", "anyone"))])  # read-only for everyone
        cfg = HAConfig(zookeeper=zookeeper.connect_string, root=root, replica_id="a", session_timeout_s=2.0,
                       watermark_interval_s=0.2)
        replica = ShardReplica(cfg, "TW_DELAY", now_ms=lambda: time.time_ns() // 1_000_000)
        with pytest.raises(ZooKeeperJoinError) as caught:
            replica.start(lambda: 0, timeout=30)
        message = str(caught.value)
        assert "NoAuthError" in message and "ACL" in message and "ha.root" in message, message
        assert "start it again" not in message, message  # starting again meets the same ACL
        assert not replica._client.connected and replica.dead_threads() == []
    finally:
        admin.delete(root)
        admin.stop()
        admin.close()
