"""Every shard's holder, epoch and watermark, as ZooKeeper has them (for `timewheel status`)."""
from __future__ import annotations

from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError

from coordination._history import lease_path_deleted
from coordination.config import HAConfig
from coordination.errors import LeasePathDeletedError
from coordination.replica import epoch_of, lease_sequence
from coordination.watermark import MalformedWatermark, Watermark, read_watermark

__all__ = ["ShardStatus", "shard_status", "shards_document"]

_PREFIX = "replica-"


@dataclass(frozen=True)
class ShardStatus:
    """One shard: who holds its lease (None: nobody), with which epoch, the replicas waiting, the watermark."""

    shard: int
    holder: str | None
    epoch: int
    standbys: tuple[str, ...]
    watermark_ms: int
    watermark_epoch: int
    published_ms: int

    def as_dict(self, now_ms: int) -> dict[str, object]:
        """JSON-ready, with the watermark's lag behind `now_ms` (None before the first watermark)."""
        return {"shard": self.shard, "holder": self.holder, "epoch": self.epoch, "standbys": list(self.standbys),
                "watermark_ms": self.watermark_ms, "watermark_epoch": self.watermark_epoch,
                "published_ms": self.published_ms,
                "lag_ms": now_ms - self.watermark_ms if self.watermark_ms >= 0 else None}


def shard_status(client: KazooClient, cfg: HAConfig, delay_topic: str) -> list[ShardStatus]:
    """Read every shard of `delay_topic` (cfg.shards of them) from a connected client."""
    out = []
    for k in range(cfg.shards):
        path = cfg.shard_path(delay_topic, k)
        try:
            nodes = sorted((c for c in client.get_children(f"{path}/lease") if c.startswith(_PREFIX)),
                           key=lease_sequence)
        except NoNodeError:
            nodes = []
        names = []
        for n in nodes:
            try:
                names.append((n, client.get(f"{path}/lease/{n}")[0].decode()))
            except NoNodeError:  # left while we read
                continue
        try:
            mark = read_watermark(client, path)
        except MalformedWatermark:
            mark = Watermark()
        holder = names[0] if names else None
        out.append(ShardStatus(k, holder[1] if holder else None, epoch_of(holder[0]) if holder else 0,
                               tuple(n for _, n in names[1:]), mark.watermark_ms, mark.epoch, mark.published_ms))
    return out


def shards_document(client: KazooClient, cfg: HAConfig, delay_topic: str, now_ms: int) -> dict[str, object]:
    """Every shard as `timewheel status` shows it ("shards"), and what keeps them from being read or held
    ("shards_error"): ZooKeeper not answering, or a shard's lease path deleted by hand (in the words of
    LeasePathDeletedError: nobody can hold that shard's lease until an operator acts)."""
    try:
        doc: dict[str, object] = {"shards": [s.as_dict(now_ms) for s in shard_status(client, cfg, delay_topic)]}
        deleted = [e for e in (lease_path_deleted(client, f"{cfg.shard_path(delay_topic, k)}/lease")
                               for k in range(cfg.shards)) if e is not None]
    except (KazooException, KazooTimeoutError) as e:
        return {"shards_error": f"ZooKeeper did not answer: {e}"}
    if deleted:  # the running replicas' words (they stop with it): the start's would say "does not start"
        doc["shards_error"] = " ".join(str(LeasePathDeletedError(e.lease_path, e.watermark_path)) for e in deleted)
    return doc
