"""Coordination of replica sets through ZooKeeper: shard leases, fencing, watermarks, the local ZooKeeper.

A shard of the delay topic (its queues with id mod `shards` == `shard`) is served by several
replicas, each a whole engine with its own consumer group and data directory. `ShardReplica`
holds or follows the shard's lease and is its engine's `timewheel.gate.DeliveryGate` (refused at
start, `ReplicaSetMismatch`, when a live replica of its delay topic has another root or shard count);
`FencedSink` is where a send batch's fence is decided (before it goes and at the write), and
`FencedDeadLetters` keeps a replica that may not send from dead-lettering; `EpochStampingSink` marks what the holder sends with its epoch; `shard_status` reads every shard's
holder, epoch and watermark for `timewheel status`. `LocalZooKeeper` runs a real server from
Maven Central jars for tests, the demo and `timewheel zookeeper`.
"""
from coordination.config import HAConfig
from coordination.errors import (CoordinationError, DedupeBrokersUnpublishedError, LeasePathDeletedError,
                                 LocalZooKeeperError, ZooKeeperHistoryLostError, ZooKeeperJoinError,
                                 ZooKeeperUnreachableError)
from coordination.fencing import FencingDeadline
from coordination.local_zookeeper import LocalZooKeeper, ruok
from coordination.epoch_sink import EPOCH_PROPERTY, EpochStampingSink
from coordination.fenced_sink import FencedDeadLetters, FencedSink, NotHoldingError
from coordination.members import ReplicaSetMismatch
from coordination.replica import ReplicaCounters, ReplicaIdTaken, ShardReplica
from coordination.status import ShardStatus, shard_status
from coordination.watermark import Watermark, publish_watermark, read_watermark

__all__ = ["EPOCH_PROPERTY", "CoordinationError", "DedupeBrokersUnpublishedError", "EpochStampingSink", "FencedDeadLetters", "FencedSink", "FencingDeadline", "HAConfig",
           "LeasePathDeletedError", "LocalZooKeeper", "LocalZooKeeperError", "NotHoldingError", "ReplicaCounters", "ReplicaIdTaken", "ReplicaSetMismatch",
           "ShardReplica", "ShardStatus", "Watermark", "ZooKeeperHistoryLostError", "ZooKeeperJoinError", "ZooKeeperUnreachableError",
           "publish_watermark", "read_watermark", "ruok", "shard_status"]
