"""The typed `[ha]` configuration: where the leases live and which shard this replica serves."""
from __future__ import annotations

import math
from dataclasses import dataclass

from timewheel.errors import ConfigError

__all__ = ["HAConfig"]


@dataclass(frozen=True)
class HAConfig:
    """Replica sets; field names are the TOML keys of `[ha]`. Off while `zookeeper` is empty."""

    zookeeper: str = ""  # connect string, "HOST:PORT[,HOST:PORT...]"; empty: no replica set
    root: str = "/timewheel"  # the znode under which every shard's lease and watermark live
    shards: int = 1  # the delay topic's queues split into this many shards (queue id mod shards)
    shard: int = 0  # the shard this engine is a replica of
    replica_id: str = ""  # this replica's name, unique within its shard (part of its consumer group)
    session_timeout_s: float = 6.0  # ZooKeeper session: a holder silent this long loses the lease
    fence_fraction: float = 0.6  # a holder stops sending this fraction of the session after its last contact
    watermark_interval_s: float = 1.0  # how often the holder publishes its delivered-up-to watermark
    hold_ms: int = 200  # how often a replica that may not send looks at what it holds
    # a holder kept from sending this long by brokers it cannot publish gives up the lease and stops
    dedupe_brokers_publish_timeout_s: float = 60.0
    # contend for the lease even while the data directory has a gap or is still catching up: as holder
    # it would not send what it never read (messages older than the delay topic's retention, or skipped)
    force_eligible: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("zookeeper", not self.zookeeper or all(_host_port(a) for a in self.zookeeper.split("/")[0].split(",")),
             "HOST:PORT[,HOST:PORT...] (optionally followed by a /chroot)"),
            # ZooKeeper paths have no relative steps: the client would refuse this one with a bare ValueError
            ("zookeeper", not ({".", ".."} & set(self.zookeeper.partition("/")[2].split("/"))),
             "HOST:PORT[,HOST:PORT...] followed by an absolute /chroot, without '.' or '..' steps"),
            ("root", self.root.startswith("/") and not self.root.endswith("/") and "//" not in self.root,
             "an absolute znode path such as /timewheel"),
            ("shards", 1 <= self.shards <= 1024, "between 1 and 1024"),
            ("shard", 0 <= self.shard < self.shards, f"between 0 and shards - 1 ({self.shards - 1})"),
            ("replica_id", not self.zookeeper or (bool(self.replica_id) and self.replica_id.replace("-", "").replace(
                "_", "").isalnum()), "set, of letters, digits, '-' and '_', when ha.zookeeper is set"),
            ("session_timeout_s", 1.0 <= self.session_timeout_s <= 60.0, "between 1 and 60 seconds"),
            ("fence_fraction", 0.1 <= self.fence_fraction <= 0.9, "between 0.1 and 0.9 (margin for clock rates)"),
            ("watermark_interval_s", 0.05 <= self.watermark_interval_s <= self.session_timeout_s,
             "between 0.05 s and the session timeout"),
            ("hold_ms", 10 <= self.hold_ms <= 5000, "between 10 and 5000"),
            ("dedupe_brokers_publish_timeout_s", 0 < self.dedupe_brokers_publish_timeout_s < math.inf,
             "a finite number of seconds above 0 (a holder that cannot publish must give up at some point)"),
            # a holder confirms its lease with each watermark: two rounds must fit inside its fencing
            # period, or its deadline runs out between confirmations while a successor may be starting
            ("watermark_interval_s", self.watermark_interval_s <= self.fence_fraction * self.session_timeout_s / 2,
             f"at most fence_fraction x session_timeout_s / 2 "
             f"({self.fence_fraction * self.session_timeout_s / 2:g} s), well inside the fencing period"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(f"ha.{name} = {getattr(self, name)!r} is invalid: it must be {want}")

    @property
    def enabled(self) -> bool:
        """True when this engine runs as one replica of a shard."""
        return bool(self.zookeeper)

    def owns_queue(self, queue_id: int) -> bool:
        """Whether a delay-topic queue belongs to this replica's shard."""
        return queue_id % self.shards == self.shard

    def consumer_group(self, base: str) -> str:
        """The consumer group this replica reads its shard under (its own: each replica reads everything)."""
        return f"{base}-shard{self.shard}-{self.replica_id}"

    def shard_path(self, delay_topic: str, shard: int | None = None) -> str:
        """The znode of one shard of `delay_topic` (this replica's by default)."""
        k = self.shard if shard is None else shard
        return f"{self.root}/{delay_topic}/shard-{k}-of-{self.shards}"


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
