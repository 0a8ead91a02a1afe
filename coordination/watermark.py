"""A shard's delivered-up-to watermark as a znode: written by the lease holder, read by the others.

The znode `<shard>/watermark` holds JSON: `{"epoch": E, "watermark_ms": W, "replica": R,
"published_ms": T}`. Every message of the shard due at or before W was delivered (or otherwise
finished) by replica R while it held the lease with epoch E. A write is a compare-and-set on the
znode's version, and refused when the stored epoch is newer: a holder that lost its lease cannot
move the watermark of its successor.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from timewheel.gate import NO_WATERMARK

__all__ = ["Watermark", "publish_watermark", "read_watermark"]


@dataclass(frozen=True)
class Watermark:
    """What the last holder published (epoch 0 and NO_WATERMARK: nothing yet)."""

    epoch: int = 0
    watermark_ms: int = NO_WATERMARK
    replica: str = ""
    published_ms: int = 0

    def to_json(self) -> bytes:
        """The znode's data."""
        return json.dumps({"epoch": self.epoch, "watermark_ms": self.watermark_ms, "replica": self.replica,
                           "published_ms": self.published_ms}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Watermark":
        """Parse the znode's data (empty: nothing published)."""
        if not data:
            return cls()
        doc = json.loads(data)
        return cls(int(doc["epoch"]), int(doc["watermark_ms"]), str(doc["replica"]), int(doc["published_ms"]))


def read_watermark(client: KazooClient, shard_path: str) -> Watermark:
    """The shard's watermark (the empty one when none was published)."""
    try:
        data, _ = client.get(f"{shard_path}/watermark")
    except NoNodeError:
        return Watermark()
    return Watermark.from_json(data)


def publish_watermark(client: KazooClient, shard_path: str, mark: Watermark) -> bool:
    """Write `mark` unless a newer epoch wrote already; never moves it back within an epoch.

    Returns False when a newer epoch owns the watermark (the caller lost its lease).
    """
    path = f"{shard_path}/watermark"
    for _ in range(5):
        try:
            data, stat = client.get(path)
        except NoNodeError:
            try:
                client.create(path, mark.to_json(), makepath=True)
                return True
            except NodeExistsError:
                continue
        old = Watermark.from_json(data)
        if old.epoch > mark.epoch:
            return False
        if old.epoch == mark.epoch and old.watermark_ms >= mark.watermark_ms:
            return True
        try:
            client.set(path, mark.to_json(), version=stat.version)
            return True
        except BadVersionError:
            continue
    return False
