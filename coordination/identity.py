"""A replica's data directory: which replica of which shard it is, where it stands, and whether it may hold the lease.

`<data_dir>/ha-replica.json` is written at the first start with `[ha]`:

    {"delay_topic": T, "shards": N, "shard": K, "replica_id": R,
     "offsets": {"<broker>:<queue id>": O, ...}, "gap": null | "what was missed"}

- **Identity.** A directory started again as another replica (another shard, shard count, id or
  delay topic) is refused (`ReplicaIdentityMismatch`, naming both): its schedule is another shard's.
- **Where it stands.** `offsets` is, per queue, the offset below which this directory stored
  everything (written about every second while it runs). A replica starts each queue there, and a
  queue it has no offset for at its earliest retained offset, never at its group's committed
  offset: a wiped directory starts from the beginning, a restored backup from where the backup
  stood.
- **Eligibility.** A replica contends for the lease only once its directory holds its shard's whole
  retained history: every queue was read, from there, up to the end the broker had at least once,
  and the broker never moved an offset past messages it had not read (PULL_OFFSET_MOVED: retention
  removed them first). Such a move is a gap; it is kept in `gap` and the directory stays ineligible
  (rebuild it, or start with `--force-lease`, which says what may be lost). A replica that is not
  eligible consumes, stores and follows the holder's watermark as any standby; it only does not
  create its lease node.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from coordination.config import HAConfig
from coordination.errors import CoordinationError

__all__ = ["IDENTITY_FILE", "Eligibility", "ReplicaDataDir", "ReplicaIdentityMismatch"]

#: the file, in the data directory, that names the replica and holds where it stands
IDENTITY_FILE = "ha-replica.json"

#: (when every queue last held nothing more to read, None: not yet; the broker's offset moves so far)
CatchUp = Callable[[], "tuple[int | None, list[str]]"]


class ReplicaIdentityMismatch(CoordinationError):
    """The data directory belongs to another replica (shard, shard count, replica id or delay topic)."""


@dataclass(frozen=True)
class _Identity:
    delay_topic: str
    shards: int
    shard: int
    replica_id: str

    def describe(self) -> str:
        return f"replica {self.replica_id!r} of shard {self.shard} of {self.shards} on {self.delay_topic}"


class ReplicaDataDir:
    """The identity file of one replica's data directory: claimed at start, its offsets saved while it runs."""

    def __init__(self, data_dir: str | os.PathLike[str], cfg: HAConfig, delay_topic: str) -> None:
        """Read the file (or create it for a directory new to replica sets); ReplicaIdentityMismatch
        when it names another replica."""
        self.path = Path(data_dir) / IDENTITY_FILE
        self.identity = _Identity(delay_topic, cfg.shards, cfg.shard, cfg.replica_id)
        self._lock = threading.Lock()
        doc: dict[str, Any] = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                found = _Identity(str(doc["delay_topic"]), int(doc["shards"]), int(doc["shard"]), str(doc["replica_id"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ReplicaIdentityMismatch(f"{self.path} cannot be read ({e}); it names the replica this data "
                                              "directory belongs to: restore it or use another directory") from e
            if found != self.identity:
                raise ReplicaIdentityMismatch(
                    f"the data directory {self.path.parent} belongs to {found.describe()}, and this process is "
                    f"configured as {self.identity.describe()}: its schedule is another replica's. Start it with "
                    "that replica's [ha] settings, or give this replica a data directory of its own")
        offsets = doc.get("offsets")
        #: per queue, the offset below which this directory stored everything (empty: new to replica sets)
        self.offsets: dict[str, int] = {str(k): int(v) for k, v in offsets.items()} if isinstance(offsets, dict) else {}
        gap = doc.get("gap")
        #: what this directory missed (None: nothing known)
        self.gap: str | None = str(gap) if gap else None
        self.new = not self.path.exists()
        self._write()

    def save(self, offsets: dict[str, int], gap: str | None = None) -> None:
        """Record where this directory stands (offsets only move forward) and a gap, if one appeared."""
        with self._lock:
            merged = {**self.offsets, **{q: max(o, self.offsets.get(q, o)) for q, o in offsets.items()}}
            if merged == self.offsets and (gap is None or gap == self.gap):
                return
            self.offsets = merged
            if gap is not None:
                self.gap = gap
            self._write()

    def _write(self) -> None:
        doc = {**vars(self.identity), "offsets": self.offsets, "gap": self.gap}
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class Eligibility:
    """Whether this replica may contend for its shard's lease (the module docstring says when)."""

    def __init__(self, data_dir: ReplicaDataDir, catch_up: CatchUp, offsets: Callable[[], dict[str, int]], *,
                 force: bool = False) -> None:
        """`catch_up`: the ingest's `catch_up`; `offsets`: its stored offsets; `force`: contend anyway."""
        self.data_dir = data_dir
        self.force = force
        self._catch_up = catch_up
        self._offsets = offsets
        self._eligible = False
        self.reason = "not checked yet"

    def check(self) -> bool:
        """Save where the directory stands, and say whether it may contend now (once it may, it stays so)."""
        caught_up, moved = self._catch_up()
        gap = f"the broker moved offsets past unread messages: {'; '.join(moved[:4])}" if moved else None
        self.data_dir.save(self._offsets(), gap)
        if self._eligible:
            return True
        if self.data_dir.gap is not None:
            self.reason = f"gap: {self.data_dir.gap}; rebuild the directory from a replica that has no gap"
        elif caught_up is None:
            self.reason = "catching up: not every queue of the shard was read to its end yet"
        else:
            self.reason, self._eligible = "caught up", True
        if self.force and not self._eligible:
            self.reason = f"forced (--force-lease) despite: {self.reason}"
            self._eligible = True
        return self._eligible

    def status(self) -> dict[str, object]:
        """For `timewheel status`: eligible or not, and why."""
        return {"eligible": self._eligible, "eligibility": self.reason, "gap": self.data_dir.gap}
